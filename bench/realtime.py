"""`omni-bench --realtime N`: N realtime voice sessions at once, each speaking several turns of real
speech (bench/speech/, with silences) in real time, over the sessions service's Sessions/Session and
through the gateway's /v1/realtime WebSocket; the figures of a voice agent:

- end of speech -> first audio: from the moment the last sample of an utterance was sent to the
  first audio of the reply the server's turn detection started (it includes the detector's
  silence setting, which the report names);
- barge-in: from the moment the first sample of an utterance spoken over a reply still being made
  was sent to the last audio chunk of that reply the client received (0: none came after it), and
  to its `response.done` (cancelled);
- underruns: a client that plays each reply from its first chunk in real time, and a chunk that
  came after the audio before it had played out;
- turn detection's CPU per second of audio heard, and the sessions service's and the router's
  event-loop lag p99 over the level (from their /metrics, differences of two scrapes);
- leaked slots: after the run, requests each stage replica still holds (GetLoad), and the router's
  places in flight.

Each session speaks `turns` utterances; each reply but the last is interrupted: the next utterance
starts `barge_after_s` after the reply's first audio.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import wave
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import grpc
import numpy as np
import websockets

from bench.stage_metrics import histogram_quantile, scrape
from omni.v1 import omni_pb2, omni_pb2_grpc
from services.base.resample import resample

SPEECH_DIR = Path(__file__).parent / "speech"
CHUNK_MS = 20  # what a client sends at once, as a microphone callback would
SILENCE_MS = 500  # the turn detector's silence setting the sessions ask for


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
    cancel_s: list[float] = field(default_factory=list)  # speech over a reply -> its response.done (cancelled)
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
        """Each utterance, then silence until the reply's first audio, `barge_after_s` of it, and the
        next utterance over it; after the last, the last reply to its end."""
        chunk = self.rate * CHUNK_MS // 1000 * 2
        start, sent = time.perf_counter(), 0.0  # the real-time clock of what was sent

        async def audio(pcm: bytes, on_first=None) -> None:
            nonlocal sent
            for i in range(0, len(pcm), chunk):
                await asyncio.sleep(max(0.0, start + sent - time.perf_counter()))
                if i == 0 and on_first is not None:
                    on_first()
                await send("append", pcm[i:i + chunk])
                sent += len(pcm[i:i + chunk]) / 2 / self.rate

        for turn in range(self.turns):
            target = self.current
            self.reply_started.clear()
            await audio(self.utterances[turn % len(self.utterances)], lambda target=target: self.mark_barge(target))
            self.speech_ended = time.perf_counter()
            # Silence while the detector waits out its setting and the reply starts (the client keeps
            # sending, as a microphone does).
            waiting = asyncio.ensure_future(self._wait_reply(10.0))
            while not waiting.done():
                await audio(bytes(chunk))
            await asyncio.sleep(self.barge_after_s if turn + 1 < self.turns else 0)
            start, sent = time.perf_counter(), 0.0
        deadline = time.perf_counter() + 30
        while self.current is not None and not self._done(self.current) and time.perf_counter() < deadline:
            await asyncio.sleep(0.05)

    def mark_barge(self, target: str | None) -> None:
        """Speech starts over `target`'s reply (when it is still being made)."""
        if target is not None and target in self.replies and not self._done(target):
            self.barge_sent[target] = time.perf_counter()

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
        self.figures.underruns += reply.underruns
        if cancelled:
            self.figures.cancelled += 1
            if rid in self.barge_sent:
                # No chunk after the speech started: the server sent nothing over it (0).
                last = reply.last_audio if reply.last_audio is not None else 0.0
                self.figures.barge_in_s.append(max(0.0, last - self.barge_sent[rid]))
                self.figures.cancel_s.append(time.perf_counter() - self.barge_sent[rid])


def session_settings(max_tokens: int, max_frames: int, rate: int) -> omni_pb2.SessionSettings:
    settings = omni_pb2.SessionSettings(
        input_format=omni_pb2.AudioFormat(encoding=omni_pb2.AUDIO_ENCODING_PCM16, sample_rate=rate),
        turn_detection=omni_pb2.TurnDetection(enabled=True, silence_duration_ms=SILENCE_MS))
    settings.thinker_sampling.max_new_tokens = max_tokens
    settings.talker_sampling.max_new_tokens = max_frames
    # NOTE: greedy: on the recordings the tiny checkpoint's talker speaks to its frame limit (sampled,
    # it picked its end code within 40-50 frames), so a reply is still being made when it is interrupted.
    return settings


async def grpc_session(target: str, speaker: Speaker, settings: omni_pb2.SessionSettings) -> None:
    async with grpc.aio.insecure_channel(target) as channel:
        call = omni_pb2_grpc.SessionsStub(channel).Session()
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
    cancel_ms_p50: float | None  # speech over a reply -> its cancelled response's done event
    barge_ins: int
    underruns: int
    replies: int
    errors: list[str]
    detection_cpu_ms_per_s: float | None = None  # turn detection's CPU per second of audio heard
    sessions_lag_p99_ms: float | None = None  # event-loop lag p99 (its histogram bucket's bound)
    router_lag_p99_ms: float | None = None


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
        cancel_ms_p50=_pct([v for s in speakers for v in s.figures.cancel_s], 0.5),
        underruns=sum(s.figures.underruns for s in speakers), replies=sum(s.figures.replies for s in speakers),
        errors=sorted({e for s in speakers for e in s.figures.errors}))


