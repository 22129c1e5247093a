"""`omni-bench --realtime 1 --session-minutes M`: one voice session that speaks a turn of real speech
(bench/speech/) every 15 s for M minutes through the sessions service (Sessions/Session over gRPC),
with the thinker's encoder cache on and off: each turn's end of speech -> first audio over the
session (first, turn 2, last, last / turn 2) and whether every turn was answered.

The session re-sends its whole history each turn (truncated to fit, oldest turns first), so
without the encoder cache a turn encodes every clip so far again; the goal is a last turn within
1.5x of turn 2. The client keeps sending silence between turns, as a microphone does.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.realtime import CHUNK_MS, SILENCE_MS, Speaker, grpc_session, load_speech, session_settings

PERIOD_S = 15.0  # a turn starts every this many seconds
RATE = 16000


class TurnSpeaker(Speaker):
    """A Speaker that speaks one utterance every PERIOD_S and never over a reply; `turn_first_audio`
    holds each turn's end of speech -> first audio in seconds (None: not answered within its period)."""

    def __init__(self, utterances: list[bytes], turns: int):
        super().__init__(utterances, RATE, turns, barge_after_s=0.0)
        self.turn_first_audio: list[float | None] = []
        self.turn_errors: list[str] = []  # every error event, with the turn it came in

    async def speak(self, send) -> None:
        chunk = RATE * CHUNK_MS // 1000 * 2
        start, sent = time.perf_counter(), 0.0  # the real-time clock of what was sent

        async def audio(pcm: bytes) -> None:
            nonlocal sent
            for i in range(0, len(pcm), chunk):
                await asyncio.sleep(max(0.0, start + sent - time.perf_counter()))
                await send("append", pcm[i:i + chunk])
                sent += len(pcm[i:i + chunk]) / 2 / RATE

        for turn in range(self.turns):
            answered = len(self.figures.first_audio_s)
            self.speech_ended = None  # a late first audio of an earlier turn is not this one's
            await audio(self.utterances[turn % len(self.utterances)])
            self.speech_ended = time.perf_counter()
            while sent < (turn + 1) * PERIOD_S:  # silence to the next turn's start
                await audio(bytes(chunk))
            got = self.figures.first_audio_s[answered:]
            self.turn_first_audio.append(got[0] if got else None)
            self.turn_errors.extend(f"turn {turn + 1}: {e}" for e in self.figures.errors[len(self.turn_errors):])


@dataclass
class LongSessionResult:
    encoder_cache_mb: int
    minutes: float
    turns: int
    answered: int
    first_ms: float | None  # turn 1's end of speech -> first audio
    turn2_ms: float | None
    last_ms: float | None
    last_over_turn2: float | None
    early_p50_ms: float | None  # turns 2-11's median: one turn's figure is noisy on shared cores
    late_p50_ms: float | None  # the last ten turns' median
    per_turn_ms: list[float | None]
    errors: list[str]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 1)


def _median(values: list[float | None]) -> float | None:
    answered = sorted(v for v in values if v is not None)
    return answered[len(answered) // 2] if answered else None


def run_long_session(checkpoint: str, minutes: float, encoder_cache_mb: int, max_tokens: int = 16,
                     max_frames: int = 100) -> LongSessionResult:
    """A stack on `checkpoint` with `--encoder-cache-mb encoder_cache_mb`, one session of M minutes."""
    from services.tools.launcher import Stack, StackOptions

    turns = max(2, int(minutes * 60 // PERIOD_S))
    options = StackOptions(checkpoint=checkpoint, port=0, log_prefix=False, http_port=None,
                           thinker_args=("--default-max-new-tokens", str(max_tokens),
                                         "--encoder-cache-mb", str(encoder_cache_mb)),
                           talker_args=("--default-max-new-tokens", str(max_frames)))
    speaker = TurnSpeaker(load_speech(RATE), turns)
    with Stack(options) as stack:
        asyncio.run(grpc_session(stack.sessions_target, speaker, session_settings(max_tokens, max_frames, RATE)))
    per_turn = [_ms(v) for v in speaker.turn_first_audio]
    turn2, last = per_turn[1], per_turn[-1]
    return LongSessionResult(
        encoder_cache_mb=encoder_cache_mb, minutes=minutes, turns=turns,
        answered=sum(v is not None for v in per_turn), first_ms=per_turn[0], turn2_ms=turn2, last_ms=last,
        last_over_turn2=round(last / turn2, 2) if last and turn2 else None, early_p50_ms=_median(per_turn[1:11]),
        late_p50_ms=_median(per_turn[-10:]), per_turn_ms=per_turn,
        errors=speaker.turn_errors)


def render(results: list[LongSessionResult]) -> str:
    lines = [f"long session: a turn every {PERIOD_S:.0f} s (turn detection silence {SILENCE_MS} ms; end of speech "
             "-> first audio includes it)",
             f"{'encoder cache':<15}{'minutes':>8}{'answered':>12}{'first':>9}{'turn 2':>9}{'last':>9}{'last/turn 2':>13}"
             f"{'turns 2-11 p50':>16}{'last 10 p50':>13}"]
    for r in results:
        lines.append(f"{str(r.encoder_cache_mb) + ' MiB':<15}{r.minutes:>8g}{f'{r.answered}/{r.turns}':>12}"
                     f"{_fmt(r.first_ms):>9}{_fmt(r.turn2_ms):>9}{_fmt(r.last_ms):>9}"
                     f"{'-' if r.last_over_turn2 is None else f'{r.last_over_turn2:.2f}x':>13}"
                     f"{_fmt(r.early_p50_ms):>16}{_fmt(r.late_p50_ms):>13}")
        for error in r.errors[:5]:
            lines.append(f"  error: {error}")
        if len(r.errors) > 5:
            lines.append(f"  ... {len(r.errors) - 5} more errors (the JSON has them all)")
    return "\n".join(lines)


def _fmt(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.0f} ms"


def run_and_report(checkpoint: str, minutes: float, cache_sizes: tuple[int, ...], out: str | None) -> str:
    """Each cache size in turn (one stack each); the table, and the figures as JSON at `out`."""
    results = []
    for size in cache_sizes:
        results.append(run_long_session(checkpoint, minutes, size))
        print(render(results[-1:]).splitlines()[2], flush=True)
        if out:  # after each run: a long run's figures are kept whatever comes after
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text(json.dumps([asdict(r) for r in results], indent=2))
    return render(results)


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.long_session --minutes M`: the session with the encoder cache on, then off."""
    import argparse

    parser = argparse.ArgumentParser(prog="omni-bench --realtime 1 --session-minutes", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="models/tiny-qwen3-omni")
    parser.add_argument("--minutes", type=float, default=30.0, help="the session's length (default 30)")
    parser.add_argument("--encoder-cache-mb", default="256,0",
                        help="the thinker's --encoder-cache-mb, one run each (default 256,0: on, then off)")
    parser.add_argument("--out", default=None, help="also write the figures as JSON here")
    args = parser.parse_args(argv)
    sizes = tuple(int(x) for x in args.encoder_cache_mb.split(","))
    print(run_and_report(args.checkpoint, args.minutes, sizes, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
