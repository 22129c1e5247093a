"""A realtime session from a test (`SessionCall`: the gRPC Sessions/Session with a reader thread) and
what the session tests share: the committed espeak-ng recordings, a one-shot Generate to compare
a turn with, the stages' loads."""

from __future__ import annotations

import queue
import threading
import time
import wave
from pathlib import Path

import grpc
import numpy as np

from omni.v1 import common_pb2, omni_pb2, omni_pb2_grpc
from services.serving.stage_stubs import stage_stub
from sessions.audio import wav_bytes

SPEECH = sorted((Path(__file__).parents[2] / "bench" / "speech").glob("*.wav"))  # 16 kHz pcm16
RATE = 16000


def speech(i: int) -> bytes:
    with wave.open(str(SPEECH[i])) as w:
        return w.readframes(w.getnframes())


def silence(seconds: float) -> bytes:
    return bytes(2 * int(RATE * seconds))


class SessionCall:
    """A session from a test: `send` messages, `next_event(kind)` waits for the next of a kind
    (every event is kept in `events`)."""

    def __init__(self, target: str, timeout_s: float = 120):
        self.channel = grpc.insecure_channel(target)
        self.requests: queue.Queue = queue.Queue()
        self.events: list[omni_pb2.SessionEvent] = []
        self.arrived = threading.Condition()
        self.status: grpc.RpcError | None = None
        self.ended = False
        self.call = omni_pb2_grpc.SessionsStub(self.channel).Session(iter(self.requests.get, None), timeout=timeout_s)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.seen = 0  # events next_event has handed out or skipped

    def _read(self) -> None:
        try:
            for event in self.call:
                with self.arrived:
                    self.events.append(event)
                    self.arrived.notify_all()
        except grpc.RpcError as err:
            self.status = err
        with self.arrived:
            self.ended = True
            self.arrived.notify_all()

    def send(self, **event) -> None:
        self.requests.put(omni_pb2.SessionRequest(**event))

    def speak(self, pcm: bytes, chunk_ms: int = 100) -> None:
        step = RATE * chunk_ms // 1000 * 2
        for i in range(0, len(pcm), step):
            self.send(append_audio=omni_pb2.AppendAudio(data=pcm[i:i + step]))

    def next_event(self, *kinds: str, timeout_s: float = 60) -> omni_pb2.SessionEvent:
        deadline = time.monotonic() + timeout_s
        with self.arrived:
            while True:
                while self.seen < len(self.events):
                    event = self.events[self.seen]
                    self.seen += 1
                    if event.WhichOneof("event") in kinds:
                        return event
                if self.ended or time.monotonic() > deadline:
                    raise AssertionError(f"no {kinds} event (ended: {self.ended}, status: {self.status}); got "
                                         f"{[e.WhichOneof('event') for e in self.events]}")
                self.arrived.wait(deadline - time.monotonic())

    def response(self, response_id: str) -> tuple[list[int], list[int], omni_pb2.ResponseDone]:
        """(text token ids, codec frame ids, its done event) of a response, once it is done."""
        done = None
        while done is None:
            event = self.next_event("response_done")
            if event.response_id == response_id:
                done = event.response_done
        mine = [e for e in self.events if e.response_id == response_id]
        return ([i for e in mine if e.WhichOneof("event") == "text" for i in e.text.token_ids],
                [i for e in mine if e.WhichOneof("event") == "codec_frames" for i in e.codec_frames.ids], done)

    def close(self) -> None:
        self.requests.put(None)
        self.call.cancel()
        self.channel.close()


def sampling(tokens: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_new_tokens=tokens)


MANUAL = omni_pb2.TurnDetection(enabled=False)
# NOTE: a reply that runs long: on the recordings the tiny checkpoint's greedy talker speaks to its frame
# limit (2,000 frames, 160 s of audio: 30-60 s of work on two cores; sampled, it ended within 50 frames).
LONG_REPLY = omni_pb2.SessionSettings(turn_detection=MANUAL, thinker_sampling=common_pb2.SamplingParams(max_new_tokens=8),
                                      talker_sampling=common_pb2.SamplingParams(max_new_tokens=2000))


def ask_for_a_long_reply(send) -> None:
    """A user turn of recorded speech and a response, through `send(**SessionRequest fields)`."""
    send(create_item=omni_pb2.CreateItem(message=omni_pb2.Message(role=omni_pb2.ROLE_USER, content=[
        omni_pb2.Content(audio=wav_bytes(np.frombuffer(speech(0), "<i2"), RATE))])))
    send(create_response=omni_pb2.CreateResponse())


def one_shot(omni, messages, thinker_tokens: int, talker_frames: int):
    request = omni_pb2.GenerateRequest(messages=messages, return_codec_frames=True,
                                       thinker_sampling=sampling(thinker_tokens), talker_sampling=sampling(talker_frames))
    ids, frames = [], []
    for response in omni.Generate(request, timeout=120):
        kind = response.WhichOneof("event")
        if kind == "text":
            ids += response.text.token_ids
        elif kind == "codec_frames":
            frames += response.codec_frames.ids
    return ids, frames


def loads(stack) -> dict[str, int]:
    held = {}
    for stage in ("thinker", "talker", "code2wav"):
        with grpc.insecure_channel(stack.addresses(stage)[0]) as channel:
            load = stage_stub(stage, channel).GetLoad(common_pb2.LoadRequest(), timeout=5)
        held[stage] = load.queue_depth + load.running + load.in_flight
    return held


def wait_idle(stack, timeout_s: float = 10) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    while True:
        held = loads(stack)
        if not any(held.values()) or time.monotonic() > deadline:
            return held
        time.sleep(0.1)
