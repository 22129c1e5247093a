"""Streaming Token2Wav (Qwen2.5-Omni) equals one `Qwen2_5OmniToken2WavModel.forward` with the same seed.

The model: tiny widths, the 7B's structure (bench/probes/token2wav_reach.py: block 24, look-ahead layer
10, look-back layers 0 and 20 of 22, repeats 2, mel 80, BigVGAN 5,3,2,2,2,2), random weights.
The criterion is an SNR against the whole forward measured on this model (docs/qwen2_5-omni-
token2wav.md, "Tolerance"): TOLERANCE_DB at the default context; a context cut short is far
below it (a lost or misplaced sample is under 10 dB).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.probes.token2wav_reach import (
    build_random_token2wav,
    float64_answer,
    join_figures,
    join_samples,
    random_codes,
    random_voice,
    snr_db,
)
from services.code2wav.engine import Audio, CodecChunk, CodecEnd, Decoded
from services.code2wav.token2wav import (
    NoiseStream,
    Sampling,
    StreamContext,
    Token2WavDecoder,
    Token2WavRunner,
    Token2WavStream,
    Voice,
    decode_full,
)
from services.code2wav.token2wav_engine import Token2WavEngine, Token2WavStart

TOLERANCE_DB = 100.0  # streamed vs whole forward at the default context, float32 (measured: docs)
FLOAT64_MARGIN_DB = 1.0  # streamed vs float64 may be this much below the float32 forward vs float64
N = 96  # tokens: 8 DiT blocks, so the middle windows have their whole default left context
SEED = 11


@pytest.fixture(scope="module")
def model():
    return build_random_token2wav(seed=0)


@pytest.fixture(scope="module")
def runner(model):
    return Token2WavRunner(model)


@pytest.fixture(scope="module")
def voice(model):
    return random_voice(model, seed=2)


@pytest.fixture(scope="module")
def codes():
    return random_codes(N, seed=1)


@pytest.fixture(scope="module")
def full(model, codes, voice):
    return decode_full(model, codes, voice, SEED)


def stream(runner, codes, voice, sizes, context=StreamContext(), seed=SEED) -> tuple[list[np.ndarray], np.ndarray]:
    """Push `codes` in chunks of `sizes` (the last size repeats), then finish -> (pieces, audio)."""
    decoder = Token2WavDecoder(runner, voice, seed, context)
    pieces, start, i = [], 0, 0
    while start < codes.shape[0]:
        size = sizes[min(i, len(sizes) - 1)]
        pieces.append(decoder.push(codes[start:start + size]))
        start, i = start + size, i + 1
    pieces.append(decoder.finish())
    return pieces, np.concatenate(pieces)


def plan(geometry, sizes, n=N, context=StreamContext()):
    """The windows a stream hands out for input chunks `sizes`, fed fake mel: (dit, vocoder) lists."""
    s = Token2WavStream(geometry, context, SEED)
    codes = random_codes(n, seed=1)
    dit, voc, start, i = [], [], 0, 0
    while True:
        if start < n:
            size = sizes[min(i, len(sizes) - 1)]
            s.push(codes[start:start + size])
            start, i = start + size, i + 1
        else:
            s.finish()
        for w in s.dit_windows():
            dit.append((w.start, w.end, w.keep_start, w.keep_end, w.codes.clone(), w.noise.clone()))
            s.accept_mel(w, w.noise)  # any [M, mel_dim] will do for the bookkeeping
        for w in s.vocoder_windows():
            voc.append((w.start, w.end, w.keep_start, w.keep_end))
            s.accept_audio(w, torch.zeros((w.end - w.start) * geometry.samples_per_mel))
        if s.ended:
            assert s.done and s.samples_emitted == n * geometry.samples_per_frame
            return dit, voc


def voices_from_speakers(speakers: dict, mel_dim: int = 80) -> dict[str, Voice]:
    """The checkpoint's speaker dictionary (spk_dict.pt: name -> {"cond", "ref_mel", "bos_token"})
    -> name -> Voice, shaped as Qwen2_5OmniForConditionalGeneration.generate passes them on."""
    return {name: Voice(p["cond"].float().reshape(-1), p["ref_mel"].float().reshape(-1, mel_dim))
            for name, p in speakers.items()}


def test_noise_drawn_token_by_token_equals_the_whole_forward_draw(runner):
    g = runner.geometry
    torch.manual_seed(SEED)
    whole = torch.randn([1, 50 * g.repeats, g.mel_dim])[0]  # what sample() draws for 50 tokens
    noise = NoiseStream(SEED, g)
    pieces = torch.cat([noise.draw(k) for k in (1, 1, 3, 20, 25)])
    assert torch.equal(pieces, whole)


def test_windows_do_not_depend_on_how_the_input_was_chunked(runner):
    g = runner.geometry
    reference = plan(g, [N])
    for sizes in ([1], [4, 8, 16, 25], [7], [30, 1]):
        got = plan(g, sizes)
        assert [w[:4] for w in got[0]] == [w[:4] for w in reference[0]]
        assert all(torch.equal(a[4], b[4]) and torch.equal(a[5], b[5]) for a, b in zip(got[0], reference[0]))
        assert got[1] == reference[1]


def test_default_windows_cover_each_chunk_with_its_context(runner):
    c, g = StreamContext(), runner.geometry
    dit, voc = plan(g, [5])
    for start, end, keep_start, _keep_end, *_ in dit:
        assert start == max(0, keep_start - c.left) and end == min(N, keep_start + c.chunk + c.ahead)
    for start, end, keep_start, keep_end in voc:
        assert start == max(0, keep_start - c.vocoder) and end == min(N * g.repeats, keep_end + c.vocoder)


def test_dit_evaluation_is_the_upstream_forward(runner, voice, codes):
    # The runner's evaluation (speaker encoder hoisted, absolute positions) against
    # Qwen2_5OmniToken2WavDiTModel.forward over a whole sequence: bit for bit.
    dit, r, n = runner.dit, runner.geometry.repeats, 30
    x = torch.randn(1, n * r, runner.geometry.mel_dim, generator=torch.Generator().manual_seed(4))
    t = torch.tensor(0.3)
    inputs = runner._inputs(codes[:n].unsqueeze(0), torch.arange(n * r).unsqueeze(0), [voice])
    with torch.inference_mode():
        ours = runner._evaluate(x, t, inputs)
        theirs = dit(hidden_states=x, quantized_code=codes[:n].unsqueeze(0),
                     speaker_embedding=voice.conditioning.reshape(1, 1, -1).repeat(1, n * r, 1),
                     condition_vector=voice.reference_mel.unsqueeze(0), time_step=t, apply_cfg=True)
    assert torch.equal(ours, theirs)


def test_one_window_over_everything_is_bit_identical_to_the_forward(model, runner, voice, codes):
    everything = StreamContext(left=10**6, ahead=10**6, chunk=10**6, vocoder=10**6)
    _, audio = stream(runner, codes[:30], voice, [4], everything)
    assert np.array_equal(audio, decode_full(model, codes[:30], voice, SEED))


@pytest.fixture(scope="module")
def streamed(runner, voice, codes):
    """The stream of `codes` in the talker's chunk sizes, default context."""
    return stream(runner, codes, voice, [4, 8, 16, 25])[1]


