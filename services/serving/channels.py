"""Client channels to other stages, one per target address, reused across requests."""

from __future__ import annotations

import grpc

from services.serving.grpc_server import DEFAULT_MAX_MESSAGE_BYTES, channel_options
from services.serving.security import TLSConfig, secure_or_insecure_channel


class ChannelPool:
    def __init__(self, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, tls: TLSConfig = TLSConfig()):
        self.max_message_bytes = max_message_bytes
        self.tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}  # "host:port" -> channel

    def get(self, target: str) -> grpc.aio.Channel:
        channel = self._channels.get(target)
        if channel is None:
            channel = secure_or_insecure_channel(target, self.tls, channel_options(self.max_message_bytes))
            self._channels[target] = channel
        return channel

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
