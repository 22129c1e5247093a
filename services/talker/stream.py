"""One Talker.Speak call, step by step: admit the start message (validate, convert it to a job),
start it on the engine and read the thinker's text rows into it, open the code2wav stream, send
the frames down in chunks and the audio up, move the code2wav stream to a fallback replica if its
replica dies, finish.

`TalkerStream.run` is the request's whole path; each event the stream's sink hands out goes to one
`on_*` method, which returns the responses it makes for the caller.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

import grpc
import torch

from omni.v1 import stages_pb2, stages_pb2_grpc
from services.base.errors import InvalidArgument
from services.base.stages import Stage
from services.runtime.chunking import FrameChunker
from services.serving import tracing
from services.serving.channels import ChannelPool
from services.serving.convert import finish_reason_to_proto
from services.serving.engine_loop import EngineLoop, EventSink, engine_key
from services.serving.grpc_server import time_remaining
from services.serving.metrics import StageMetrics
from services.serving.migration import Downstream, Resume
from services.serving.status import ReplayDiverged, StageUnavailable, WireError, abort_for
from services.serving.streams import let_end
from services.serving.tracing import RequestTrace, now_ns
from services.serving.wire import frames_to_proto
from services.talker.adapter import TalkerAdapter
from services.talker.config import TalkerConfig
from services.talker.engine import TalkerJob
from services.talker.engine_base import Frame, TalkerDone, TextEnd

Responses = list[stages_pb2.TalkerOutput]


class TalkerStage(Protocol):
    """What a stream uses of its servicer (services/talker/server.py's TalkerServicer)."""

    loop: EngineLoop
    adapter: TalkerAdapter
    config: TalkerConfig
    channels: ChannelPool
    metrics: StageMetrics


class TalkerStream:
    def __init__(self, servicer: TalkerStage, request_iterator, context: grpc.aio.ServicerContext):
        self.servicer = servicer
        self.requests = request_iterator
        self.context = context
        self.sink = EventSink(asyncio.get_running_loop())
        self.start: stages_pb2.TalkerStart | None = None
        self.job: TalkerJob | None = None
        self.chunker: FrameChunker | None = None
        self.request_id = self.key = ""
        self.spans: RequestTrace | None = None
        self.added_ns = 0
        self.reader: asyncio.Task | None = None  # the thinker's text rows into the engine
        self.decode: Downstream | None = None  # the code2wav stream; moves if its replica dies
        self.resume = Resume(Stage.CODE2WAV)  # what went up from code2wav, across moves
        self.done: TalkerDone | None = None
        self.finished = False

    async def run(self):
        await self.admit()
        outcome = "cancelled"  # unless the stream ends otherwise (the caller went away)
        try:
            await self.open_code2wav()
            while not self.finished:
                for response in await self.on(await self.next_item()):
                    yield response
            outcome = "ok"
        except grpc.aio.AbortError:
            outcome = "error"
            raise
        except Exception as exc:  # a failed engine, code2wav or text stream: one status for the caller
            outcome = self.failed(exc)
            if isinstance(exc, StageUnavailable) and exc.stage != Stage.TALKER:
                # Named in a message first: the status may not reach a caller still writing (StageFailure).
                yield stages_pb2.TalkerOutput(failed=stages_pb2.StageFailure(
                    stage=exc.stage, replica=exc.replica, detail=exc.detail))
            await abort_for(self.context, exc)
        finally:
            self.close(outcome)

    async def admit(self) -> None:
        """The first message must be a valid start; then the job goes on the engine and a task
        reads the text rows that follow into it."""
        first = await anext(aiter(self.requests), None)
        if first is None or not first.HasField("start"):
            await abort_for(self.context, InvalidArgument("start", "the first message must be start"))
        self.start = start = first.start
        try:
            self.job = self.servicer.adapter.job_from_proto(start)
        except (InvalidArgument, WireError) as exc:
            await abort_for(self.context, exc)
        if not start.route.code2wav:
            await abort_for(self.context, InvalidArgument("route.code2wav", "no code2wav replica given"))
        self.request_id = start.request_id or "anonymous"
        self.key = engine_key(self.request_id)  # unique per stream, whatever ids callers reuse
        self.spans = RequestTrace(Stage.TALKER, self.request_id, **{"omni.replay": start.replay})
        self.chunker = FrameChunker(self.servicer.config.chunks, self.servicer.adapter.seconds_per_frame)
        self.added_ns = now_ns()
        self.servicer.loop.add(self.key, self.job, self.sink)
        self.reader = asyncio.create_task(self.read_text())

    async def read_text(self) -> None:
        """The thinker's rows, up to its text-finished mark, into the engine; a bad or cut-short
        text stream fails the request through its sink."""
        try:
            async for message in self.requests:
                item = self.servicer.adapter.input_from_proto(message)
                self.servicer.loop.add_input(self.key, item)
                if isinstance(item, TextEnd):
                    return
            raise InvalidArgument("finished", "stream closed before the text-finished mark")
        except (InvalidArgument, WireError) as exc:
            self.sink.fail(exc)
        except grpc.aio.AioRpcError:
            pass

    async def open_code2wav(self) -> None:
        s, route = self.servicer, self.start.route
        self.decode = Downstream(
            Stage.TALKER, Stage.CODE2WAV, [route.code2wav, *route.code2wav_fallbacks],
            lambda address: tracing.call("/omni.v1.Code2Wav/Decode",
                                         stages_pb2_grpc.Code2WavStub(s.channels.get(address)).Decode,
                                         timeout=time_remaining(self.context)),
            self.sink, lambda out: out.HasField("final"), route.max_migrations, s.metrics,
            stall_timeout_s=s.config.serving.stall_timeout_s(stages_below=0), wait_ready=s.channels.wait_ready)
        await self.decode.open()
        await self.decode.write(stages_pb2.Code2WavInput(start=stages_pb2.Code2WavStart(
            request_id=self.request_id, voice=self.start.voice if self.start.HasField("voice") else None)))

    async def next_item(self):
        """The next engine event or code2wav output; a code2wav replica that died is replaced here
        (the new one replays every chunk sent so far)."""
        while True:
            try:
                return await self.sink.get(self.servicer.config.serving.stall_timeout_s(stages_below=1), Stage.TALKER)
            except StageUnavailable as exc:
                if not await self.decode.recover(exc):
                    raise
                self.resume.begin_replay()

    async def on(self, item) -> Responses:
        match item:
            case Frame(codes=codes):
                return await self.on_frame(codes)
            case TalkerDone() as done:
                return await self.on_done(done)
            case stages_pb2.Code2WavOutput() as out if out.HasField("audio"):
                return self.on_audio(out)
            case stages_pb2.Code2WavOutput() as out:
                return [self.final(out.final)]
        return []

    async def on_frame(self, codes: torch.Tensor) -> Responses:
        self.spans.prefilled(self.added_ns, self.sink.first_step_ns)
        self.spans.count("frames")
        chunk = self.chunker.add(codes, time.monotonic())
        if chunk is None:
            return []
        if self.spans.first("chunk"):
            self.spans.phase("first_chunk", self.added_ns, frames=int(chunk.shape[0]))
        self.spans.count("chunks")
        return await self.send_chunk(chunk)

    async def on_done(self, done: TalkerDone) -> Responses:
        """The engine's last frame: the partial chunk and the end go down; code2wav's final ends
        the stream."""
        self.done = done
        self.spans.close("decode", frames=done.frames, finish_reason=done.reason.name)
        chunk = self.chunker.flush()
        responses = await self.send_chunk(chunk) if chunk is not None else []
        if await self.decode.write(stages_pb2.Code2WavInput(end=stages_pb2.CodecEnd())):
            await self.decode.close()
        return responses

    async def send_chunk(self, chunk: torch.Tensor) -> Responses:
        message = stages_pb2.Code2WavInput(frames=frames_to_proto(chunk, first_frame=self.chunker.sent - chunk.shape[0]))
        await self.decode.write(message)
        return [stages_pb2.TalkerOutput(codec_frames=message.frames)] if self.start.return_codec_frames else []

    def on_audio(self, out: stages_pb2.Code2WavOutput) -> Responses:
        audio = self.resume.audio_chunk(out.audio)  # None: a replay repeating audio already passed up
        if audio is None:
            return []
        self.chunker.playing(time.monotonic())
        self.decode.output()
        return [stages_pb2.TalkerOutput(audio=audio)]

    def final(self, code2wav: stages_pb2.Code2WavFinal) -> stages_pb2.TalkerOutput:
        self.resume.finish()
        self.finished = True
        self.spans.count("migrations", self.decode.moves)
        return stages_pb2.TalkerOutput(final=stages_pb2.TalkerFinal(
            finish_reason=finish_reason_to_proto(self.done.reason), codec_frames=self.done.frames,
            audio_samples=code2wav.audio_samples, migrations=self.decode.moves))

    def failed(self, exc: Exception) -> str:
        """The outcome a failure is traced as."""
        if isinstance(exc, ReplayDiverged):
            self.decode.diverged()
            return "diverged"
        # A thinker that goes away can reach the reader as its stream's end (no text-finished mark) first.
        gone = self.context.cancelled() or (isinstance(exc, InvalidArgument) and exc.field == "finished")
        return "cancelled" if gone else type(exc).__name__

    def close(self, outcome: str) -> None:
        """However the stream ended: its trace, the text reader, the code2wav stream and the
        engine request go."""
        self.spans.finish(outcome)
        let_end(self.reader)  # never cancelled mid-read (services/serving/streams.py); ends with the call
        if self.decode is not None:
            self.decode.cancel()
        self.servicer.loop.abort(self.key)
