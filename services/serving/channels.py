"""Client channels to other stages, one per target address, reused across requests.

When the TLS files rotate (security.TLSFiles), the next `get` opens a new channel with the new
certificate; the old one is closed once the calls on it have finished (at most RETIRE_GRACE_S),
so a stream that was running through the rotation is not cut."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace

import grpc

from services.serving.grpc_server import DEFAULT_MAX_MESSAGE_BYTES, channel_options
from services.serving.security import TLSConfig, secure_or_insecure_channel

# Longer than any stream (the stages' 300 s drain bound), so retiring a channel never cancels one.
RETIRE_GRACE_S = 900.0
# Longer than a channel's longest reconnect backoff (grpc_server.channel_options: 1 s, +20 % jitter).
READY_WAIT_S = 1.5


class RotatingChannels:
    """target -> channel, rebuilt when the TLS material's generation moves."""

    def __init__(self, tls: TLSConfig, options: list):
        self.tls = tls
        # A channel of its own connections: a new channel after a rotation must handshake with the
        # new certificate, not share an old connection from gRPC's global subchannel pool.
        self.options = list(options) + [("grpc.use_local_subchannel_pool", 1)]
        self._channels: dict[str, tuple[grpc.aio.Channel, int]] = {}
        self._retiring: set[asyncio.Task] = set()

    def get(self, target: str, server_name: str | None = None) -> grpc.aio.Channel:
        generation, material = self.tls.latest()
        entry = self._channels.get(target)
        if entry is not None and entry[1] == generation:
            return entry[0]
        if entry is not None:
            self._retire(entry[0])
        if server_name and not material.server_name:
            material = replace(material, server_name=server_name)
        channel = secure_or_insecure_channel(target, material, self.options)
        self._channels[target] = (channel, generation)
        return channel

    def renew(self, target: str) -> None:
        """The next `get(target)` opens a new channel (a new DNS resolution); the current one closes
        after its calls."""
        entry = self._channels.pop(target, None)
        if entry is not None:
            self._retire(entry[0])

    async def wait_ready(self, target: str, timeout_s: float = READY_WAIT_S) -> None:
        """Give the channel to `target` up to `timeout_s` to connect before a stream is opened on it.

        The router sends a request to a replica as soon as its own health check sees it, while
        this process's channel to the same address may still sit in its reconnect backoff (the
        replica came back within the last second). A call on such a channel fails at once, and
        the stream would move to a fallback for nothing. Returns either way: on a replica that is
        really down the call that follows fails as it would have, `timeout_s` later."""
        channel = self.get(target)
        if channel.get_state(try_to_connect=True) is not grpc.ChannelConnectivity.READY:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(channel.channel_ready(), timeout_s)

    def _retire(self, channel: grpc.aio.Channel) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop (not how the services use it): the channel goes with its last call
            return
        task = loop.create_task(channel.close(grace=RETIRE_GRACE_S))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def drop(self, target: str) -> None:
        entry = self._channels.pop(target, None)
        if entry is not None:
            await entry[0].close()

    async def close(self) -> None:
        for channel, _ in self._channels.values():
            await channel.close()
        self._channels.clear()
        for task in list(self._retiring):
            task.cancel()


class ChannelPool(RotatingChannels):
    def __init__(self, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, tls: TLSConfig = TLSConfig()):
        super().__init__(tls, channel_options(max_message_bytes))
        self.max_message_bytes = max_message_bytes
