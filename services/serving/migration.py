"""Moving a request to another replica of the next stage when its replica dies mid-stream.

Every stage is deterministic given its inputs (greedy, or sampling with a seed the router fixes
at admission), and a stage keeps every message it sent downstream. So when the replica of the
next stage dies, the stage opens a stream to a fallback replica (the route names them, least
loaded first), replays those messages and goes on. The new replica regenerates from the start;
what was already passed up is dropped on the way, and checked: a running hash of everything
passed up must equal the hash of the replay's repetition of it, or the request ends with
ABORTED (REPLAY_DIVERGED) instead of splicing audio that does not match. That check fails where
batching is not bit-exact (`--exact-batching off`, the default on GPUs): see README, Migration.

`Downstream` is the stream to the next stage that can move; `Passed` is one kind of output
(audio samples, codec frames, text tokens) with its count, its hash and the replay check.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from omni.v1 import common_pb2
from services.serving.engine_loop import EventSink
from services.serving.metrics import StageMetrics
from services.serving.status import ReplayDiverged, StageUnavailable, StreamIdle
from services.serving.streams import Gate, close_quietly, let_end, relay_responses, write_quietly
from services.serving.tracing import Migration

log = logging.getLogger(__name__)


class Passed:
    """How much of one kind of output went up, its running hash, and, after a move, the check
    of the replay's repetition of it."""

    def __init__(self, stage: str, kind: str):
        self.stage, self.kind = stage, kind  # who regenerates it, and what it is (for the error)
        self.count = 0  # units passed up
        self._hash = hashlib.sha256()
        self._replay: tuple[int, bytes] | None = None  # (units to see again, their hash)
        self._seen = 0
        self._seen_hash = hashlib.sha256()

    def begin_replay(self) -> None:
        self._replay = (self.count, self._hash.digest()) if self.count else None  # nothing to see again
        self._seen, self._seen_hash = 0, hashlib.sha256()

    def admit(self, data: bytes, n: int) -> int:
        """`data`: the bytes of `n` units arriving in order. Returns how many at the start were
        already passed up (the caller drops them); the rest count as passed up now."""
        unit = len(data) // n if n else 0
        skip = 0
        if self._replay is not None:
            target, digest = self._replay
            skip = min(n, target - self._seen)
            self._seen_hash.update(data[:skip * unit])
            self._seen += skip
            if self._seen == target:
                if self._seen_hash.digest() != digest:
                    raise ReplayDiverged(self.stage, self.kind)
                self._replay = None
        self._hash.update(data[skip * unit:])
        self.count += n - skip
        return skip

    def check_complete(self) -> None:
        """At the stream's end: a replay that stopped short of what was passed up diverged."""
        if self._replay is not None:
            raise ReplayDiverged(self.stage, self.kind)


class Resume:
    """The outputs of one request that a stage passes up from the next stage, filtered across
    moves: audio chunks (renumbered, so the caller sees 0, 1, 2, ... once) and codec frames."""

    def __init__(self, stage: str):
        self.audio = Passed(stage, "audio")
        self.frames = Passed(stage, "codec frames")
        self.chunks = 0  # audio chunks passed up

    def begin_replay(self) -> None:
        self.audio.begin_replay()
        self.frames.begin_replay()

    def audio_chunk(self, chunk: common_pb2.AudioChunk) -> common_pb2.AudioChunk | None:
        """The part of `chunk` not passed up yet (None: all of it was), numbered in order."""
        skip = self.audio.admit(chunk.pcm, chunk.num_samples)
        if skip == chunk.num_samples:
            return None
        out = common_pb2.AudioChunk(pcm=chunk.pcm[skip * 4:], sample_rate=chunk.sample_rate, index=self.chunks,
                                    num_samples=chunk.num_samples - skip, first_frame=chunk.first_frame,
                                    end_frame=chunk.end_frame, samples_per_frame=chunk.samples_per_frame)
        self.chunks += 1
        return out

    def codec_frames(self, frames: common_pb2.CodecFrames) -> common_pb2.CodecFrames | None:
        groups = frames.num_code_groups or 1
        n = len(frames.ids) // groups
        skip = self.frames.admit(b"".join(i.to_bytes(4, "little", signed=True) for i in frames.ids), n)
        if skip == n:
            return None
        return common_pb2.CodecFrames(first_frame=frames.first_frame + skip, num_code_groups=frames.num_code_groups,
                                      ids=frames.ids[skip * groups:])

    def finish(self) -> None:
        self.audio.check_complete()
        self.frames.check_complete()


def as_replay(start):
    """A copy of `start` (a TalkerStart or ThinkerRequest) marked a replay (for the trace). Nothing
    else changes: the replayed audio has the bits of the first whatever the new replica's chunk
    cuts (services/code2wav/blocks.py)."""
    replay = type(start)()
    replay.CopyFrom(start)
    replay.replay = True
    return replay