def test_without_guidance_one_window_is_still_the_forward(model, voice, codes):
    # guidance_scale below 1e-5: sample() evaluates the conditioned row alone.
    sampling = Sampling(guidance_scale=0.0)
    everything = StreamContext(left=10**6, ahead=10**6, chunk=10**6, vocoder=10**6)
    _, audio = stream(Token2WavRunner(model, sampling), codes[:12], voice, [12], everything)
    assert np.array_equal(audio, decode_full(model, codes[:12], voice, SEED, sampling))


@pytest.mark.exactness
def test_streamed_audio_equals_one_forward_for_any_chunking(model, runner, voice, codes, full, streamed):
    pieces, one_token = stream(runner, codes, voice, [1])
    assert one_token.dtype == np.float32 and one_token.shape == full.shape == (N * runner.geometry.samples_per_frame,)
    assert snr_db(full, one_token) >= TOLERANCE_DB
    # And as close to the exact (float64) answer as the float32 forward itself is.
    truth = float64_answer(model, codes, voice, SEED)
    assert snr_db(truth, one_token) >= snr_db(truth, full) - FLOAT64_MARGIN_DB
    # The same windows whatever the input chunking (test above): the same bits.
    assert np.array_equal(one_token, streamed)
    # Audio streams before the end: everything but the last chunks and their look-ahead is out
    # before the end flush.
    # Streamed: everything but the last chunk and its look-ahead is out before the end mark.
    context = StreamContext()
    assert sum(p.size for p in pieces[:-1]) >= (N - context.ahead - context.chunk) * runner.geometry.samples_per_frame


