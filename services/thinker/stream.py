"""One Thinker.Generate call, step by step: admit the request (validate, build the prompt, learn
the talker's limits), start it on the engine, open the talker stream at prefill, relay the text
down and the audio up, move the talker stream to a fallback replica if its replica dies, finish.

`ThinkerStream.run` is the request's whole path; each event the stream's sink hands out goes to
one `on_*` method, which returns the responses it makes for the caller.

With tools (services/thinker/tool_calls.py) the reply's text is parsed for Qwen's calls: each
token's id still comes in its own text delta, in order, but the delta's text is the content only,
and the calls come as `tool_call_delta` and `tool_call` responses after the delta of the token
that wrote them (content a token writes after a call's end comes in that token's delta, before the
call's last events). The talker speaks the reply's text up to its first <tool_call> only: the
tokens pass a `SpeechGate`, the talker's text ends where the call shows (its stream is cancelled
when nothing came before: a reply that is only a call makes no audio).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Protocol

import grpc

from omni.v1 import common_pb2, omni_pb2, stages_pb2, stages_pb2_grpc
from services.base.errors import InvalidArgument
from services.base.stages import SPEECH_SAMPLE_RATE, Stage
from services.runtime.inputs.detokenizer import IncrementalDetokenizer
from services.runtime.inputs.prompt import PromptBuilder
from services.serving import tracing
from services.serving.channels import ChannelPool
from services.serving.convert import finish_reason_to_proto
from services.serving.engine_loop import EngineLoop, EventSink, engine_key
from services.serving.grpc_server import time_remaining
from services.serving.metrics import StageMetrics
from services.serving.migration import Downstream, Resume, as_replay
from services.serving.peer_limits import PeerLimits
from services.serving.status import ReplayDiverged, StageUnavailable, abort_for
from services.serving.tracing import RequestTrace, now_ns
from services.thinker.adapter import ThinkerAdapter
from services.thinker.admission import Admission, Prepared, wants_audio
from services.thinker.config import ThinkerConfig
from services.thinker.engine import Finished, ReleaseText, Token
from services.thinker.tool_calls import Call, CallDelta, SpeechGate, ToolCallParser, call_id

Responses = list[omni_pb2.GenerateResponse]


class ThinkerStage(Protocol):
    """What a stream uses of its servicer (services/thinker/server.py's ThinkerServicer)."""

    loop: EngineLoop
    adapter: ThinkerAdapter
    prompts: PromptBuilder
    config: ThinkerConfig
    channels: ChannelPool
    metrics: StageMetrics
    talker_limits: PeerLimits
    admission: Admission

    def hold_text(self, key: str, talker: common_pb2.StageLimits) -> bool: ...


class ThinkerStream:
    def __init__(self, servicer: ThinkerStage, request: stages_pb2.ThinkerRequest,
                 context: grpc.aio.ServicerContext):
        self.servicer = servicer
        self.request = request
        self.req = request.request
        self.route = request.route
        self.context = context
        self.received, self.received_ns = time.perf_counter(), now_ns()
        self.request_id = self.req.request_id or "anonymous"
        self.key = engine_key(self.request_id)  # unique per stream, whatever ids callers reuse
        self.spans = RequestTrace(Stage.THINKER, self.req.request_id, **{"omni.replay": request.replay})
        self.sink = EventSink(asyncio.get_running_loop())
        self.prepared: Prepared | None = None
        self.talker_limits: common_pb2.StageLimits | None = None
        self.held = False  # the engine holds the text until the talker answers (audio first)
        self.added_ns = 0
        self.detok = IncrementalDetokenizer(servicer.prompts.decode)
        self.speak: Downstream | None = None  # the talker stream, opened at prefill; moves if its replica dies
        self.talker_start: stages_pb2.TalkerStart | None = None
        self.resume = Resume(Stage.TALKER)  # what went up from the talker, across moves
        self.text_done: Finished | None = None
        self.talker_done: stages_pb2.TalkerFinal | None = None
        self.ttft = self.ttfp = None  # ms from receipt
        self.previous_id: int | None = None  # the last id fed (Qwen2.5-Omni's TextToken for it comes one token later)
        self.gate: SpeechGate | None = None  # with tools and audio: which tokens the talker may speak
        self.calls: ToolCallParser | None = None  # with tools: the reply's calls out of its text
        self.fed = 0  # tokens the talker was given

    async def run(self):
        await self.admit()
        self.start()
        outcome = "cancelled"  # unless the stream ends otherwise (the caller went away)
        try:
            while not self.done:
                for response in await self.on(await self.next_item()):
                    yield response
            outcome = "ok"
            yield self.final()
        except grpc.aio.AbortError:
            outcome = "error"
            raise
        except Exception as exc:  # a failed engine, talker or stream: one status for the caller
            outcome = "diverged" if isinstance(exc, ReplayDiverged) else type(exc).__name__
            if isinstance(exc, ReplayDiverged) and self.speak is not None:
                self.speak.diverged()
            await abort_for(self.context, exc)
        finally:
            self.close(outcome)

    async def admit(self) -> None:
        """Validate and convert the request (in a worker thread: it decodes audio, images and
        video), against the limits of the talker in the route when audio is wanted."""
        try:
            if wants_audio(self.req):
                if not self.route.talker:
                    raise InvalidArgument("route.talker", "audio output needs a talker replica in the route")
                self.talker_limits = await self.servicer.talker_limits.first_of(
                    [self.route.talker, *self.route.talker_fallbacks])
            self.prepared = await asyncio.to_thread(self.servicer.admission.prepare, self.req, self.talker_limits)
        except (InvalidArgument, StageUnavailable) as exc:
            self.spans.finish("invalid_argument" if isinstance(exc, InvalidArgument) else "unavailable")
            await abort_for(self.context, exc)
        self.spans.phase("prepare", self.received_ns, audio=self.prepared.audio)
        if self.prepared.tools:
            self.calls = ToolCallParser()
            if self.prepared.audio:
                self.gate = SpeechGate()

    def start(self) -> None:
        self.added_ns = now_ns()
        self.servicer.loop.add(self.key, self.prepared.job, self.sink)
        self.held = self.prepared.audio and self.servicer.hold_text(self.key, self.talker_limits)

    @property
    def done(self) -> bool:
        return self.text_done is not None and (self.talker_done is not None or not self.prepared.audio)

    async def next_item(self):
        """The next engine event or talker output; a talker replica that died is replaced here."""
        while True:
            try:
                item = await self.sink.get(self.servicer.config.serving.stall_timeout_s(stages_below=2), Stage.THINKER)
            except StageUnavailable as exc:
                if self.speak is None or not self.speak.failed_here(exc):
                    raise
                await self.migrate(exc)
                continue
            if self.held and isinstance(item, stages_pb2.TalkerOutput):
                self.servicer.loop.add_input(self.key, ReleaseText())  # audio (or the talker's end) is coming
                self.held = False
            return item

    async def migrate(self, exc: StageUnavailable) -> None:
        """Replay the talker stream on the next fallback replica."""
        if not await self.speak.recover(exc, stages_pb2.TalkerInput(start=as_replay(self.talker_start))):
            raise exc
        self.resume.begin_replay()

    async def on(self, item) -> Responses:
        match item:
            case self.servicer.adapter.prefilled() as prefilled:
                await self.open_talker(prefilled)
            case Token() as token:
                return await self.on_token(token)
            case Finished() as finished:
                self.text_done = finished
                self.spans.close("decode", tokens=finished.generated, finish_reason=finished.reason.name)
            case stages_pb2.TalkerOutput() as out if out.HasField("audio"):
                return self.on_audio(out.audio)
            case stages_pb2.TalkerOutput() as out if out.HasField("failed"):  # a stage after the talker
                raise StageUnavailable(out.failed.stage, out.failed.replica, out.failed.detail)
            case stages_pb2.TalkerOutput() as out if out.HasField("codec_frames"):
                frames = self.resume.codec_frames(out.codec_frames)
                if frames is not None:
                    return [omni_pb2.GenerateResponse(request_id=self.request_id, codec_frames=frames)]
            case stages_pb2.TalkerOutput() as out:
                self.resume.finish()
                self.talker_done = out.final  # the talker may finish before the text does
        return []

    async def open_talker(self, prefilled) -> None:
        """At prefill: open the talker stream and send it the request's start (what the talker
        needs of the prompt: docs/qwen3-omni.md)."""
        self.spans.prefilled(self.added_ns, self.sink.first_step_ns)
        s = self.servicer
        self.speak = Downstream(
            Stage.THINKER, Stage.TALKER, [self.route.talker, *self.route.talker_fallbacks],
            lambda address: tracing.call("/omni.v1.Talker/Speak",
                                         stages_pb2_grpc.TalkerStub(s.channels.get(address)).Speak,
                                         timeout=time_remaining(self.context)),
            self.sink, lambda out: out.HasField("final"), self.route.max_migrations, s.metrics,
            stall_timeout_s=s.config.serving.stall_timeout_s(stages_below=1), wait_ready=s.channels.wait_ready)
        await self.speak.open()
        self.talker_start = s.adapter.talker_start(self.req, self.route, prefilled, self.prepared.job)
        self.talker_start.replay = self.request.replay  # a replay of the router's
        await self.speak.write(stages_pb2.TalkerInput(start=self.talker_start))

    async def on_token(self, token: Token) -> Responses:
        if self.ttft is None:
            self.spans.prefilled(self.added_ns, self.sink.first_step_ns)  # (text only: no prefill event came)
            self.spans.event("first_token")
            self.ttft = (time.perf_counter() - self.received) * 1000
        self.spans.count("text_tokens")
        text = self.detok.add(token.token_id, last=token.last)
        # The talker first: its next frame waits on this row (and a client slow to read the text
        # then does not hold the row back).
        if self.speak is not None and self.talker_done is None:
            await self.feed_talker(token, text)
        if token.index == 0:
            text = self.prepared.reply_prefix + text  # the reply's start, from the prompt
        if self.calls is not None:
            return self.parsed(token, text)
        return [omni_pb2.GenerateResponse(request_id=self.request_id, text=omni_pb2.TextDelta(
            text=text, token_ids=[token.token_id]))]

    def parsed(self, token: Token, text: str) -> Responses:
        """A token of a reply with tools: its delta (its id, the content it released), then the
        call events it released (the module docstring)."""
        end = token.last and token.token_id == self.servicer.adapter.end_token_id()
        pieces = self.calls.feed("" if end else text)
        if token.last:
            pieces += self.calls.finish()
        content = "".join(p for p in pieces if isinstance(p, str)) + (text if end else "")
        out = [omni_pb2.GenerateResponse(request_id=self.request_id, text=omni_pb2.TextDelta(
            text=content, token_ids=[token.token_id]))]
        for piece in pieces:
            if isinstance(piece, CallDelta):
                out.append(omni_pb2.GenerateResponse(request_id=self.request_id, tool_call_delta=omni_pb2.ToolCallDelta(
                    index=piece.index, id=call_id(self.request_id, piece.index), name=piece.name,
                    arguments=piece.arguments)))
            elif isinstance(piece, Call):
                out.append(omni_pb2.GenerateResponse(request_id=self.request_id, tool_call=omni_pb2.ToolCall(
                    id=call_id(self.request_id, piece.index), name=piece.name, arguments=piece.arguments)))
        return out

    async def feed_talker(self, token: Token, text: str) -> None:
        """The tokens the talker may speak now (all of them without tools; the module docstring)."""
        if self.gate is None:
            await self.feed_rows([token])
            return
        ready, call = self.gate.add(token, text)
        if token.last and call is None:
            ready += self.gate.flush()
        await self.feed_rows(ready)
        if call is None:
            return
        if self.fed == 0:  # nothing to speak: no audio
            self.speak.cancel()
            self.talker_done = stages_pb2.TalkerFinal(finish_reason=common_pb2.FINISH_REASON_STOP)
            if self.held:
                self.servicer.loop.add_input(self.key, ReleaseText())
                self.held = False
        else:  # the call's first token ends the talker's text, as an end token would
            await self.feed_rows([dataclasses.replace(call, last=True)])

    async def feed_rows(self, tokens: list[Token]) -> None:
        """One text row per generated token except the last; then the text-finished mark. The
        talker may have ended already (its own max tokens or EOS): the relay says how."""
        for token in tokens:
            written = True
            for message in self.servicer.adapter.talker_inputs(token, self.previous_id):
                written = await self.speak.write(message)
            self.previous_id = token.token_id
            self.fed += 1
            if token.last and written:
                await self.speak.close()

    def on_audio(self, audio: common_pb2.AudioChunk) -> Responses:
        chunk = self.resume.audio_chunk(audio)  # None: a replay repeating audio already passed up
        if chunk is None:
            return []
        self.speak.output()
        if self.ttfp is None:
            self.spans.event("first_audio")
            self.ttfp = (time.perf_counter() - self.received) * 1000
        self.spans.count("audio_chunks")
        return [omni_pb2.GenerateResponse(request_id=self.request_id, audio=chunk)]

    def final(self) -> omni_pb2.GenerateResponse:
        talker = self.talker_done
        migrations = (self.speak.moves if self.speak is not None else 0) + (talker.migrations if talker else 0)
        self.spans.count("migrations", migrations)
        final = omni_pb2.Final(text_finish_reason=finish_reason_to_proto(self.text_done.reason), migrations=migrations)
        final.usage.prompt_tokens = self.text_done.prompt_tokens
        final.usage.text_tokens = self.text_done.generated
        if talker is not None:
            final.audio_finish_reason = talker.finish_reason
            final.usage.codec_frames = talker.codec_frames
            final.usage.audio_seconds = talker.audio_samples / SPEECH_SAMPLE_RATE
        final.timings.ttft_ms = self.ttft or 0.0
        final.timings.ttfp_ms = self.ttfp or 0.0
        final.timings.total_ms = (time.perf_counter() - self.received) * 1000
        return omni_pb2.GenerateResponse(request_id=self.request_id, final=final)

    def close(self, outcome: str) -> None:
        """However the stream ended: its trace, the talker stream and the engine request go."""
        self.spans.finish(outcome)
        if self.speak is not None:
            self.speak.cancel()
        self.servicer.loop.abort(self.key)
