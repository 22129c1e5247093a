"""`omni-client`: call `omni.v1.Omni/Generate`, show text as it streams, write the audio.

The library part (`build_request`, `collect`) is what tests and the benchmark use: it records
when each text delta and audio chunk arrived, from which TTFT, TTFP and RTF follow (docs/architecture.md,
Measures).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from omni.v1 import common_pb2, omni_pb2, omni_pb2_grpc
from services.base.errors import UserError, run_cli
from services.base.stages import SPEECH_SAMPLE_RATE
from services.serving.grpc_server import channel_options
from services.serving.security import (
    TLSConfig,
    add_tls_flags,
    secure_or_insecure_channel,
    tls_from_args,
)
from services.serving.wire import audio_from_proto
from services.tools.reference import write_wav


def build_request(
    prompt: str,
    system: str | None = None,
    audio: bytes | None = None,
    image: bytes | None = None,
    voice: str | None = None,
    text_only: bool = False,
    max_new_tokens: int | None = None,
    talker_max_new_tokens: int | None = None,
    return_codec_frames: bool = False,
    request_id: str = "",
    video: bytes | None = None,
    use_audio_in_video: bool = False,
) -> omni_pb2.GenerateRequest:
    request = omni_pb2.GenerateRequest(request_id=request_id, return_codec_frames=return_codec_frames,
                                       use_audio_in_video=use_audio_in_video)
    if system:
        request.messages.add(role=omni_pb2.ROLE_SYSTEM).content.add(text=system)
    user = request.messages.add(role=omni_pb2.ROLE_USER)
    if audio is not None:
        user.content.add(audio=audio)
    if image is not None:
        user.content.add(image=image)
    if video is not None:
        user.content.add(video=video)
    user.content.add(text=prompt)
    request.output_modalities.append(omni_pb2.MODALITY_TEXT)
    if not text_only:
        request.output_modalities.append(omni_pb2.MODALITY_AUDIO)
    if voice:
        request.voice = voice
    if max_new_tokens is not None:
        request.thinker_sampling.max_new_tokens = max_new_tokens
    if talker_max_new_tokens is not None:
        request.talker_sampling.max_new_tokens = talker_max_new_tokens
    return request


@dataclass
class ClientResult:
    text: str = ""
    thinker_token_ids: list[int] = field(default_factory=list)
    codec_frames: list[list[int]] = field(default_factory=list)
    audio_chunks: list[np.ndarray] = field(default_factory=list)
    sample_rate: int = SPEECH_SAMPLE_RATE
    sent: float = 0.0  # perf_counter when the request was sent
    text_times: list[float] = field(default_factory=list)  # perf_counter per text delta
    audio_times: list[float] = field(default_factory=list)  # perf_counter per audio chunk
    final: omni_pb2.Final | None = None
    tool_call_deltas: list[omni_pb2.ToolCallDelta] = field(default_factory=list)  # as they streamed
    tool_calls: list[omni_pb2.ToolCall] = field(default_factory=list)  # each call whole

    @property
    def audio(self) -> np.ndarray:
        return np.concatenate(self.audio_chunks) if self.audio_chunks else np.zeros(0, np.float32)

    @property
    def audio_seconds(self) -> float:
        return sum(c.size for c in self.audio_chunks) / self.sample_rate

    @property
    def ttft_ms(self) -> float | None:
        return (self.text_times[0] - self.sent) * 1000 if self.text_times else None

    @property
    def ttfp_ms(self) -> float | None:
        return (self.audio_times[0] - self.sent) * 1000 if self.audio_times else None

    @property
    def rtf(self) -> float | None:
        seconds = self.audio_seconds
        return (self.audio_times[-1] - self.sent) / seconds if seconds > 0 else None

    def summary(self) -> dict:
        final = self.final
        return {
            "text": self.text,
            "thinker_token_ids": self.thinker_token_ids,
            "codec_frames": self.codec_frames,
            "audio_seconds": self.audio_seconds,
            "sample_rate": self.sample_rate,
            "ttft_ms": self.ttft_ms,
            "ttfp_ms": self.ttfp_ms,
            "rtf": self.rtf,
            "audio_chunks": len(self.audio_chunks),
            "text_finish_reason": common_pb2.FinishReason.Name(final.text_finish_reason) if final else None,
            "audio_finish_reason": common_pb2.FinishReason.Name(final.audio_finish_reason) if final else None,
        }


def collect(stub: omni_pb2_grpc.OmniStub, request: omni_pb2.GenerateRequest, timeout: float | None = None,
            on_event=None, token: str | None = None) -> ClientResult:
    """Run one Generate call to the end; raises grpc.RpcError on a non-OK status."""
    result = ClientResult(sent=time.perf_counter())
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    for response in stub.Generate(request, timeout=timeout, metadata=metadata):
        now = time.perf_counter()
        kind = response.WhichOneof("event")
        if kind == "text":
            result.text += response.text.text
            result.thinker_token_ids.extend(response.text.token_ids)
            result.text_times.append(now)
        elif kind == "audio":
            result.audio_chunks.append(audio_from_proto(response.audio))
            result.sample_rate = response.audio.sample_rate
            result.audio_times.append(now)
        elif kind == "codec_frames":
            groups = response.codec_frames.num_code_groups
            ids = list(response.codec_frames.ids)
            result.codec_frames.extend(ids[i:i + groups] for i in range(0, len(ids), groups))
        elif kind == "tool_call_delta":
            result.tool_call_deltas.append(response.tool_call_delta)
        elif kind == "tool_call":
            result.tool_calls.append(response.tool_call)
        elif kind == "final":
            result.final = response.final
        if on_event is not None:
            on_event(kind, response, result)
    return result


def connect(target: str, tls: TLSConfig = TLSConfig()) -> tuple[grpc.Channel, omni_pb2_grpc.OmniStub]:
    channel = secure_or_insecure_channel(target, tls, channel_options(), aio=False)
    return channel, omni_pb2_grpc.OmniStub(channel)


def _progress(kind: str, response, result: ClientResult) -> None:
    if kind == "text":
        sys.stdout.write(response.text.text)
        sys.stdout.flush()
    elif kind == "tool_call":
        sys.stdout.write(f"\n[call {response.tool_call.name}({response.tool_call.arguments})]\n")
    elif kind == "audio":
        sys.stderr.write(f"\r\x1b[2K[audio] {len(result.audio_chunks)} chunks, {result.audio_seconds:.2f} s\r")
        sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omni-client", description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="localhost:50051", help="router host:port")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--system")
    parser.add_argument("--audio", type=Path, help="wav/flac file for the user turn")
    parser.add_argument("--image", type=Path, help="png/jpeg file for the user turn")
    parser.add_argument("--video", type=Path, help="mp4/webm file for the user turn")
    parser.add_argument("--use-audio-in-video", action="store_true",
                        help="hear the video's audio track too, interleaved with its frames by time")
    parser.add_argument("--voice")
    parser.add_argument("--text-only", action="store_true", help="ask for text only (no talker)")
    parser.add_argument("--max-new-tokens", type=int, help="thinker max new tokens (server default if unset)")
    parser.add_argument("--talker-max-new-tokens", type=int, help="talker max new tokens (server default if unset)")
    parser.add_argument("--timeout", type=float, default=600.0, help="deadline in seconds")
    parser.add_argument("--out", type=Path, help="write the audio here (.wav)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    parser.add_argument("--token", default=os.environ.get("OMNI_TOKEN"),
                        help="bearer token for the router (default: $OMNI_TOKEN)")
    add_tls_flags(parser)
    args = parser.parse_args(argv)

    def run() -> None:
        files = {}
        for name in ("audio", "image", "video"):
            path = getattr(args, name)
            if path is not None:
                if not path.is_file():
                    raise UserError(f"--{name} {path}: file not found")
                files[name] = path.read_bytes()
        request = build_request(
            args.prompt, args.system, files.get("audio"), files.get("image"), args.voice, args.text_only,
            args.max_new_tokens, args.talker_max_new_tokens, return_codec_frames=args.json,
            video=files.get("video"), use_audio_in_video=args.use_audio_in_video,
        )
        channel, stub = connect(args.target, tls_from_args(args))
        try:
            result = collect(stub, request, timeout=args.timeout, on_event=None if args.json else _progress,
                             token=args.token)
        except grpc.RpcError as exc:
            raise UserError(f"{exc.code().name}: {exc.details()}") from None
        finally:
            channel.close()
        if args.out is not None and result.audio_chunks:
            write_wav(args.out, result.audio, result.sample_rate)
        if args.json:
            print(json.dumps(result.summary()))
        else:
            sys.stderr.write("\n")
            print(f"\nttft {result.ttft_ms or 0:.0f} ms, ttfp {result.ttfp_ms or 0:.0f} ms, "
                  f"{result.audio_seconds:.2f} s audio, rtf {result.rtf or 0:.2f}", file=sys.stderr)

    return run_cli(run)


if __name__ == "__main__":
    sys.exit(main())
