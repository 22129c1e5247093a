"""Figures: docs/sessions.md, "What turn detection costs". Rerun: `.venv/bin/python -m bench.probes.turn_detection_cpu`.

CPU time (process time, every thread) of a session's turn detection per second of 24 kHz pcm16
input, through the code an append runs (sessions/audio.py's decode, sessions/input_audio.py's
InputAudio.append: the resampler to 16 kHz, the windows, Silero VAD), in 20 ms appends as a
microphone sends them, over three inputs made of the committed recordings (bench/speech/):

- speech and silence: each recording then 1 s of digital silence (what clients send between turns);
- speech and room noise: the same with the silences as white noise at -50 dBFS (a quiet room);
- speech alone: the recordings back to back.

Then the same for the whole of one 1 MiB append (about 22 s of audio): its CPU time, which the
sessions service spends on its detection thread, not on its event loop.
"""

from __future__ import annotations

import time
import wave
from pathlib import Path

import numpy as np

from services.base.resample import resample
from sessions.audio import PCM16, InputFormat, decode
from sessions.input_audio import InputAudio
from sessions.turn_detection import TurnDetectionSettings, silero

RATE = 24000
SPEECH = sorted((Path(__file__).parents[1] / "speech").glob("*.wav"))


def recordings() -> list[np.ndarray]:
    out = []
    for path in SPEECH:
        with wave.open(str(path)) as w:
            samples = np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32768
        out.append(np.clip(np.rint(resample(samples, 16000, RATE) * 32767), -32768, 32767).astype(np.int16))
    return out


def cpu_ms_per_second(pcm: bytes, append_ms: int = 20) -> float:
    fmt = InputFormat(PCM16, RATE)
    audio = InputAudio(silero)
    audio.configure(fmt, TurnDetectionSettings())
    step = RATE * append_ms // 1000 * 2
    start = time.process_time()
    for i in range(0, len(pcm), step):
        audio.append(decode(pcm[i:i + step], fmt, "append_audio.data"))
        audio.trim()
    return (time.process_time() - start) * 1000 / (len(pcm) / 2 / RATE)


def main() -> None:
    rng = np.random.default_rng(0)
    speech = recordings()
    silence = np.zeros(RATE, np.int16)
    noise = np.rint(rng.standard_normal(RATE) * 32767 * 10 ** (-50 / 20)).astype(np.int16)
    inputs = {
        "speech and silence": np.concatenate([x for s in speech for x in (s, silence)]),
        "speech and room noise": np.concatenate([x for s in speech for x in (s, noise)]),
        "speech alone": np.concatenate(speech),
    }
    for name, samples in inputs.items():
        runs = [cpu_ms_per_second(samples.astype("<i2").tobytes()) for _ in range(3)]
        print(f"{name:22} {len(samples) / RATE:5.1f} s: {min(runs):5.1f} ms CPU per s of audio "
              f"(3 runs: {', '.join(f'{r:.1f}' for r in runs)})")
    big = np.resize(np.concatenate([x for s in speech for x in (s, silence)]), (1 << 20) // 2).astype("<i2").tobytes()
    per_s = cpu_ms_per_second(big, append_ms=len(big) * 1000 // 2 // RATE)
    print(f"one 1 MiB append ({len(big) / 2 / RATE:.1f} s, speech and silence): {per_s * len(big) / 2 / RATE:.0f} ms CPU")


if __name__ == "__main__":
    main()