class ServiceMetrics:
    """The sessions service's and the router's /metrics, scraped around each level."""

    SESSIONS_LAG, ROUTER_LAG = "omni_session_loop_lag_seconds", "omni_router_loop_lag_seconds"
    CPU, AUDIO = "omni_session_turn_detection_cpu_seconds_total", "omni_session_turn_detection_audio_seconds_total"

    def __init__(self, host: str, sessions_port: int, router_port: int):
        self.urls = (f"http://{host}:{sessions_port}/metrics", f"http://{host}:{router_port}/metrics")

    def snapshot(self) -> tuple[dict, dict]:
        return tuple(scrape(url) for url in self.urls)

    def figures(self, before: tuple[dict, dict], after: tuple[dict, dict]) -> dict[str, float | None]:
        """RealtimeResult's service figures over the interval between two snapshots."""
        (sessions_0, router_0), (sessions_1, router_1) = before, after

        def delta(name: str) -> float:
            return sessions_1.get((name, ()), 0.0) - sessions_0.get((name, ()), 0.0)

        def lag(b: dict, a: dict, name: str) -> float | None:
            p99 = histogram_quantile(b, a, name, 0.99)
            return None if p99 is None else round(p99 * 1000, 1)

        heard = delta(self.AUDIO)
        return {"detection_cpu_ms_per_s": round(1000 * delta(self.CPU) / heard, 1) if heard else None,
                "sessions_lag_p99_ms": lag(sessions_0, sessions_1, self.SESSIONS_LAG),
                "router_lag_p99_ms": lag(router_0, router_1, self.ROUTER_LAG)}


def render(results: list[RealtimeResult], leaked: dict[str, int]) -> str:
    lines = [f"realtime sessions (turn detection silence {SILENCE_MS} ms; end of speech -> first audio includes it; "
             "detection: CPU ms per s of audio; lag: event-loop lag p99, sessions service / router)",
             f"{'path':<10}{'N':>4}{'first audio p50':>17}{'p90':>10}{'barge-in p50':>14}{'p90':>9}{'cancel p50':>12}"
             f"{'barge-ins':>11}{'underruns':>11}{'replies':>9}{'detection':>11}{'lag':>16}"]
    for r in results:
        lag = f"{_ms(r.sessions_lag_p99_ms)} / {_ms(r.router_lag_p99_ms)}"
        detection = "-" if r.detection_cpu_ms_per_s is None else f"{r.detection_cpu_ms_per_s:.1f}"
        lines.append(f"{r.path:<10}{r.sessions:>4}{_ms(r.first_audio_ms_p50):>17}{_ms(r.first_audio_ms_p90):>10}"
                     f"{_ms(r.barge_in_ms_p50):>14}{_ms(r.barge_in_ms_p90):>9}{_ms(r.cancel_ms_p50):>12}"
                     f"{r.barge_ins:>11}{r.underruns:>11}"
                     f"{r.replies:>9}{detection:>11}{lag:>16}")
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
    from services.tools.launcher import Stack, StackOptions, free_port

    sessions_port, router_port = free_port(), free_port()
    options = StackOptions(checkpoint=checkpoint, port=0, log_prefix=False, http_port=0 if gateway else None,
                           thinker_args=("--default-max-new-tokens", str(max_tokens)),
                           talker_args=("--default-max-new-tokens", str(max_frames)),
                           router_args=("--metrics-port", str(router_port)),
                           sessions_args=("--metrics-port", str(sessions_port)))
    results = []
    with Stack(options) as stack:
        ws_url = stack.http_url.replace("http://", "ws://") + "/v1/realtime?model=bench" if gateway else None
        services = ServiceMetrics(options.host, sessions_port, router_port)
        for path in ("grpc", "websocket") if gateway else ("grpc",):
            for sessions in levels:
                before = services.snapshot()
                result = asyncio.run(run_sessions(path, sessions, turns, stack.sessions_target, ws_url,
                                                  max_tokens, max_frames, barge_after_s))
                results.append(replace(result, **services.figures(before, services.snapshot())))
                print(render(results[-1:], {}).splitlines()[-2], flush=True)
        leaked = leaked_slots(stack)
    return results, leaked


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.realtime` (and `omni-bench --realtime N`): the levels, over gRPC then the gateway."""
    import argparse

    parser = argparse.ArgumentParser(prog="omni-bench --realtime", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="models/tiny-qwen3-omni")
    parser.add_argument("--sessions", default="1,8,32", help="levels: sessions at once (default 1,8,32)")
    parser.add_argument("--turns", type=int, default=6, help="utterances each session speaks (default 6)")
    parser.add_argument("--max-tokens", type=int, default=16, help="the thinker's tokens a reply (default 16)")
    parser.add_argument("--max-frames", type=int, default=300,
                        help="the talker's frames a reply (default 300: 24 s of audio, made in about 4 s at N=1)")
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