class Downstream:
    """A bidi stream to the next stage that survives the death of its replica.

    Every message written is kept (the stage already held it: the thinker's text rows, the
    talker's frames) and replayed to the next replica in `replicas` on `move`, at most
    `max_moves` times. The relay puts the new replica's responses into the same sink."""

    def __init__(self, owner: str, stage: str, replicas: list[str], open_call: Callable[[str], Any],
                 sink: EventSink, is_final: Callable[[object], bool], max_moves: int,
                 metrics: StageMetrics | None = None, stall_timeout_s: float | None = None,
                 wait_ready: Callable[[str], Awaitable[None]] | None = None):
        self.owner = owner  # the stage this stream goes out of (metrics, logs)
        self.stage = stage
        self._replicas = list(replicas)  # primary first, then fallbacks
        self._open_call = open_call  # address -> a new bidi call
        self._wait_ready = wait_ready  # address -> until its channel connects (ChannelPool.wait_ready)
        self._sink = sink
        self._is_final = is_final
        self.max_moves = max_moves
        self._metrics = metrics
        self._sent: list = []  # every message written, in order
        self._closed = False
        self.moves = 0
        self.replica = ""
        self.call = None
        self._relay: asyncio.Task | None = None
        self._gate: Gate | None = None  # what the current relay delivers through
        self.moved_at: float | None = None  # perf_counter of the last move, until its first new output
        # No response from the replica for this long (since the stream opened or its last
        # response) fails the sink with StreamIdle naming it: a hung replica (SIGSTOP, a stuck
        # host) keeps its sockets open, so nothing else would tell.
        self.stall_timeout_s = stall_timeout_s
        self._last_response = 0.0
        self._watch: asyncio.Task | None = None
        self._migration: Migration | None = None  # the open `migrate` span of the last move, until its first output

    async def open(self) -> None:
        replica = self._replicas.pop(0)
        if self._wait_ready is not None:
            await self._wait_ready(replica)
        self._connect(replica)

    def _connect(self, replica: str) -> None:
        self.replica = replica
        self.call = self._open_call(replica)
        self._last_response = time.monotonic()
        self._gate = Gate(self._sink)
        self._relay = asyncio.create_task(
            relay_responses(self.call, self.stage, replica, self._gate, self._is_final, self._responded))
        if self.stall_timeout_s:
            self._watch = asyncio.create_task(self._watch_stall(self._relay, replica))

    def _responded(self) -> None:
        self._last_response = time.monotonic()

    async def _watch_stall(self, relay: asyncio.Task, replica: str) -> None:
        """Until the relay ends: fail the sink when the replica has sent nothing for the stall timeout."""
        while not relay.done():
            left = self._last_response + self.stall_timeout_s - time.monotonic()
            if left <= 0:
                log.warning("%s: %s replica %s sent nothing for %g s; ending the stream", self.owner, self.stage,
                            replica, self.stall_timeout_s)
                self._sink.fail(StreamIdle(self.stage, self.stall_timeout_s, replica))
                self.call.cancel()  # a write blocked on the replica's full flow-control window returns
                return
            await asyncio.wait({relay}, timeout=left)

    async def write(self, message) -> bool:
        self._sent.append(message)
        return await write_quietly(self.call, message)

    async def close(self) -> None:
        self._closed = True
        await close_quietly(self.call)

    def failed_here(self, exc: BaseException) -> bool:
        """Whether `exc` says the replica this stream is on died (not one further down)."""
        return isinstance(exc, StageUnavailable) and exc.stage == self.stage and exc.replica == self.replica

    async def recover(self, exc: BaseException, first=None) -> bool:
        """False when `exc` is not this stream's replica dying; else move to the next fallback
        replica and replay everything written (True), or re-raise `exc` when no fallback is left
        or the moves are spent. `first`: the message to replay in place of the first one written
        (the start, marked a replay: `as_replay`)."""
        if not self.failed_here(exc):
            return False
        if not self._replicas or self.moves >= self.max_moves:
            self._count("failed")
            raise exc
        left = self.replica
        self.cancel()
        self.moves += 1
        self.moved_at = time.perf_counter()
        self._migration = Migration(self.owner, self.stage, left, self._replicas[0], self.moves, exc.detail)
        if self._wait_ready is not None:
            await self._wait_ready(self._replicas[0])
        with self._migration.current():  # the replay's call (and so the new replica's spans) under `migrate`
            self._connect(self._replicas.pop(0))
        self._count("moved")
        log.warning("%s: %s replica %s failed mid-stream (%s); moved the request to %s (move %d of at most %d)",
                    self.owner, self.stage, left, exc.detail, self.replica, self.moves, self.max_moves)
        if first is not None and self._sent:
            self._sent[0] = first
        for message in self._sent:
            if not await write_quietly(self.call, message):
                # The new replica's stream broke during the replay (it died too): moved all the
                # same. Its relay reports how it ended, and a death there moves the request again
                # (the caller's next read); returning None here made the caller end the request
                # with the first failure although fallbacks were left.
                return True
        if self._closed:
            await close_quietly(self.call)
        return True

    def output(self) -> None:
        """A new output passed up: the first after a move ends the pause the caller heard."""
        if self.moved_at is not None:
            if self._metrics is not None:
                self._metrics.migration_pause.labels(self.owner, self.stage).observe(time.perf_counter() - self.moved_at)
            self.moved_at = None
            self._end_migration("moved")

    def _end_migration(self, outcome: str) -> None:
        if self._migration is not None:
            self._migration.end(outcome)
            self._migration = None

    def diverged(self) -> None:
        self._count("diverged")
        self._end_migration("diverged")

    def _count(self, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics.migrations.labels(self.owner, self.stage, outcome).inc()

    def cancel(self) -> None:
        """Free the request on the current replica (no-op when its call is over). Its relay is not
        cancelled (it may be waiting on a read: see services/serving/streams.py): the gate shuts,
        the call is cancelled, and the relay's read, then the relay, end by themselves."""
        self._end_migration("ended")  # the request ended before the new replica's first output
        if self._gate is not None:
            self._gate.open = False
        if self._watch is not None:
            self._watch.cancel()  # it waits on the relay, not on a read
        if self.call is not None:
            self.call.cancel()
        if self._relay is not None:
            let_end(self._relay)
