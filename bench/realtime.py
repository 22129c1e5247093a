"""`omni-bench --realtime N`: N realtime voice sessions at once, each speaking several turns of real
speech (bench/speech/, with silences) in real time, over the router's Omni/Session and through the
gateway's /v1/realtime WebSocket; the figures of a voice agent:

- end of speech -> first audio: from the moment the last sample of an utterance was sent to the
  first audio of the reply the server's turn detection started (it includes the detector's
  silence setting, which the report names);
- barge-in: from the moment the first sample of an utterance spoken over a playing reply was sent
  to the last audio chunk of that reply the client received;
- underruns: a client that plays each reply from its first chunk in real time, and a chunk that
  came after the audio before it had played out;
- leaked slots: after the run, requests each stage replica still holds (GetLoad), and the router's
  places in flight.

Each session speaks `turns` utterances; every other turn is interrupted: the next utterance starts
`barge_after_s` after the reply's first audio.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import wave
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import numpy as np
import websockets

from omni.v1 import omni_pb2, omni_pb2_grpc
from services.base.resample import resample

SPEECH_DIR = Path(__file__).parent / "speech"
CHUNK_MS = 20  # what a client sends at once, as a microphone callback would
SILENCE_MS = 500  # the turn detector's silence setting the sessions ask for
GAP_S = 1.5  # silence after an utterance that is not interrupted (the reply plays meanwhile)


def load_speech(rate: int) -> list[bytes]:
    """The recordings as pcm16 at `rate`."""
    utterances = []
    for path in sorted(SPEECH_DIR.glob("*.wav")):
        with wave.open(str(path)) as w:
            samples = np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32768
            source = w.getframerate()
        out = resample(samples, source, rate) if rate != source else samples
        utterances.append(np.clip(np.rint(out * 32767), -32768, 32767).astype("<i2").tobytes())
    return utterances


@dataclass
class SessionFigures:
    first_audio_s: list[float] = field(default_factory=list)  # end of speech -> first audio, per answered turn
    barge_in_s: list[float] = field(default_factory=list)  # speech over a reply -> its last audio chunk
    underruns: int = 0
    replies: int = 0
    cancelled: int = 0
    errors: list[str] = field(default_factory=list)


class Reply:
    def __init__(self, created: float):
        self.created = created
        self.first_audio: float | None = None
        self.last_audio: float | None = None
        self.played_until: float | None = None  # a listener playing from the first chunk
        self.underruns = 0

    def audio(self, now: float, seconds: float) -> None:
        if self.first_audio is None:
            self.first_audio = now
        elif now > self.played_until:
            self.underruns += 1
        self.played_until = max(self.played_until or now, now) + seconds
        self.last_audio = now


class Speaker:
    """One session's client: sends speech in real time, times what comes back. `send(kind, data)`
    and the events come from a transport (gRPC or the Realtime WebSocket)."""

    def __init__(self, utterances: list[bytes], rate: int, turns: int, barge_after_s: float):
        self.utterances, self.rate, self.turns, self.barge_after_s = utterances, rate, turns, barge_after_s
        self.figures = SessionFigures()
        self.speech_ended: float | None = None
        self.replies: dict[str, Reply] = {}  # response id -> its reply
        self.current: str | None = None
        self.reply_started = asyncio.Event()
        self.barge_sent: dict[str, float] = {}  # response id -> when speech over it started

    async def speak(self, send) -> None:
        chunk = self.rate * CHUNK_MS // 1000 * 2
        start = time.perf_counter()
        sent = 0.0  # seconds of audio sent

        async def audio(pcm: bytes, on_first=None) -> None:
            nonlocal sent
            for i in range(0, len(pcm), chunk):
                await asyncio.sleep(max(0.0, start + sent - time.perf_counter()))
                if i == 0 and on_first is not None:
                    on_first()
                await send("append", pcm[i:i + chunk])
                sent += len(pcm[i:i + chunk]) / 2 / self.rate

        for turn in range(self.turns):
            utterance = self.utterances[turn % len(self.utterances)]
            interrupting = self.current if turn % 2 == 1 else None

            def mark(target=interrupting):
                if target is not None and target in self.replies and not self._done(target):
                    self.barge_sent[target] = time.perf_counter()
            self.reply_started.clear()
            await audio(utterance, mark)
            self.speech_ended = time.perf_counter()
            if turn % 2 == 0 and turn + 1 < self.turns:
                # Let the reply start, then speak over it `barge_after_s` later.
                await audio(bytes(2 * int(self.rate * SILENCE_MS / 1000)))
                await self._wait_reply(5.0)
                await asyncio.sleep(self.barge_after_s)
                start, sent = time.perf_counter(), 0.0
            else:
                await audio(bytes(2 * int(self.rate * GAP_S)))
        await asyncio.sleep(2.0)

    async def _wait_reply(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self.reply_started.wait(), timeout)
        except TimeoutError:
            pass

    def _done(self, rid: str) -> bool:
        return getattr(self.replies[rid], "done", False)

    def on_created(self, rid: str) -> None:
        self.replies[rid] = Reply(time.perf_counter())
        self.current = rid

    def on_audio(self, rid: str, seconds: float) -> None:
        reply = self.replies.get(rid)
        if reply is None:
            return
        now = time.perf_counter()
        if reply.first_audio is None:
            if self.speech_ended is not None:
                self.figures.first_audio_s.append(now - self.speech_ended)
                self.speech_ended = None
            self.reply_started.set()
        reply.audio(now, seconds)

    def on_done(self, rid: str, cancelled: bool) -> None:
        reply = self.replies.get(rid)
        if reply is None:
            return
        reply.done = True
        self.figures.replies += 1
        if cancelled:
            self.figures.cancelled += 1
            if rid in self.barge_sent and reply.last_audio is not None:
                self.figures.barge_in_s.append(max(0.0, reply.last_audio - self.barge_sent[rid]))
        else:
            self.figures.underruns += reply.underruns


def session_settings(max_tokens: int, max_frames: int, rate: int) -> omni_pb2.SessionSettings:
    settings = omni_pb2.SessionSettings(
        input_format=omni_pb2.AudioFormat(encoding=omni_pb2.AUDIO_ENCODING_PCM16, sample_rate=rate),
        turn_detection=omni_pb2.TurnDetection(enabled=True, silence_duration_ms=SILENCE_MS))
    settings.thinker_sampling.max_new_tokens = max_tokens
    settings.talker_sampling.max_new_tokens = max_frames
    # NOTE: the tiny checkpoint's random talker often picks its end code early when greedy; sampled
    # (seeded) it speaks to the frame limit, long enough to be interrupted while it is still made.
    settings.talker_sampling.temperature = 3.0
    settings.talker_sampling.seed = 1
    return settings


async def grpc_session(target: str, speaker: Speaker, settings: omni_pb2.SessionSettings) -> None:
    async with grpc.aio.insecure_channel(target) as channel:
        call = omni_pb2_grpc.OmniStub(channel).Session()
        await call.write(omni_pb2.SessionRequest(update=settings))

        async def send(kind: str, data: bytes) -> None:
            await call.write(omni_pb2.SessionRequest(append_audio=omni_pb2.AppendAudio(data=data)))

        async def receive() -> None:
            async for event in call:
                kind = event.WhichOneof("event")
                if kind == "response_created":
                    speaker.on_created(event.response_id)
                elif kind == "audio":
                    speaker.on_audio(event.response_id, event.audio.num_samples / event.audio.sample_rate)
                elif kind == "response_done":
                    speaker.on_done(event.response_id, event.response_done.status == omni_pb2.RESPONSE_STATUS_CANCELLED)
                elif kind == "error":
                    speaker.figures.errors.append(event.error.message)

        reader = asyncio.create_task(receive())
        try:
            await speaker.speak(send)
        finally:
            call.cancel()
            await asyncio.gather(reader, return_exceptions=True)


async def websocket_session(url: str, speaker: Speaker, max_tokens: int) -> None:
    async with websockets.connect(url, max_size=None) as ws:
        await ws.send(json.dumps({"type": "session.update", "session": {
            "type": "realtime", "max_output_tokens": max_tokens,
            "audio": {"input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": SILENCE_MS}}}}}))

        async def send(kind: str, data: bytes) -> None:
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(data).decode()}))

        async def receive() -> None:
            async for message in ws:
                event = json.loads(message)
                kind = event["type"]
                if kind == "response.created":
                    speaker.on_created(event["response"]["id"])
                elif kind == "response.output_audio.delta":
                    speaker.on_audio(event["response_id"], len(event["delta"]) * 3 / 4 / 2 / 24000)
                elif kind == "response.done":
                    speaker.on_done(event["response"]["id"], event["response"]["status"] == "cancelled")
                elif kind == "error":
                    speaker.figures.errors.append(event["error"]["message"])

        reader = asyncio.create_task(receive())
        try:
            await speaker.speak(send)
        finally:
            await ws.close()
            await asyncio.gather(reader, return_exceptions=True)


@dataclass
class RealtimeResult:
    path: str  # grpc | websocket
    sessions: int
    turns: int
    silence_ms: int
    first_audio_ms_p50: float | None
    first_audio_ms_p90: float | None
    barge_in_ms_p50: float | None
    barge_in_ms_p90: float | None
    barge_ins: int
    underruns: int
    replies: int
    errors: list[str]


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)


async def run_sessions(path: str, sessions: int, turns: int, target: str, ws_url: str | None, max_tokens: int,
                       max_frames: int, barge_after_s: float) -> RealtimeResult:
    rate = 16000 if path == "grpc" else 24000
    utterances = load_speech(rate)
    speakers = [Speaker(utterances, rate, turns, barge_after_s) for _ in range(sessions)]
    if path == "grpc":
        settings = session_settings(max_tokens, max_frames, rate)
        await asyncio.gather(*(grpc_session(target, s, settings) for s in speakers))
    else:
        await asyncio.gather(*(websocket_session(ws_url, s, max_tokens) for s in speakers))
    first = [v for s in speakers for v in s.figures.first_audio_s]
    barge = [v for s in speakers for v in s.figures.barge_in_s]
    return RealtimeResult(
        path=path, sessions=sessions, turns=turns, silence_ms=SILENCE_MS,
        first_audio_ms_p50=_pct(first, 0.5), first_audio_ms_p90=_pct(first, 0.9),
        barge_in_ms_p50=_pct(barge, 0.5), barge_in_ms_p90=_pct(barge, 0.9), barge_ins=len(barge),
        underruns=sum(s.figures.underruns for s in speakers), replies=sum(s.figures.replies for s in speakers),
        errors=sorted({e for s in speakers for e in s.figures.errors}))


def render(results: list[RealtimeResult], leaked: dict[str, int]) -> str:
    lines = [f"realtime sessions (turn detection silence {SILENCE_MS} ms; end of speech -> first audio includes it)",
             f"{'path':<10}{'N':>4}{'first audio p50':>17}{'p90':>8}{'barge-in p50':>14}{'p90':>8}{'barge-ins':>11}"
             f"{'underruns':>11}{'replies':>9}"]
    for r in results:
        lines.append(f"{r.path:<10}{r.sessions:>4}{_ms(r.first_audio_ms_p50):>17}{_ms(r.first_audio_ms_p90):>8}"
                     f"{_ms(r.barge_in_ms_p50):>14}{_ms(r.barge_in_ms_p90):>8}{r.barge_ins:>11}{r.underruns:>11}"
                     f"{r.replies:>9}")
        for error in r.errors:
            lines.append(f"  error: {error}")
    lines.append("leaked after the run: " + ", ".join(f"{k} {v}" for k, v in leaked.items()))
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def as_json(results: list[RealtimeResult], leaked: dict[str, int]) -> str:
    return json.dumps({"results": [asdict(r) for r in results], "leaked": leaked}, indent=2)


def leaked_slots(stack, settle_s: float = 10.0) -> dict[str, int]:
    """Requests each stage still holds (queued, running, open streams), summed per stage, once the
    last sessions' cancelled responses had `settle_s` to wind down (on two busy cores that takes up
    to about 2 s after 8 sessions close mid-reply)."""
    from omni.v1 import common_pb2
    from services.serving.stage_stubs import stage_stub

    deadline = time.monotonic() + settle_s
    while True:
        held = {}
        for stage in ("thinker", "talker", "code2wav"):
            held[stage] = 0
            for address in stack.addresses(stage):
                with grpc.insecure_channel(address) as channel:
                    load = stage_stub(stage, channel).GetLoad(common_pb2.LoadRequest(), timeout=5)
                held[stage] += load.queue_depth + load.running + load.in_flight
        if not any(held.values()) or time.monotonic() > deadline:
            return held
        time.sleep(0.25)


def run_realtime(checkpoint: str, levels: tuple[int, ...], turns: int, max_tokens: int, max_frames: int,
                 barge_after_s: float, gateway: bool = True) -> tuple[list[RealtimeResult], dict[str, int]]:
    """The stack (and the gateway) on `checkpoint`; each level over gRPC, then through the gateway."""
    from services.tools.launcher import Stack, StackOptions

    options = StackOptions(checkpoint=checkpoint, port=0, log_prefix=False, http_port=0 if gateway else None,
                           thinker_args=("--default-max-new-tokens", str(max_tokens)),
                           talker_args=("--default-max-new-tokens", str(max_frames)))
    results = []
    with Stack(options) as stack:
        ws_url = stack.http_url.replace("http://", "ws://") + "/v1/realtime?model=bench" if gateway else None
        for path in ("grpc", "websocket") if gateway else ("grpc",):
            for sessions in levels:
                results.append(asyncio.run(run_sessions(path, sessions, turns, stack.target, ws_url, max_tokens,
                                                        max_frames, barge_after_s)))
                print(render(results[-1:], {}).splitlines()[-2], flush=True)
        leaked = leaked_slots(stack)
    return results, leaked


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.realtime` (and `omni-bench --realtime N`): the levels, over gRPC then the gateway."""
    import argparse

    parser = argparse.ArgumentParser(prog="omni-bench --realtime", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="models/tiny-qwen3-omni")
    parser.add_argument("--sessions", default="1,8", help="levels: sessions at once (default 1,8)")
    parser.add_argument("--turns", type=int, default=6, help="utterances each session speaks (default 6)")
    parser.add_argument("--max-tokens", type=int, default=16, help="the thinker's tokens a reply (default 16)")
    parser.add_argument("--max-frames", type=int, default=200, help="the talker's frames a reply (default 200)")
    parser.add_argument("--barge-after-s", type=float, default=0.3,
                        help="speak over a reply this long after its first audio (default 0.3)")
    parser.add_argument("--out", default=None, help="also write the figures as JSON here")
    args = parser.parse_args(argv)
    levels = tuple(int(n) for n in args.sessions.split(","))
    results, leaked = run_realtime(args.checkpoint, levels, args.turns, args.max_tokens, args.max_frames,
                                   args.barge_after_s)
    print(render(results, leaked))
    if args.out:
        Path(args.out).write_text(as_json(results, leaked))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
