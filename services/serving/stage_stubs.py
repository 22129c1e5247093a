"""Each stage's service stub by stage name: the one map every caller of a stage's `GetLoad` uses
(the router's poll, the thinker's read of its talker's limits, the launcher's start-up report, the
soak's leak check, the benchmark)."""

from __future__ import annotations

from omni.v1 import stages_pb2_grpc
from services.base.stages import Stage

STAGE_STUBS = {  # stage -> its stub class (a Stage is its name: "thinker" finds it too)
    Stage.THINKER: stages_pb2_grpc.ThinkerStub,
    Stage.TALKER: stages_pb2_grpc.TalkerStub,
    Stage.CODE2WAV: stages_pb2_grpc.Code2WavStub,
}


def stage_stub(stage: str, channel):
    """The stub of `stage`'s service on `channel` (sync or asyncio)."""
    return STAGE_STUBS[Stage(stage)](channel)