def test_the_end_flush_emits_the_rest(model, runner, voice, codes):
    # Shorter than one chunk plus its look-ahead: nothing is final before the end.
    pieces, audio = stream(runner, codes[:9], voice, [1])
    assert all(p.size == 0 for p in pieces[:-1])
    assert snr_db(decode_full(model, codes[:9], voice, SEED), audio) >= TOLERANCE_DB
    _, empty = stream(runner, codes[:0], voice, [1])
    assert empty.size == 0


def test_joins_are_no_worse_than_the_rest(runner, full, streamed):
    # The error within 2.5 ms of every window join (DiT chunks, BigVGAN windows) against the
    # error elsewhere: a seam would be a local error far above the rest, or a click (a jump).
    joins = join_samples(runner.geometry, StreamContext(), N)
    assert joins.size >= 6
    figures = join_figures(full, streamed, joins)
    assert figures["near_joins_snr_db"] >= TOLERANCE_DB
    assert figures["max_jump_at_joins"] <= 10 * figures["p99_jump"] + 1e-7


@pytest.mark.slow  # ~10 s of Token2Wav windows on 2 cores: make test-slow (CI)
def test_windows_off_the_block_grid_keep_absolute_blocks(runner, voice, codes, full):
    # Windows that start and end mid-block (left 54, ahead 30, chunk 18: not multiples of a
    # block's 12 tokens) must partition attention blocks as the whole sequence does, not from
    # their own start (which gives ~30 dB).
    _, audio = stream(runner, codes, voice, [25], StreamContext(left=54, ahead=30, chunk=18))
    assert snr_db(full, audio) >= TOLERANCE_DB


@pytest.mark.slow  # ~15 s for the three contexts: make test-slow (CI)
@pytest.mark.parametrize("context", [StreamContext(left=0), StreamContext(ahead=0), StreamContext(vocoder=4)])
def test_context_cut_short_is_far_below_the_tolerance(runner, voice, codes, full, context):
    _, audio = stream(runner, codes, voice, [25], context)
    assert audio.shape == full.shape
    assert snr_db(full, audio) < TOLERANCE_DB - 20


def run_engine(engine, arrivals):
    """arrivals: [(request_id, CodecChunk | CodecEnd)] fed one per step -> request_id -> (audio, Decoded)."""
    audio, done, queue = {}, {}, list(arrivals)
    while queue or engine.has_work():
        if queue:
            request_id, item = queue.pop(0)
            engine.add_input(request_id, item)
        for request_id, event in engine.step():
            if isinstance(event, Audio):
                assert event.first_sample == sum(a.size for a in audio.get(request_id, []))
                audio.setdefault(request_id, []).append(event.samples)
            else:
                assert isinstance(event, Decoded)
                done[request_id] = event
    return {r: (np.concatenate(audio.get(r, [np.zeros(0, np.float32)])), done[r]) for r in done}


@pytest.mark.slow  # ~12 s: make test-slow (CI); exact mode's any-load bits stay in make test
def test_concurrent_requests_each_equal_their_own_forward(model, voice, codes, full):
    other_voice = random_voice(model, seed=3)
    engine = Token2WavEngine(model, {"a": voice, "b": other_voice}, default_voice="a", seed=SEED)
    lengths = {"r1": N, "r2": 61, "r3": 14}
    engine.add("r1", None)
    engine.add("r2", Token2WavStart(voice="b", seed=5))
    engine.add("r3", Token2WavStart(seed=6))
    sources = {"r1": codes, "r2": random_codes(61, seed=8), "r3": random_codes(14, seed=9)}
    arrivals, offsets = [], dict.fromkeys(lengths, 0)
    sizes = {"r1": 25, "r2": 1, "r3": 4}
    while any(offsets[r] < lengths[r] for r in lengths):  # interleaved, each with its own chunk size
        for r in lengths:
            if offsets[r] < lengths[r]:
                chunk = sources[r][offsets[r]:offsets[r] + sizes[r]].reshape(-1, 1)
                arrivals.append((r, CodecChunk(chunk)))
                offsets[r] += chunk.shape[0]
                if offsets[r] >= lengths[r]:
                    arrivals.append((r, CodecEnd()))
    out = run_engine(engine, arrivals)
    expected = {"r1": full, "r2": decode_full(model, sources["r2"], other_voice, 5),
                "r3": decode_full(model, sources["r3"], voice, 6)}
    for r, (audio, decoded) in out.items():
        assert decoded.frames == lengths[r] and decoded.samples == audio.size == expected[r].size
        assert snr_db(expected[r], audio) >= TOLERANCE_DB, r
    assert engine.running == 0


