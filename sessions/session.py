"""One `Sessions/Session` call: a realtime voice session (docs/sessions.md).

The session keeps the conversation, buffers the input audio and runs turn detection on it, and
runs each response as an ordinary `Omni/Generate` call to the router (sessions/router_client.py),
whose messages are the conversation so far: the router admits each turn on its own (an idle session
holds no place there), and prefix caching and prefix routing carry a session's turns as they carry
any conversation. A turn whose call fails ends that response alone (an `error` event, then its
`response_done` failed with the same error); the session goes on.

With tools in the settings, the thinker parses each reply's tool calls (services/thinker/tool_calls.py):
its text deltas are the reply's content, and each call's `tool_call_delta` and `tool_call` events go
out as `function_call_delta` and `function_call` events (the call's own item); the history keeps
the calls as the reply's message's, so the next turn's prompt holds the call the tool's result (a
ROLE_TOOL item) answers.

Three tasks: the reader (the client's messages into the inbox, which is bounded, so a client
that sends faster than the session handles is held back by gRPC's flow control; never cancelled,
see services/serving/streams.py), the writer (the outbox to the client, one event at a time), and
the session's own loop (`run`), which handles each message and owns every state change; a
response's task relays its request's stream into the outbox. Turn detection runs on the
replica's detection thread (`detection`), never on the event loop: the loop awaits each append's
detection before the next message, so the input's state still changes in one place. Errors about
one message are `error` events and the session goes on. The client closing its side ends the
session once every message before it is handled and what they produced is sent.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
import uuid
from collections import deque
from concurrent.futures import Executor
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc
import numpy as np

from omni.v1 import omni_pb2
from services.base.errors import InvalidArgument
from services.serving.grpc_server import time_remaining
from services.serving.status import status_for
from services.serving.streams import let_end
from sessions.audio import decode, wav_bytes
from sessions.config import SessionConfig
from sessions.conversation import END_TEXT, Conversation, Item, Reply
from sessions.images import check_image
from sessions.input_audio import InputAudio, InputPace
from sessions.metrics import SessionMetrics
from sessions.router_client import RouterClient, Turn, TurnFailed
from sessions.settings import AUDIO, Settings
from sessions.transcription import Transcription
from sessions.turn_detection import WINDOW_MS, SilenceStart, SpeechResumed, SpeechStart

log = logging.getLogger("sessions")
TICK_S = 0.25  # how often the loop checks the idle and send timeouts
# Client messages read ahead of the one being handled; the reader waits beyond (gRPC flow control
# then holds the client back): 32 appends of 20-100 ms each are up to 3 s of audio.
INBOX = 32
COMPLETED, CANCELLED, FAILED = (omni_pb2.RESPONSE_STATUS_COMPLETED, omni_pb2.RESPONSE_STATUS_CANCELLED,
                                omni_pb2.RESPONSE_STATUS_FAILED)
IDLE_INPUT_MS = 100  # the least audio a timeout turn commits (silence before the buffer's, when it holds less)
# Events dropped unsent when their response is cancelled.
RESPONSE_OUTPUT = ("text", "audio", "codec_frames", "function_call_delta", "function_call")
# A response.create's metadata, as the Realtime API bounds it: pairs, and each key's and value's characters.
MAX_METADATA, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


def without_bytes(part: omni_pb2.Content) -> omni_pb2.Content:
    """A media part as its kind alone: the item's echo sends no audio or image back."""
    kind = part.WhichOneof("part")
    echo = omni_pb2.Content()
    if kind == "video_frames":
        echo.video_frames.SetInParent()
    else:
        setattr(echo, kind, b"")
    return echo


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


class MessageError(Exception):
    """A client message the session cannot take: an `error` event, and the session goes on."""

    def __init__(self, code: str, message: str, field: str = ""):
        super().__init__(message)
        self.code, self.message, self.field = code, message, field


@dataclass
class Response:
    response_id: str
    item: Item  # the assistant item its reply becomes
    settings: Settings  # the session's, with the create_response's overrides
    created: omni_pb2.ResponseCreated  # its response_created event: what it was made with
    input: list[omni_pb2.Message] | None = None  # its own prompt (None: the conversation's)
    task: asyncio.Task | None = None
    ended: bool = False
    status: int = 0  # how it ended (omni_pb2.ResponseStatus)
    call_items: dict[str, str] = field(default_factory=dict)  # a call's id -> its item's id
    # Set once its first audio (text, for a text-only reply) was written or it ended: what a
    # transcription started beside it waits for.
    first_output: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class Held:
    """A turn's answer started at the first silent window of its speech, before the silence setting
    confirmed the turn's end: its user item and reply are in the conversation, its events held
    back (`events`); released at the speech stop, dropped if anything else comes first (the speech
    resumes, any client message but an append), its call then cancelled in every stage."""

    response: Response
    user: Item  # the committed input it answers: the audio up to the end of the first silent window
    end: int  # the absolute input sample that audio ends at
    previous: str  # the item before the user item
    dropped: frozenset[str]  # the conversation's truncation when it started (a truncation it makes is undone with it)
    events: list[omni_pb2.SessionEvent] = field(default_factory=list)


