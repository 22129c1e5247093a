"""One Code2Wav.Decode call, step by step: admit the start message, take its frames into the engine
(a reader task beside the handler), send each audio chunk the engine decoded, finish with the final
message; on any other way out, the outcome for the trace and the request aborted.

`Code2WavStream.run` is the request's whole path (services/code2wav/server.py's servicer relays it).
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import grpc

from omni.v1 import stages_pb2
from services.base.errors import InvalidArgument
from services.base.stages import Stage
from services.code2wav.adapter import Code2WavAdapter
from services.code2wav.engine import Audio, CodecEnd, Decoded
from services.code2wav.token2wav import Token2WavGeometry
from services.code2wav.vocoder import VocoderGeometry
from services.serving.engine_loop import EngineLoop, EventSink, engine_key
from services.serving.status import WireError, abort_for
from services.serving.streams import let_end
from services.serving.tracing import RequestTrace, now_ns
from services.serving.wire import audio_to_proto


class Code2WavStage(Protocol):
    """What a stream uses of its servicer (services/code2wav/server.py's Code2WavServicer)."""

    loop: EngineLoop
    adapter: Code2WavAdapter
    geometry: VocoderGeometry | Token2WavGeometry
    idle_timeout_s: float


class Code2WavStream:
    """One Decode stream, in its steps: admit the request, take its frames (a reader task beside
    the handler), wait for what the engine decoded, send each audio chunk, finish with the final
    message; on any other way out, the outcome for the trace and the request aborted."""

    def __init__(self, servicer: Code2WavStage, request_id: str, context: grpc.aio.ServicerContext):
        self.loop = servicer.loop
        self.adapter = servicer.adapter
        self.geometry = servicer.geometry
        self.idle_timeout_s = servicer.idle_timeout_s
        self.context = context
        self.spans = RequestTrace(Stage.CODE2WAV, request_id)
        self.key = engine_key(request_id)  # unique per stream, whatever ids callers reuse
        self.sink = EventSink(asyncio.get_running_loop())
        self.added_ns = 0  # now_ns() when admitted
        self.chunks_sent = 0  # the next AudioChunk.index
        self.finished = False  # Decoded came: the engine holds nothing of the request any more
        self.outcome = "cancelled"  # unless the stream ends otherwise (the caller went away)

    async def run(self, start: stages_pb2.Code2WavStart, request_iterator):
        self.admit(start)
        reader = asyncio.create_task(self.take_frames(request_iterator))
        try:
            while True:
                match await self.sink.get(self.idle_timeout_s, Stage.CODE2WAV):  # what the engine decoded
                    case Audio() as audio:
                        yield self.send_audio(audio)
                    case Decoded() as decoded:
                        yield self.finish(decoded)
                        return
        except grpc.aio.AbortError:
            self.outcome = "error"
            raise
        except Exception as exc:  # a failed engine or a bad input stream
            await self.fail(exc)
        finally:
            self.spans.finish(self.outcome)
            let_end(reader)  # never cancelled mid-read (services/serving/streams.py); ends with the call
            if not self.finished:
                self.loop.abort(self.key)

    def admit(self, start: stages_pb2.Code2WavStart) -> None:
        self.added_ns = now_ns()
        self.loop.add(self.key, self.adapter.job_from_proto(start), self.sink)

    async def take_frames(self, request_iterator) -> None:
        """The messages after start, into the engine, up to the end mark; a bad one fails the stream."""
        try:
            async for message in request_iterator:
                item = self.adapter.input_from_proto(message)
                self.loop.add_input(self.key, item)
                if isinstance(item, CodecEnd):
                    return
            # The caller half-closed without an end mark: it gave up on this request.
            raise InvalidArgument("end", "stream closed before the end mark")
        except (InvalidArgument, WireError) as exc:
            self.sink.fail(exc)
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError:
            pass  # the caller went away; the handler's finally aborts the request

    def send_audio(self, audio: Audio) -> stages_pb2.Code2WavOutput:
        if self.chunks_sent == 0:
            self.spans.phase("queue", self.added_ns, self.sink.first_step_ns)
            self.spans.phase("first_chunk", self.added_ns, samples=int(audio.samples.shape[-1]))
            self.spans.open("decode")
        self.spans.count("chunks")
        first_frame = audio.first_sample // self.geometry.samples_per_frame
        chunk = audio_to_proto(audio.samples, self.geometry.sample_rate, self.chunks_sent, first_frame, audio.end_frame,
                               self.geometry.samples_per_frame)
        self.chunks_sent += 1
        return stages_pb2.Code2WavOutput(audio=chunk)

    def finish(self, decoded: Decoded) -> stages_pb2.Code2WavOutput:
        self.finished = True
        self.outcome = "ok"
        self.spans.close("decode", samples=decoded.samples)
        return stages_pb2.Code2WavOutput(final=stages_pb2.Code2WavFinal(audio_samples=decoded.samples))

    async def fail(self, exc: Exception) -> None:
        """End the stream with `exc`'s status (services/serving/status.py)."""
        # A talker that goes away (cancelled) often reaches the reader as its stream's end before the
        # cancellation reaches the handler: a stream closed without the end mark is abandoned, for the trace.
        gone = self.context.cancelled() or (isinstance(exc, InvalidArgument) and exc.field == "end")
        self.outcome = "cancelled" if gone else type(exc).__name__
        await abort_for(self.context, exc)
