"""The thinker's media encoder cache (services/thinker/encoder_cache.py), both families: a voice
conversation that re-sends its audio history every turn (and an image from turn 2) gives the same
bits from the cache as from encoding every item again, turn by turn, and its later turns encode
only their new media and compute only their new clip's features; the bound evicts the least
recently used entry; 0 leaves the model's own call.
"""

from __future__ import annotations

import io
import wave

import numpy as np
import pytest
import torch

from omni.v1 import omni_pb2
from services.base.families import family_of
from services.runtime.inputs.prompt import FEATURES
from services.thinker.encoder_cache import MODALITIES, Encoded, EncoderCache
from services.thinker.engine import ThinkerEngineConfig
from services.thinker.server import ADAPTERS
from tests.thinker.conftest import Family_
from tests.thinker.test_prefix_conversation import assert_same_bits, job, run

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.usefixtures("one_torch_thread")]

TURNS = 4
# Each turn's clip, off any chunk grid; the first the longest: Qwen3-Omni's extractor pads a prompt's
# clips to its longest, so a clip's last mel frames (and its key) change while it is the longest.
SECONDS = (3.1, 1.3, 2.6, 0.8)


def clip(seconds: float, hz: float) -> bytes:
    """A 16 kHz pcm16 wav: a tone under noise (seeded by `hz`), as a spoken turn's audio part."""
    t = np.arange(int(16000 * seconds)) / 16000
    samples = 0.3 * np.sin(2 * np.pi * hz * t) + 0.05 * np.random.default_rng(int(hz)).standard_normal(t.size)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
        w.writeframes(np.rint(samples * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def voice_turn(turn: int, png: bytes) -> omni_pb2.GenerateRequest:
    """Turn `turn` (1-based) of a voice conversation: every user turn a clip (turn 2 also an image),
    the replies between them as text, as the sessions service re-sends its history."""
    request = omni_pb2.GenerateRequest()
    request.messages.add(role=omni_pb2.ROLE_SYSTEM).content.add(text="You are a helpful voice assistant.")
    for t in range(turn):
        user = request.messages.add(role=omni_pb2.ROLE_USER)
        user.content.add(audio=clip(SECONDS[t], 200.0 + 150 * t))
        if t == 1:
            user.content.add(image=png)
        if t < turn - 1:
            request.messages.add(role=omni_pb2.ROLE_ASSISTANT).content.add(text=f"Reply {t + 1}.")
    return request


def engine_of(family: Family_, cache_mb: int, exact_gemm: bool = False):
    config = ThinkerEngineConfig(max_batch_size=2, num_slots=2, max_model_len=1024, exact_gemm=exact_gemm,
                                 encoder_cache_mb=cache_mb)
    return ADAPTERS[family_of(family.checkpoint)].engine(family.thinker.model, family.thinker.config,
                                                         engine_config=config)


def counts(cache: EncoderCache, kinds=MODALITIES) -> tuple[int, int]:
    """(items found, items encoded), over the media encoders (or `kinds`)."""
    return sum(cache.stats.hits[k] for k in kinds), sum(cache.stats.misses[k] for k in kinds)


@pytest.mark.slow
@pytest.mark.exactness
def test_a_later_turn_encodes_only_its_new_media_and_gives_the_bits_of_encoding_again(family, png_bytes):
    on, again = engine_of(family, cache_mb=64), engine_of(family, cache_mb=64)
    again.encoder_cache.capacity_bytes = 0  # encodes every item again, each alone, keeps nothing
    for turn in range(1, TURNS + 1):
        request = voice_turn(turn, png_bytes)
        before, features_before = counts(on.encoder_cache), counts(on.encoder_cache, (FEATURES,))
        cached = run(on, {"r": job(family, request, on.encoder_cache)})["r"]
        cold = run(again, {"r": job(family, request, again.encoder_cache)})["r"]
        assert_same_bits(cached, cold, f"turn {turn}")
        if turn == 1:  # one clip: alone is the model's own call (the cache off, generate's bits)
            assert_same_bits(cached, run(engine_of(family, cache_mb=0), {"r": job(family, request)})["r"], "off")
        items = turn + (turn >= 2)  # its clips, and the image from turn 2 on
        new = 1 + (turn == 2)  # this turn's clip (and the image, in turn 2)
        hits, misses = counts(on.encoder_cache)
        assert (hits - before[0], misses - before[1]) == (items - new, new), f"turn {turn}"
        # The features of the turn's new clip alone (the first clip is the longest: every clip is
        # padded to it from turn 1 on).
        hits, misses = counts(on.encoder_cache, (FEATURES,))
        assert (hits - features_before[0], misses - features_before[1]) == (turn - 1, 1), f"turn {turn}"
    assert on.encoder_cache.stats.hits["image"] == TURNS - 2 and on.encoder_cache.stats.evictions == 0
    assert again.encoder_cache.entries == 0 and counts(again.encoder_cache) == (0, sum(n + (n >= 2) for n in
                                                                                      range(1, TURNS + 1)))
    assert counts(again.encoder_cache, (FEATURES,)) == (0, sum(range(1, TURNS + 1)))


def test_off_leaves_the_models_own_encoder_call(family):
    """`--encoder-cache-mb 0`: no per-item path (the model's one call over a prompt's items,
    generate's bits: services/thinker/encoder_cache.py's NOTE), nothing counted."""
    off = engine_of(family, cache_mb=0)
    assert off.encoder_cache is None and off.encoders is None
    assert "get_audio_features" not in vars(family.thinker.model)


def test_the_bound_evicts_the_least_recently_used_entry():
    entry = Encoded(torch.zeros(4, 8), (torch.zeros(4, 8),))  # 256 bytes
    cache = EncoderCache(3 * entry.nbytes, "test")
    keys = [cache.key("audio", torch.full((2, 3), float(i))) for i in range(4)]
    assert len(set(keys)) == 4 and cache.key("image", torch.zeros(2, 3)) != cache.key("audio", torch.zeros(2, 3))
    for key in keys[:3]:
        assert cache.get("audio", key) is None
        cache.put(key, entry)
    assert cache.get("audio", keys[0]) is entry  # now the most recently used
    cache.put(keys[3], entry)  # over the bound: keys[1] goes
    assert cache.bytes == 3 * entry.nbytes and cache.stats.evictions == 1
    assert cache.get("audio", keys[1]) is None and cache.get("audio", keys[0]) is entry
    assert (cache.stats.hits["audio"], cache.stats.misses["audio"]) == (2, 4)
    cache.put(cache.key("audio", torch.ones(1)), Encoded(torch.zeros(100, 8)))  # larger than the whole cache
    assert cache.entries == 3 and cache.stats.evictions == 1
    off = EncoderCache(0, "test")
    off.put(keys[0], entry)
    assert off.entries == 0 and off.bytes == 0
