"""A stand-in code2wav stage for stacks on a Qwen2.5-Omni checkpoint, whose streaming Token2Wav
stage is not on this branch: the services' own server plumbing (`build_server`: health,
reflection; `serve_until_signal`: SIGTERM drain), a `Decode` that takes the codec frames, makes no
audio and reports 0 samples, and a load report. Run as the launcher runs a stage
(`python -m tests.tools.stub_code2wav --port P ...`); the stage flags it does not use are ignored.
"""

from __future__ import annotations

import argparse
import asyncio

from omni.v1 import common_pb2, stages_pb2, stages_pb2_grpc
from services.serving.grpc_server import build_server, serve_until_signal

SERVICE = stages_pb2.DESCRIPTOR.services_by_name["Code2Wav"].full_name


class StubCode2Wav(stages_pb2_grpc.Code2WavServicer):
    async def Decode(self, request_iterator, context):
        async for message in request_iterator:
            if message.HasField("end"):
                yield stages_pb2.Code2WavOutput(final=stages_pb2.Code2WavFinal(audio_samples=0))
                return

    async def GetLoad(self, request, context):
        return common_pb2.LoadReport(stage="code2wav")


async def serve(host: str, port: int) -> None:
    handle = build_server(host, port, (SERVICE,))
    stages_pb2_grpc.add_Code2WavServicer_to_server(StubCode2Wav(), handle.server)
    await serve_until_signal(handle, grace_s=1.0, drain_delay_s=0.0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args, _ = parser.parse_known_args()
    asyncio.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