@pytest.mark.slow  # 17 s of Token2Wav (Qwen2.5-Omni) windows; test-portable runs it too: make test-slow (CI)
@pytest.mark.exactness
def test_exact_mode_gives_each_request_the_bits_it_gets_alone_whatever_else_decodes(model, voice, codes):
    """What a migrated request's replay needs: the same audio, bit for bit, whatever was ready beside
    it and in whatever chunks its codes came."""
    n = 40
    others = {"r2": random_codes(n, seed=8), "r3": random_codes(n, seed=9)}

    def alone(chunk: int):
        engine = Token2WavEngine(model, {"a": voice}, seed=SEED, exact=True)
        engine.add("r1", None)
        arrivals = [("r1", CodecChunk(codes[i:min(i + chunk, n)].reshape(-1, 1))) for i in range(0, n, chunk)]
        return run_engine(engine, arrivals + [("r1", CodecEnd())])["r1"][0]

    engine = Token2WavEngine(model, {"a": voice}, seed=SEED, exact=True)
    for r in ("r1", *others):
        engine.add(r, None)
    arrivals = []
    for i in range(0, n, 8):  # every request's windows become ready at the same steps: same lengths
        arrivals += [("r1", CodecChunk(codes[i:i + 8].reshape(-1, 1)))]
        arrivals += [(r, CodecChunk(c[i:i + 8].reshape(-1, 1))) for r, c in others.items()]
    together = run_engine(engine, arrivals + [(r, CodecEnd()) for r in ("r1", *others)])["r1"][0]
    assert engine.max_batch == 1
    for chunk in (8, 24):
        assert np.array_equal(alone(chunk), together), chunk


def test_engine_checks_its_inputs(model, voice):
    engine = Token2WavEngine(model, {"a": voice})
    with pytest.raises(ValueError):
        engine.add("x", Token2WavStart(voice="nobody"))
    engine.add("r", None)
    with pytest.raises(ValueError):
        engine.add_input("r", CodecChunk(torch.zeros((3, 16), dtype=torch.long)))
    with pytest.raises(ValueError):
        engine.add_input("r", CodecChunk(torch.full((3, 1), engine.geometry.num_embeds)))
    with pytest.raises(ValueError):  # past max_position_embeddings: the forward refuses it too
        engine.add_input("r", CodecChunk(torch.zeros((engine.geometry.max_mel_frames, 1), dtype=torch.long)))
    assert engine.geometry.samples_per_frame == 480 and engine.geometry.sample_rate == 24000


def test_empty_stream_and_abort(model, voice):
    engine = Token2WavEngine(model, {"a": voice})
    engine.add("empty", None)
    engine.add("gone", None)
    engine.add_input("gone", CodecChunk(torch.zeros((5, 1), dtype=torch.long)))
    engine.abort("gone")
    engine.add_input("empty", CodecEnd())
    assert engine.step() == [("empty", Decoded(0, 0))]
    assert engine.running == 0 and not engine.has_work()


def test_context_flag_values():
    assert StreamContext.parse("48:24") == StreamContext(left=48, ahead=24)
    assert StreamContext.parse("36:12:12:28") == StreamContext(36, 12, 12, 28)
    for bad in ("48", "a:b", "1:2:3:4:5", "48:-1", "1:2:0"):
        with pytest.raises(ValueError):
            StreamContext.parse(bad)


def test_voices_from_the_speaker_dictionary():
    speakers = {"Chelsie": {"cond": torch.zeros(1, 192), "ref_mel": torch.zeros(1, 300, 80), "bos_token": 151870}}
    (voice,) = voices_from_speakers(speakers).values()
    assert voice.conditioning.shape == (192,) and voice.reference_mel.shape == (300, 80)