@dataclass
class Playback:
    """The server's audio clock for the last reply: the client plays its audio from the first
    chunk written, in real time (used to cut the reply when the client reports no position)."""

    item: Item
    response_id: str
    started: float | None = None  # monotonic time its first audio chunk was written
    samples: int = 0  # written
    rate: int = 0

    def played_ms(self, now: float) -> int:
        if self.started is None or not self.rate:
            return 0
        return int(min(self.samples / self.rate, now - self.started) * 1000)

    def playing(self, now: float) -> bool:
        return self.started is not None and self.played_ms(now) < self.samples * 1000 // self.rate


class _End:
    """Inbox: the client closed its side of the stream."""


class RealtimeSession:
    def __init__(self, router: RouterClient, metrics: SessionMetrics, requests, context: grpc.aio.ServicerContext,
                 config: SessionConfig, vad_factory, detection: Executor):
        self.router = router
        self.detection = detection  # the replica's turn detection thread
        self.metrics = metrics
        self.requests = requests
        self.context = context
        self.config = config
        self.session_id = new_id("sess")
        self.settings = Settings()
        self.conversation = Conversation()
        self.inbox: asyncio.Queue = asyncio.Queue(INBOX)
        self.outbox: deque[omni_pb2.SessionEvent] = deque()
        self.outbox_ready = asyncio.Event()
        self.writing_since: float | None = None  # monotonic start of the write in progress
        self.closed: omni_pb2.SessionClosed | None = None
        self.opened = self.last_activity = time.monotonic()
        # `idle_timeout_ms`'s clock: since when no speech was heard and no response ran (None: stopped
        # until the next response ends); it starts once the last reply's audio played out too.
        self.idle_since: float | None = self.opened
        self.turns = 0
        self.response: Response | None = None
        self.playback: Playback | None = None
        self.input = InputAudio(vad_factory, max(-(-config.early_response_after_ms // WINDOW_MS), 1))
        self.pace = InputPace(config.max_input_realtime, config.input_burst_s)
        self.input.configure(self.settings.input_format, self.settings.turn_detection)
        self.speech_item: str | None = None  # the item id of the speech in progress
        self.speech_stopped_at: float | None = None  # monotonic time of the last stop: end of speech -> first audio
        self.held: Held | None = None  # an answer started before the turn's end was confirmed
        self.transcriptions: set[asyncio.Task] = set()  # the committed turns' transcriptions running

    # ---- the call ----

    async def run(self) -> None:
        self.metrics.sessions_open.inc()
        reader = asyncio.create_task(self.read_requests())
        writer = asyncio.create_task(self.write_events())
        outcome = "cancelled"
        try:
            self.emit(omni_pb2.SessionEvent(created=self.info()))
            while self.closed is None:
                try:
                    async with asyncio.timeout(TICK_S):  # a timer: wait_for made a task for every message
                        message = await self.inbox.get()
                except TimeoutError:
                    message = None
                if isinstance(message, _End) or self.context.cancelled():
                    # NOTE: the client closing its side ends the session, its response cancelled (below):
                    # a call the client cancels reads as that same end here, and grpc does not always
                    # cancel this handler or say cancelled() (a gateway's cancel, seen 1 time in 3).
                    break
                if message is not None:
                    self.last_activity = time.monotonic()
                    await self.handle(message)
                if self.closed is None:  # after every message too: a client streaming audio never lets the wait time out
                    self.check_timeouts()
            if self.responding is not None:
                self.cancel_response(omni_pb2.CANCEL_REASON_CLIENT, cut=False)
            if self.closed is None:
                outcome = "ended"
                if not self.context.cancelled():
                    await self.flush(writer)  # what the messages before the client's end produced
            else:
                outcome = omni_pb2.CloseReason.Name(self.closed.reason).removeprefix("CLOSE_REASON_").lower()
                await self.flush(writer)  # the closing event
        finally:
            self.drop_held()
            if self.responding is not None:
                self.cancel_response(omni_pb2.CANCEL_REASON_CLIENT, cut=False)
            self.closed = self.closed or omni_pb2.SessionClosed()
            self.outbox_ready.set()
            while not self.inbox.empty():  # a reader waiting for room gets it, and then keeps nothing
                self.inbox.get_nowait()
            for task in self.transcriptions:
                task.cancel()  # its Generate call with it: the thinker frees it
            let_end(reader)
            if self.writing_since is None:
                writer.cancel()
            else:
                let_end(writer)  # stuck in a write to a client that stopped reading: it ends with the call
            self.metrics.sessions_open.dec()
            self.metrics.sessions.labels(outcome).inc()

    async def read_requests(self) -> None:
        try:
            async for request in self.requests:
                if self.closed is None:  # once the session ended, read on to the call's end and keep nothing
                    await self.inbox.put(request)
        finally:
            if self.closed is None:
                await self.inbox.put(_End())

    async def write_events(self) -> None:
        while True:
            while not self.outbox:
                if self.closed is not None:
                    return
                self.outbox_ready.clear()
                await self.outbox_ready.wait()
            event = self.outbox.popleft()
            self.writing_since = time.monotonic()
            await self.context.write(event)
            self.writing_since = None
            self.written(event)

    async def flush(self, writer: asyncio.Task) -> None:
        """Let the writer send what is queued, for at most the send timeout (it ends at once where the
        call did: a failed write ends it)."""
        deadline = time.monotonic() + self.config.send_timeout_s
        while self.outbox and not writer.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    def emit(self, event: omni_pb2.SessionEvent) -> None:
        if self.held is not None and event.response_id == self.held.response.response_id:
            self.held.events.append(event)  # sent if the turn's end is confirmed
            return
        self.outbox.append(event)
        self.outbox_ready.set()

    def error(self, code: str, message: str, field: str = "", event_id: str = "") -> None:
        self.emit(omni_pb2.SessionEvent(error=omni_pb2.SessionError(code=code, message=message, field=field,
                                                                    event_id=event_id)))

    def close(self, reason: int, message: str) -> None:
        log.info("session %s closed: %s", self.session_id, message)
        self.drop_held()
        if self.responding is not None:
            self.cancel_response(omni_pb2.CANCEL_REASON_CLIENT, cut=False)
        self.closed = omni_pb2.SessionClosed(reason=reason, message=message)
        self.emit(omni_pb2.SessionEvent(closed=self.closed))

    def check_timeouts(self) -> None:
        now = time.monotonic()
        if self.writing_since is not None and now - self.writing_since > self.config.send_timeout_s:
            self.close(omni_pb2.CLOSE_REASON_SLOW_READER,
                       f"the client took no event for {self.config.send_timeout_s:g} s")
            self.outbox.clear()  # it reads nothing: do not wait to flush
        elif now - self.opened >= self.config.max_duration_s:
            self.close(omni_pb2.CLOSE_REASON_MAX_DURATION, f"the session reached its maximum length of "
                                                           f"{self.config.max_duration_s:g} s (--session-max-duration-s)")
        elif self.responding is None and now - self.last_activity > self.config.idle_timeout_s:
            self.close(omni_pb2.CLOSE_REASON_IDLE_TIMEOUT, f"no input for {self.config.idle_timeout_s:g} s")
        else:
            self.check_idle_turn(now)

    def check_idle_turn(self, now: float) -> None:
        """`idle_timeout_ms` (turn detection on): no speech for that long since the last reply ended and
        its audio played out (the server's audio clock) is a turn of its own, as OpenAI's server VAD
        does it: `timeout_triggered`, the input buffer committed (its silence: at least `IDLE_INPUT_MS`),
        and, with `create_response`, a response. The clock then waits for that response's end."""
        timeout_ms = self.settings.turn_detection.idle_timeout_ms
        if not timeout_ms or self.idle_since is None or self.input.detector is None or self.input.speaking \
                or self.responding is not None:
            return
        since, playback = self.idle_since, self.playback
        if playback is not None and playback.started is not None and playback.rate:
            since = max(since, playback.started + playback.samples / playback.rate)
        if now - since < timeout_ms / 1000:
            return
        end_ms = self.input.ms(self.input.total)
        item_id = new_id("item")
        self.emit(omni_pb2.SessionEvent(timeout_triggered=omni_pb2.TimeoutTriggered(
            audio_start_ms=max(0, end_ms - int((now - since) * 1000)), audio_end_ms=end_ms, item_id=item_id)))
        self.idle_since = None
        self.commit_input(item_id, min_samples=self.input.rate * IDLE_INPUT_MS // 1000)
        if self.settings.turn_detection.create_response:
            self.create_response()

    def written(self, event: omni_pb2.SessionEvent) -> None:
        """The server's audio clock: what of the last reply the client has, and since when; a
        response's first output."""
        response = self.response
        if response is not None and event.response_id == response.response_id and event.WhichOneof("event") == (
                "audio" if AUDIO in response.settings.output_modalities else "text"):
            response.first_output.set()
        playback = self.playback
        if event.WhichOneof("event") != "audio" or playback is None or event.response_id != playback.response_id:
            return
        if playback.started is None:
            playback.started = time.monotonic()
            if self.speech_stopped_at is not None:
                self.metrics.first_audio.observe(playback.started - self.speech_stopped_at)
                self.speech_stopped_at = None
        playback.samples += event.audio.num_samples
        playback.rate = event.audio.sample_rate or playback.rate

    @property
    def responding(self) -> Response | None:
        """The response in progress (None: none is)."""
        response = self.response
        return response if response is not None and not response.ended else None

    def info(self) -> omni_pb2.SessionInfo:
        return omni_pb2.SessionInfo(session_id=self.session_id, settings=self.settings.to_proto())

    # ---- the client's messages ----

    async def handle(self, request: omni_pb2.SessionRequest) -> None:
        kind = request.WhichOneof("event")
        try:
            if kind is None:
                raise MessageError("unknown_event", "the message sets no event", "event")
            if kind != "append_audio":  # the held answer was made from the session as it was
                self.drop_held()
            handled = getattr(self, f"on_{kind}")(getattr(request, kind))
            if inspect.isawaitable(handled):  # an append: its turn detection, on the detection thread
                await handled
        except InvalidArgument as exc:
            self.error("invalid_argument", str(exc), exc.field, request.event_id)
        except MessageError as exc:
            self.error(exc.code, exc.message, exc.field, request.event_id)

    async def on_update(self, update: omni_pb2.SessionSettings) -> None:
        settings = self.settings.updated(update)
        if update.tools and await self.router.takes_tools(self.turn()) is False:  # refused here, not on each turn
            raise MessageError("invalid_argument", "the pipeline does not take tools (its thinker backend or "
                                                   "chat template cannot render them)", "update.tools")
        if settings.input_format != self.settings.input_format and self.input.held:
            raise MessageError("invalid_argument", "the input buffer holds audio: commit or clear it before changing "
                                                   "the input format", "update.input_format")
        changed_detection = settings.turn_detection != self.settings.turn_detection
        format_changed = settings.input_format != self.settings.input_format
        self.settings = settings
        if changed_detection or format_changed:
            self.input.configure(settings.input_format, settings.turn_detection)
            self.idle_since = time.monotonic()
        self.emit(omni_pb2.SessionEvent(updated=self.info()))

    async def on_append_audio(self, append: omni_pb2.AppendAudio) -> None:
        if len(append.data) > self.config.max_append_bytes:
            raise MessageError("input_too_large", f"an append of {len(append.data)} bytes is over the "
                                                  f"{self.config.max_append_bytes}-byte bound", "append_audio.data")
        fmt = self.settings.input_format
        samples = decode(append.data, fmt, "append_audio.data")
        seconds = len(samples) / fmt.sample_rate
        if self.input.seconds + seconds > self.config.max_input_s:
            raise MessageError("input_buffer_full", f"the input buffer would hold over {self.config.max_input_s:g} s "
                                                    "of audio: commit or clear it", "append_audio.data")
        if not self.pace.take(seconds, time.monotonic()):
            raise MessageError("input_too_fast", f"audio arrives faster than {self.config.max_input_realtime:g}x real "
                                                 f"time (after the first {self.config.input_burst_s:g} s): send it as it "
                                                 "is spoken", "append_audio.data")
        events = []
        if self.input.buffer(samples):  # a window of the detector is complete: hand it over
            events, cpu_s = await asyncio.get_running_loop().run_in_executor(self.detection, self.detect)
            self.metrics.detection_cpu.inc(cpu_s)
        if self.input.detector is not None:
            self.metrics.detected_audio.inc(seconds)
        for event, sample in events:
            if isinstance(event, SpeechStart):
                self.speech_started(sample)
            elif isinstance(event, SilenceStart):
                self.hold_answer(self.input.sample(event.end_ms))
            elif isinstance(event, SpeechResumed):
                self.drop_held()
            else:
                self.speech_stopped(sample)
        self.input.trim()

    def detect(self):
        """On the detection thread: turn detection over what the detector has not heard, and the CPU
        time it took that thread."""
        start = time.thread_time()
        events = self.input.detect()
        return events, time.thread_time() - start

    def on_commit(self, _: omni_pb2.CommitInput) -> None:
        if not self.input.held:
            raise MessageError("no_input", "the input buffer is empty", "commit")
        self.commit_input(self.speech_item or new_id("item"))

    def on_clear(self, _: omni_pb2.ClearInput) -> None:
        self.input.clear()
        self.speech_item = None
        self.emit(omni_pb2.SessionEvent(cleared=omni_pb2.InputCleared()))

    def on_create_item(self, create: omni_pb2.CreateItem) -> None:
        message = create.message
        check_message(message, "create_item.message", self.config.max_image_bytes)
        item_id = create.item_id if create.HasField("item_id") and create.item_id else new_id("item")
        if self.conversation.find(item_id) is not None:
            raise MessageError("invalid_argument", f"item {item_id} exists", "create_item.item_id")
        item = Item(item_id, message.role, list(message.content), tool_calls=list(message.tool_calls),
                    tool_call_id=message.tool_call_id)
        previous = self.conversation.add(item)
        self.emit(omni_pb2.SessionEvent(item_added=omni_pb2.ItemAdded(
            item_id=item_id, previous_item_id=previous, role=message.role, text=item.text,
            tool_calls=message.tool_calls, tool_call_id=message.tool_call_id,
            content=[part if part.HasField("text") else without_bytes(part) for part in message.content])))

    async def on_create_response(self, create: omni_pb2.CreateResponse) -> None:
        if self.responding is not None:
            raise MessageError("response_in_progress", "a response is in progress: cancel it first", "create_response")
        settings = self.settings.for_response(create)
        if create.tools and await self.router.takes_tools(self.turn()) is False:  # as on_update's
            raise MessageError("invalid_argument", "the pipeline does not take tools (its thinker backend or "
                                                   "chat template cannot render them)", "create_response.tools")
        check_metadata(create.metadata)
        prompt = None
        if create.input_set:
            prompt = [self.response_input(part, f"create_response.input[{i}]") for i, part in enumerate(create.input)]
            prompt = [m for m in prompt if m is not None]
        self.create_response(settings, prompt, create)

    def response_input(self, part: omni_pb2.ResponseInput, where: str) -> omni_pb2.Message | None:
        """One item of a response's own input as a Generate message (None: a reply of which nothing was heard)."""
        if part.WhichOneof("item") == "item_reference":
            item = self.conversation.find(part.item_reference)
            if item is None:
                raise MessageError("unknown_item", f"no item {part.item_reference!r}", f"{where}.item_reference")
            return item.message()
        if part.WhichOneof("item") is None:
            raise MessageError("invalid_argument", "an input item is a message or an item_reference", where)
        check_message(part.message, f"{where}.message", self.config.max_image_bytes)
        return part.message

    def on_cancel_response(self, _: omni_pb2.CancelResponse) -> None:
        if self.responding is None:
            raise MessageError("no_response", "no response is in progress", "cancel_response")
        self.cancel_response(omni_pb2.CANCEL_REASON_CLIENT)

    def on_truncate(self, truncate: omni_pb2.TruncateItem) -> None:
        item = self.conversation.find(truncate.item_id)
        if item is None or item.reply is None:
            raise MessageError("unknown_item", f"no assistant reply {truncate.item_id!r}", "truncate.item_id")
        if self.responding is not None and self.response.item is item:
            self.cancel_response(omni_pb2.CANCEL_REASON_CLIENT, cut=False)
        if truncate.audio_end_ms > item.reply.audio_ms:
            raise MessageError("invalid_argument", f"audio_end_ms {truncate.audio_end_ms} is past the reply's "
                                                   f"{item.reply.audio_ms} ms of audio", "truncate.audio_end_ms")
        self.truncate(item, truncate.audio_end_ms)

    def on_delete_item(self, delete: omni_pb2.DeleteItem) -> None:
        item = self.conversation.find(delete.item_id)
        if item is None:
            raise MessageError("unknown_item", f"no item {delete.item_id!r}", "delete_item.item_id")
        if self.responding is not None and self.response.item is item:
            raise MessageError("invalid_argument", "the response in progress writes this item: cancel it first",
                               "delete_item.item_id")
        if self.playback is not None and self.playback.item is item:
            self.playback = None  # nothing left to cut at a barge-in
        self.conversation.delete(item.item_id)
        self.emit(omni_pb2.SessionEvent(item_deleted=omni_pb2.ItemDeleted(item_id=item.item_id)))

    # ---- input audio and turn detection ----

    def speech_started(self, sample: int) -> None:
        self.input.keep_from(sample - self.input.padding)  # the item starts `prefix_padding_ms` before the speech
        self.speech_item = new_id("item")
        self.idle_since = None
        self.emit(omni_pb2.SessionEvent(speech_started=omni_pb2.SpeechStarted(
            audio_start_ms=self.input.ms(sample), item_id=self.speech_item)))
        if self.settings.turn_detection.interrupt_response:
            self.barge_in()

    def speech_stopped(self, sample: int) -> None:
        item_id = self.speech_item or new_id("item")
        self.emit(omni_pb2.SessionEvent(speech_stopped=omni_pb2.SpeechStopped(
            audio_end_ms=self.input.ms(sample), item_id=item_id)))
        self.speech_stopped_at = self.idle_since = time.monotonic()
        if self.held is not None:
            self.release_held()
            return
        self.commit_input(item_id)
        # With barge-in off, speech during a response adds its item; the next response hears it.
        if self.settings.turn_detection.create_response and self.responding is None:
            self.create_response()

    def user_item(self, item_id: str, samples) -> Item:
        """Input audio as a user item: a wav at the input rate."""
        return Item(item_id, omni_pb2.ROLE_USER, [omni_pb2.Content(audio=wav_bytes(samples, self.input.rate))])

    def commit_input(self, item_id: str, min_samples: int = 0) -> None:
        """The input buffer becomes a user item (silence before it up to `min_samples`); the buffer empties."""
        samples = self.input.take()
        if len(samples) < min_samples:
            samples = np.concatenate((np.zeros(min_samples - len(samples), np.int16), samples))
        item = self.user_item(item_id, samples)
        self.committed(item, self.conversation.add(item), len(samples))

    def committed(self, item: Item, previous: str, samples: int) -> None:
        self.speech_item = None
        audio_ms = samples * 1000 // self.input.rate
        self.emit(omni_pb2.SessionEvent(committed=omni_pb2.InputCommitted(
            item_id=item.item_id, previous_item_id=previous, audio_ms=audio_ms)))
        if self.settings.transcription is not None:
            task = asyncio.create_task(self.transcribe(item, audio_ms, self.settings.transcription))
            self.transcriptions.add(task)
            task.add_done_callback(self.transcriptions.discard)

    async def transcribe(self, item: Item, audio_ms: int, transcription: Transcription) -> None:
        """A committed turn's transcript: the thinker's text-only pass over its audio, as deltas,
        then completed (failed: its error; the session goes on). It runs beside the response: when
        one is in progress as it starts (turn detection's, created right after the commit), it waits
        for that response's first audio, so it never delays it."""
        response = self.response
        if response is not None and not response.ended:
            await response.first_output.wait()
        request = transcription.request(new_id("transcribe"), item.content[0].audio, audio_ms)
        ids = {"item_id": item.item_id, "content_index": 0}
        pieces, final = [], None
        try:
            async with aclosing(self.router.generate(request, self.turn())) as outputs:
                async for output in outputs:
                    if output.WhichOneof("event") == "final":
                        final = output.final
                    elif output.WhichOneof("event") == "text" and output.text.text not in ("", END_TEXT):
                        pieces.append(output.text.text)
                        self.emit(omni_pb2.SessionEvent(transcription_delta=omni_pb2.TranscriptionDelta(
                            **ids, delta=output.text.text)))
        except Exception as exc:
            if isinstance(exc, TurnFailed):
                error = exc.as_error()
            else:  # a bug here must not end the session silently
                log.exception("session %s: the transcription of %s failed", self.session_id, item.item_id)
                error = omni_pb2.SessionError(code="internal", message=status_for(exc)[0].message)
            self.metrics.transcriptions.labels("failed").inc()
            self.emit(omni_pb2.SessionEvent(transcription_failed=omni_pb2.TranscriptionFailed(**ids, error=error)))
            return
        item.transcript = "".join(pieces)
        self.metrics.transcriptions.labels("completed").inc()
        self.emit(omni_pb2.SessionEvent(transcription_completed=omni_pb2.TranscriptionCompleted(
            **ids, transcript=item.transcript, final=final)))

    # ---- the answer held back until the turn's end is confirmed ----

    def hold_answer(self, end: int) -> None:
        """Speech went quiet (its first silent window, ending at input sample `end`): start the turn's
        answer now, on the audio up to there, its events held back (`Held`)."""
        if not (self.config.early_response and self.settings.turn_detection.create_response) \
                or self.closed is not None or self.turns >= self.config.max_turns \
                or self.responding is not None:
            return
        samples = self.input.upto(end)
        user = self.user_item(self.speech_item or new_id("item"), samples)
        dropped = frozenset(self.conversation.dropped)
        previous = self.conversation.add(user)
        response, request = self.new_response(self.settings)
        self.held = Held(response, user, self.input.start + len(samples), previous, dropped)
        response.task = asyncio.create_task(self.run_response(response, request))

    def release_held(self) -> None:
        """The silence setting confirmed the turn's end: its user item committed and its answer sent,
        what it made so far at once and the rest as it comes."""
        held, self.held = self.held, None
        samples = self.input.take(held.end)  # what the answer heard; the silence after it is trimmed as any
        self.committed(held.user, held.previous, len(samples))
        response = held.response
        self.start_response(response)
        for event in held.events:
            self.emit(event)
        if response.ended:
            self.count_turn(response)
        self.metrics.held_answers.labels("released").inc()

    def drop_held(self) -> None:
        """The held answer is not the turn's (speech resumed, or the client sent something): its call
        cancelled (every stage frees it), its items out of the conversation, its events dropped."""
        held, self.held = self.held, None
        if held is None:
            return
        held.response.task.cancel()
        held.response.ended = True
        self.conversation.delete(held.response.item.item_id)
        self.conversation.delete(held.user.item_id)
        self.conversation.dropped = set(held.dropped)
        self.metrics.held_answers.labels("dropped").inc()

    # ---- responses ----

    def create_response(self, settings: Settings | None = None, prompt: list[omni_pb2.Message] | None = None,
                        create: omni_pb2.CreateResponse | None = None) -> None:
        """A response (new_response's arguments; `settings` None: the session's)."""
        if self.turns >= self.config.max_turns:
            self.close(omni_pb2.CLOSE_REASON_TURN_LIMIT, f"the session made its {self.config.max_turns} responses")
            return
        response, request = self.new_response(settings or self.settings, prompt, create)
        self.start_response(response)
        response.task = asyncio.create_task(self.run_response(response, request))

    def new_response(self, settings: Settings, prompt: list[omni_pb2.Message] | None = None,
                     create: omni_pb2.CreateResponse | None = None) -> tuple[Response, omni_pb2.GenerateRequest]:
        """A response of `settings` to `prompt` (None: the conversation as it is), its (empty) reply
        item added after it unless `create` asks for one out of band, and its request; `create`: the
        client's (its metadata)."""
        response_id = new_id("resp")
        request = settings.request(response_id, self.conversation.messages() if prompt is None else prompt)
        item = Item(new_id("item"), omni_pb2.ROLE_ASSISTANT, reply=Reply())
        out_of_band = create is not None and create.out_of_band
        if not out_of_band:
            self.conversation.add(item)
        created = omni_pb2.ResponseCreated(item_id=item.item_id, output_modalities=settings.output_modalities,
                                           out_of_band=out_of_band, metadata=dict(create.metadata) if create else None)
        if settings.max_output_tokens is not None:
            created.max_output_tokens = settings.max_output_tokens
        return Response(response_id, item, settings, created, prompt), request

    def start_response(self, response: Response) -> None:
        """`response` is the session's: counted, said, its audio on the playback clock (an
        out-of-band reply's not: it is not the history's to cut)."""
        self.turns += 1
        self.response = response
        if AUDIO in response.settings.output_modalities and not response.created.out_of_band:
            self.playback = Playback(response.item, response.response_id)
        self.emit(omni_pb2.SessionEvent(response_id=response.response_id, response_created=response.created))

    async def run_response(self, response: Response, request: omni_pb2.GenerateRequest) -> None:
        """The turn's request through the router, its output into the outbox."""
        while True:
            try:
                final = await self.stream_response(response, request)
                break
            except TurnFailed as failed:
                # Refused before any output (a response of the conversation): again, shorter.
                if response.input is None and self.truncated_to_fit(response, failed):
                    request = response.settings.request(response.response_id, self.conversation.messages())
                    continue
                # That turn alone fails: an `error` event (the router's status), its response_done
                # failed with the same error, and the session goes on.
                error = failed.as_error()
                self.emit(omni_pb2.SessionEvent(response_id=response.response_id, error=error))
                self.end_response(response, FAILED, error=error)
                return
            except Exception as exc:  # a bug here must not end the session silently
                log.exception("session %s: response %s failed", self.session_id, response.response_id)
                status, _ = status_for(exc)
                self.end_response(response, FAILED, error=omni_pb2.SessionError(code="internal", message=status.message))
                return
        self.end_response(response, COMPLETED, final=final)

    async def stream_response(self, response: Response, request: omni_pb2.GenerateRequest) -> omni_pb2.Final | None:
        """One router call of the turn, its output into the outbox; its Final."""
        reply, final = response.item.reply, None
        async with aclosing(self.router.generate(request, self.turn())) as outputs:
            async for output in outputs:
                kind = output.WhichOneof("event")
                event = omni_pb2.SessionEvent(response_id=response.response_id)
                if kind == "text":
                    reply.add_text(output.text)
                    event.text.CopyFrom(output.text)
                elif kind == "audio":
                    reply.add_audio(output.audio)
                    event.audio.CopyFrom(output.audio)
                elif kind == "codec_frames":
                    event.codec_frames.CopyFrom(output.codec_frames)
                elif kind in ("tool_call_delta", "tool_call"):
                    event = self.call_event(response, kind, getattr(output, kind))
                else:
                    final = output.final
                    continue
                self.emit(event)
        return final

    def truncated_to_fit(self, response: Response, failed: TurnFailed) -> bool:
        """Where the turn's prompt did not fit a stage's per-request cache (`TurnFailed.context_full`:
        refused before any work) and the session truncates: its oldest turns taken out of what is sent
        (`Conversation.drop_oldest_turns`), said, and True (send the turn again); else False."""
        if not (failed.context_full and self.settings.retention_ratio):
            return False
        dropped = self.conversation.drop_oldest_turns(self.settings.retention_ratio)
        if not dropped:
            return False
        log.info("session %s: turn %s did not fit (%s); its %d oldest items no longer sent", self.session_id,
                 response.response_id, failed, len(dropped))
        self.metrics.truncations.inc()
        self.emit(omni_pb2.SessionEvent(response_id=response.response_id, conversation_truncated=(
            omni_pb2.ConversationTruncated(item_ids=dropped))))
        return True

    def turn(self) -> Turn:
        """A turn's call: the caller's bearer token on to the router, within the session's deadline."""
        auth = [(k, v) for k, v in (self.context.invocation_metadata() or ()) if k == "authorization"]
        return Turn(metadata=tuple(auth), timeout_s=time_remaining(self.context))

    def call_event(self, response: Response, kind: str, call) -> omni_pb2.SessionEvent:
        """A call of the reply (the thinker's delta or whole call) as the session's event, on the
        call's own item; a whole call joins the reply (the history's message holds it)."""
        item_id = response.call_items.setdefault(call.id, new_id("item"))
        event = omni_pb2.SessionEvent(response_id=response.response_id)
        out = omni_pb2.FunctionCall(item_id=item_id, call_id=call.id, name=call.name, arguments=call.arguments)
        if kind == "tool_call":
            response.item.reply.calls.append(call)
            event.function_call.CopyFrom(out)
        else:
            event.function_call_delta.CopyFrom(out)
        return event

    def end_response(self, response: Response, status: int, final: omni_pb2.Final | None = None,
                     error: omni_pb2.SessionError | None = None, reason: int = 0) -> None:
        if response.ended:
            return
        response.ended, response.status = True, status
        response.first_output.set()
        self.idle_since = time.monotonic()
        reply = response.item.reply
        if self.held is None or self.held.response is not response:  # a held answer counts once released
            self.count_turn(response)
        done = omni_pb2.ResponseDone(item_id=response.item.item_id, status=status, cancel_reason=reason,
                                     transcript=reply.text, audio_ms=reply.audio_ms)
        if final is not None:
            done.final.CopyFrom(final)
        if error is not None:
            done.error.CopyFrom(error)
        self.emit(omni_pb2.SessionEvent(response_id=response.response_id, response_done=done))

    def count_turn(self, response: Response) -> None:
        self.metrics.turns.labels(omni_pb2.ResponseStatus.Name(response.status).removeprefix("RESPONSE_STATUS_").lower()).inc()

    def cancel_response(self, reason: int, cut: bool = True) -> None:
        """Cancel the response in progress everywhere (its request's call, so every stage frees it),
        drop what of it was not sent yet, and cut its reply to what was played (`cut`)."""
        response = self.response
        response.task.cancel()
        self.outbox = deque(e for e in self.outbox
                            if not (e.response_id == response.response_id and e.WhichOneof("event") in RESPONSE_OUTPUT))
        reply = response.item.reply
        if self.playback is not None and self.playback.item is response.item:
            reply.audio_samples = self.playback.samples  # the client has only what was written
        if cut:
            self.cut_played(response.item)
        self.end_response(response, CANCELLED, reason=reason)

    def barge_in(self) -> None:
        """Speech started: cancel the response in progress and cut the reply still playing."""
        now = time.monotonic()
        if self.responding is not None:
            self.metrics.barge_ins.inc()
            self.cancel_response(omni_pb2.CANCEL_REASON_TURN_DETECTED)
        elif self.playback is not None and self.playback.playing(now):
            self.metrics.barge_ins.inc()
            self.cut_played(self.playback.item)

    def cut_played(self, item: Item) -> None:
        """Cut `item`'s reply where the server's audio clock says the client is (nothing played:
        nothing kept). A text-only reply keeps what was sent."""
        if self.playback is None or self.playback.item is not item:
            return
        self.truncate(item, self.playback.played_ms(time.monotonic()))
        self.playback = None

    def truncate(self, item: Item, audio_end_ms: int) -> None:
        item.reply.cut(audio_end_ms)
        if self.playback is not None and self.playback.item is item:
            self.playback = None
        self.emit(omni_pb2.SessionEvent(truncated=omni_pb2.ItemTruncated(
            item_id=item.item_id, audio_end_ms=item.reply.audio_end_ms, text=item.reply.text)))


def check_message(message: omni_pb2.Message, where: str, max_image_bytes: int) -> None:
    """An item the client gives (a conversation item, a response's input): MessageError (or
    InvalidArgument, an image's) naming its field."""
    if message.role not in (omni_pb2.ROLE_SYSTEM, omni_pb2.ROLE_USER, omni_pb2.ROLE_ASSISTANT, omni_pb2.ROLE_TOOL):
        raise MessageError("invalid_argument", "role must be system, user, assistant or tool", f"{where}.role")
    for i, part in enumerate(message.content):
        kind = part.WhichOneof("part")
        if kind != "text" and not (kind in ("audio", "image") and message.role == omni_pb2.ROLE_USER):
            raise MessageError("unsupported", f"a {kind or 'empty'} part (an item holds text parts, and a user "
                                              "item audio and image parts)", f"{where}.content[{i}]")
        if kind == "image":
            check_image(part.image, f"{where}.content[{i}].image", max_image_bytes)
    if message.tool_calls and message.role != omni_pb2.ROLE_ASSISTANT:
        raise MessageError("invalid_argument", "only an assistant item makes calls", f"{where}.tool_calls")
    for k, call in enumerate(message.tool_calls):
        if not call.name:
            raise MessageError("invalid_argument", "a call names its function", f"{where}.tool_calls[{k}].name")
    if (message.role == omni_pb2.ROLE_TOOL) != bool(message.tool_call_id):
        raise MessageError("invalid_argument", "a tool's result (and only it) names the call it answers",
                           f"{where}.tool_call_id")
    if not message.content and not message.tool_calls:
        raise MessageError("invalid_argument", "the item has no content", f"{where}.content")


def check_metadata(metadata) -> None:
    """A response's metadata within the Realtime API's bounds: MessageError naming the field."""
    if len(metadata) > MAX_METADATA:
        raise MessageError("invalid_argument", f"at most {MAX_METADATA} pairs", "create_response.metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise MessageError("invalid_argument", f"keys of at most {MAX_METADATA_KEY} characters, values of at most "
                                                   f"{MAX_METADATA_VALUE}", f"create_response.metadata.{key[:64]}")
