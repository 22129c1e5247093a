"""A spoken session's later turns encode only their new audio (project issue 56, item 3): the session
re-sends every turn's clip, and the thinker's encoder cache (`--encoder-cache-mb`) finds the earlier
ones, counted on its /metrics (omni_encoder_cache_*); each turn still equals the one-shot request of
its history."""

from __future__ import annotations

import numpy as np
import pytest

from bench.stage_metrics import scrape
from omni.v1 import omni_pb2
from services.tools.client import connect
from services.tools.launcher import free_port_block
from sessions.audio import wav_bytes
from tests.sessions.session_support import MANUAL, RATE, SPEECH, SessionCall, one_shot, sampling, speech
from tests.stacks import stack_of

# slow: a stack of its own (the encoder cache on, metrics ports)
pytestmark = [pytest.mark.slow, pytest.mark.exactness]

TOKENS, FRAMES = 6, 8


@pytest.fixture(scope="module")
def stack(tiny_checkpoint):
    with stack_of(tiny_checkpoint, thinker_args=("--encoder-cache-mb", "16"), metrics_base_port=free_port_block()) as stack:
        yield stack


def encoder_counters(stack) -> dict[str, float]:
    """The thinker's omni_encoder_cache_* samples (`name{modality}` -> value)."""
    process = next(p for name, p in stack.processes.items() if name.startswith("thinker"))
    port = process.args[process.args.index("--metrics-port") + 1]
    return {f"{sample}{dict(labels).get('modality', '')}": value
            for (sample, labels), value in scrape(f"http://127.0.0.1:{port}/metrics").items()
            if sample.startswith("omni_encoder_cache_")}


def test_each_spoken_turn_encodes_only_its_new_clip_and_equals_the_one_shot_request(stack):
    channel, omni = connect(stack.target)
    call = SessionCall(stack.sessions_target)
    call.next_event("created")
    call.send(update=omni_pb2.SessionSettings(turn_detection=MANUAL, thinker_sampling=sampling(TOKENS),
                                              talker_sampling=sampling(FRAMES), return_codec_frames=True))
    call.next_event("updated")
    # Longest clip first: Qwen3-Omni pads a prompt's clips to the longest (services/thinker/encoder_cache.py).
    order = sorted(range(len(SPEECH)), key=lambda i: -len(speech(i)))
    history = []
    for turn, clip in enumerate(order, start=1):
        before = encoder_counters(stack)
        call.speak(speech(clip))
        call.send(commit=omni_pb2.CommitInput())
        call.send(create_response=omni_pb2.CreateResponse())
        created = call.next_event("response_created")
        ids, frames, done = call.response(created.response_id)
        assert done.status == omni_pb2.RESPONSE_STATUS_COMPLETED, f"turn {turn}: {done.error}"
        after = encoder_counters(stack)
        for kind in ("audio", "audio_features"):  # the encoder's outputs, the clips' mel features
            hits = after[f"omni_encoder_cache_hits_total{kind}"] - before.get(f"omni_encoder_cache_hits_total{kind}", 0)
            misses = after[f"omni_encoder_cache_misses_total{kind}"] - before.get(f"omni_encoder_cache_misses_total{kind}", 0)
            assert (hits, misses) == (turn - 1, 1), f"turn {turn}, {kind}"
        history.append(omni_pb2.Message(role=omni_pb2.ROLE_USER, content=[
            omni_pb2.Content(audio=wav_bytes(np.frombuffer(speech(clip), "<i2"), RATE))]))
        assert (ids, frames) == one_shot(omni, history, TOKENS, FRAMES), f"turn {turn}"
        history.append(omni_pb2.Message(role=omni_pb2.ROLE_ASSISTANT, content=[omni_pb2.Content(text=done.transcript)]))
    assert after["omni_encoder_cache_bytes"] > 0 and after["omni_encoder_cache_evictions_total"] == 0
    call.close()
    channel.close()
