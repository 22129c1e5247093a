"""Figures: docs/sessions.md, "The user's transcript" (what the transcription pass costs the reply).
Rerun: `.venv/bin/python -m bench.probes.transcription_first_audio [checkpoint] [rounds]` (default
models/tiny-qwen3-omni, 3).

The stack on the checkpoint; each turn a new session (turn detection on, replies of 8 text tokens
and up to 24 frames, greedy) that gets one of the four recordings of bench/speech/ (0.5 s of silence
before, 1 s after, sent at once) with input transcription off, then on, alternating turn by turn;
per turn the time from the speech_stopped event to the reply's first audio chunk, as the client
receives them, and (on) from that first audio to the transcript's completed event.
"""

from __future__ import annotations

import queue
import statistics
import sys
import time
import wave
from pathlib import Path

import grpc

from omni.v1 import common_pb2, omni_pb2, omni_pb2_grpc
from services.tools.launcher import Stack, StackOptions

SPEECH = sorted((Path(__file__).parents[1] / "speech").glob("*.wav"))  # 16 kHz pcm16, the session's default input


def recording(i: int) -> bytes:
    with wave.open(str(SPEECH[i])) as w:
        return bytes(16000) + w.readframes(w.getnframes()) + bytes(32000)  # 0.5 s of silence before, 1 s after


def one_turn(stack: Stack, i: int, transcribe: bool) -> tuple[float, float | None]:
    """(speech stopped -> first audio, first audio -> transcript completed) in seconds, as received."""
    requests: queue.Queue = queue.Queue()
    channel = grpc.insecure_channel(stack.sessions_target)
    call = omni_pb2_grpc.SessionsStub(channel).Session(iter(requests.get, None), timeout=120)
    requests.put(omni_pb2.SessionRequest(update=omni_pb2.SessionSettings(
        thinker_sampling=common_pb2.SamplingParams(max_new_tokens=8),
        talker_sampling=common_pb2.SamplingParams(max_new_tokens=24),
        input_transcription=omni_pb2.InputTranscription(enabled=transcribe))))
    pcm = recording(i)
    for k in range(0, len(pcm), 3200):  # 100 ms appends
        requests.put(omni_pb2.SessionRequest(append_audio=omni_pb2.AppendAudio(data=pcm[k:k + 3200])))
    arrived: dict[str, float] = {}
    try:
        for event in call:
            kind = event.WhichOneof("event")
            if kind in ("speech_stopped", "audio", "transcription_completed", "response_done"):
                arrived.setdefault(kind, time.perf_counter())
            if "response_done" in arrived and ("transcription_completed" in arrived or not transcribe):
                break
    finally:
        requests.put(None)
        call.cancel()
        channel.close()
    transcript = arrived["transcription_completed"] - arrived["audio"] if transcribe else None
    return arrived["audio"] - arrived["speech_stopped"], transcript


def main(checkpoint: str = "models/tiny-qwen3-omni", rounds: str = "3") -> None:
    options = StackOptions(checkpoint=checkpoint, port=0, log_prefix=False)
    first = {False: [], True: []}
    transcripts = []
    with Stack(options) as stack:
        one_turn(stack, 0, True)  # warm-up
        for _ in range(int(rounds)):
            for i in range(len(SPEECH)):
                for transcribe in (False, True):
                    audio_s, transcript_s = one_turn(stack, i, transcribe)
                    first[transcribe].append(audio_s)
                    if transcript_s is not None:
                        transcripts.append(transcript_s)
    for transcribe, took in first.items():
        print(f"transcription {'on ' if transcribe else 'off'}: speech stopped -> first audio p50 "
              f"{statistics.median(took) * 1000:.0f} ms, max {max(took) * 1000:.0f} ms ({len(took)} turns)")
    print(f"first audio -> transcript completed p50 {statistics.median(transcripts) * 1000:.0f} ms, "
          f"max {max(transcripts) * 1000:.0f} ms")


if __name__ == "__main__":
    main(*sys.argv[1:])
