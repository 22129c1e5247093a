"""Figures: docs/qwen2_5-omni-token2wav.md (how far Token2Wav reaches, what streaming costs). Rerun:

    python -m bench.probes.token2wav_reach reach               # per-evaluation, ODE and BigVGAN reach (tiny)
    python -m bench.probes.token2wav_reach table --tokens 240  # an interior chunk vs the whole decode, per context
    python -m bench.probes.token2wav_reach stream --tokens 240 # a whole stream vs the whole decode
    python -m bench.probes.token2wav_reach noise               # the noise prefix facts
    python -m bench.probes.token2wav_reach reach --layout real # the real widths (minutes on 2 cores)

Models are random-weight `Qwen2_5OmniToken2WavModel`s from `Qwen2_5OmniToken2WavConfig` with
the real structure (transformers' defaults are the 7B's: block_size 24, look-ahead layer 10,
look-back layers 0 and 20 of 22, repeats 2, mel_dim 80, BigVGAN rates 5,3,2,2,2,2); "tiny" shrinks
the widths only.

NOTE: weights. Matrices normal(0, 1/sqrt(fan_in)) as services/runtime/full_size.init_random_;
then the DiT's output bias is set to -5 so the mel lands in a log-mel range (BigVGAN clamps its
normalised input to [-1, 1]: a mel far outside would saturate and hide every dependence), and
BigVGAN's last convolution is scaled to an rms of 0.1, so the clamp to [-1, 1] rarely bites.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time

import numpy as np
import torch

from services.code2wav.token2wav import (
    DitWindow,
    NoiseStream,
    StreamContext,
    Token2WavDecoder,
    Token2WavRunner,
    Token2WavStream,
    VocoderWindow,
    Voice,
    decode_full,
)
from services.runtime.model.full_size import init_random_

# Widths only: every structural field keeps transformers' default (the 7B's).
TINY_LAYOUT = {
    "dit_config": dict(hidden_size=32, num_attention_heads=2, head_dim=16, emb_dim=16, enc_emb_dim=16, enc_dim=16,
                       enc_channels=[16, 16, 16, 16, 48], enc_attention_channels=8, enc_se_channels=8),
    "bigvgan_config": dict(upsample_initial_channel=64),
}
REAL_LAYOUT: dict = {"dit_config": {}, "bigvgan_config": {}}  # the defaults: dim 1024, 22 layers, 1536 channels
LAYOUTS = {"tiny": TINY_LAYOUT, "real": REAL_LAYOUT}
MEL_BIAS = -5.0
AUDIO_RMS = 0.1


def token2wav_config(layout: dict):
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniToken2WavConfig

    config = Qwen2_5OmniToken2WavConfig(dit_config=dict(layout["dit_config"]),
                                        bigvgan_config=dict(layout["bigvgan_config"]))
    config._attn_implementation = "sdpa"
    return config


def build_random_token2wav(layout: dict = TINY_LAYOUT, seed: int = 0):
    """A `Qwen2_5OmniToken2WavModel` with seeded random weights, in eval mode (module docstring)."""
    from transformers.initialization import no_init_weights
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavModel

    with no_init_weights():
        model = Qwen2_5OmniToken2WavModel._from_config(token2wav_config(layout), dtype=torch.float32)
    model.eval()
    init_random_(model, seed, None, torch.device("cpu"))  # no stage fix-ups: its own below
    with torch.no_grad():
        model.code2wav_dit_model.proj_out.bias.fill_(MEL_BIAS)
        _scale_audio(model, seed)
    return model


def _scale_audio(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    mel = MEL_BIAS + 2 * torch.randn(1, model.config.bigvgan_config.mel_dim, 48, generator=gen)
    captured = []  # conv_post's output, before the clamp
    hook = model.code2wav_bigvgan_model.conv_post.register_forward_hook(lambda mod, inp, out: captured.append(out))
    with torch.inference_mode():
        model.code2wav_bigvgan_model(mel)
    hook.remove()
    rms = captured[0].pow(2).mean().sqrt().item()
    model.code2wav_bigvgan_model.conv_post.weight.mul_(AUDIO_RMS / max(rms, 1e-12))


def random_voice(model, seed: int = 2) -> Voice:
    dit = model.config.dit_config
    gen = torch.Generator().manual_seed(seed)
    return Voice(torch.randn(dit.enc_emb_dim, generator=gen),
                 MEL_BIAS + 2 * torch.randn(300, dit.mel_dim, generator=gen))


def random_codes(n: int, seed: int = 1, vocab: int = 8192) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def snr_db(reference: np.ndarray, test: np.ndarray) -> float:
    reference = np.asarray(reference, dtype=np.float64)
    error = np.sum((reference - np.asarray(test, dtype=np.float64)) ** 2)
    return math.inf if error == 0 else 10 * math.log10(np.sum(reference ** 2) / error)


def stream(runner: Token2WavRunner, codes: torch.Tensor, voice: Voice, seed: int, context: StreamContext,
           sizes: list[int]) -> tuple[np.ndarray, int]:
    """Push codes in chunks of `sizes` (repeated), then finish -> (audio, tokens received at the first audio)."""
    decoder = Token2WavDecoder(runner, voice, seed, context)
    pieces, start, first, i = [], 0, None, 0
    while start < codes.shape[0]:
        size = sizes[min(i, len(sizes) - 1)]
        pieces.append(decoder.push(codes[start:start + size]))
        start += size
        i += 1
        if first is None and pieces[-1].size:
            first = min(start, codes.shape[0])
    pieces.append(decoder.finish())
    return np.concatenate(pieces), first if first is not None else codes.shape[0]


# Reach.

def changed_extent(delta: np.ndarray) -> tuple[int, int] | None:
    """[first, last] index where delta != 0 (bitwise: outside a dependence nothing is recomputed)."""
    idx = np.flatnonzero(delta)
    return (int(idx[0]), int(idx[-1])) if idx.size else None


def evaluation_reach(runner: Token2WavRunner, voice: Voice, n_tokens: int, token: int) -> dict:
    """One DiT evaluation: perturb code `token`, see which mel frames change."""
    r = runner.geometry.repeats
    codes = random_codes(n_tokens)
    noise = NoiseStream(0, runner.geometry).draw(n_tokens)
    outs = []
    for c in (codes, torch.cat([codes[:token], (codes[token:token + 1] + 1) % 8192, codes[token + 1:]])):
        window = DitWindow(0, n_tokens, 0, n_tokens, c, noise)
        inputs = runner._inputs(c.unsqueeze(0), torch.arange(n_tokens * r).unsqueeze(0), [voice])
        with torch.inference_mode():
            outs.append(runner._evaluate(window.noise.unsqueeze(0), torch.tensor(0.5), inputs)[0].numpy())
    delta = np.abs(outs[1] - outs[0]).max(axis=-1)  # [M] per mel frame
    first, last = changed_extent(delta)
    return {"token": token, "mel_frames": [first, last], "tokens": [first // r, last // r],
            "back_tokens": token - first // r, "ahead_tokens": last // r - token}


def ode_reach(runner: Token2WavRunner, voice: Voice, n_tokens: int, token: int, seed: int = 0) -> dict:
    """The whole ODE (36 evaluations): perturb code `token`; the change of the final mel per
    block of distance, in dB against the mel's rms."""
    r, bs = runner.geometry.repeats, runner.geometry.block_size
    codes = random_codes(n_tokens)
    noise = NoiseStream(seed, runner.geometry).draw(n_tokens)
    mels = []
    for c in (codes, torch.cat([codes[:token], (codes[token:token + 1] + 1) % 8192, codes[token + 1:]])):
        mels.append(runner.sample_mel([DitWindow(0, n_tokens, 0, n_tokens, c, noise)], [voice])[0].numpy())
    rms = float(np.sqrt(np.mean(mels[0].astype(np.float64) ** 2)))
    delta = np.abs(mels[1] - mels[0]).max(axis=-1)
    home = token * r // bs
    profile = {}
    for b in range(math.ceil(n_tokens * r / bs)):
        peak = float(delta[b * bs:(b + 1) * bs].max())
        profile[b - home] = -math.inf if peak == 0 else 20 * math.log10(peak / rms)
    return {"token": token, "changed_mel_frames": changed_extent(delta), "of": n_tokens * r,
            "db_by_block_distance": profile}


def bigvgan_reach(runner: Token2WavRunner, n_frames: int = 200, frame: int = 100) -> dict:
    """Perturb one mel frame: which samples change (BigVGAN's receptive field)."""
    u = runner.geometry.samples_per_mel
    mel = MEL_BIAS + 2 * torch.randn(n_frames, runner.geometry.mel_dim, generator=torch.Generator().manual_seed(5))
    bumped = mel.clone()
    bumped[frame] += 0.5
    wavs = [runner.vocode([VocoderWindow(0, n_frames, 0, n_frames, m)])[0].numpy() for m in (mel, bumped)]
    first, last = changed_extent(np.abs(wavs[1] - wavs[0]))
    return {"samples": [first, last], "back_mel_frames": frame - first / u, "ahead_mel_frames": (last + 1) / u - frame - 1}


def bigvgan_reach_analytic(config) -> float:
    """BigVGAN's receptive field in mel frames (each side) from its layer sizes: conv_pre's 3
    frames, then at every level the widest residual block (kernel k, dilations d) adds
    sum over d of (k-1)*d/2 + (k-1)/2 + 2 activations, each ~2.5 samples at that level's rate
    (12-tap 2x up-sampling then 12-tap down-sampling), plus each transposed conv's half kernel."""
    c = config.bigvgan_config
    activation = 2.5
    reach, rate = 3.0, 1
    for stride, kernel in zip(c.upsample_rates, c.upsample_kernel_sizes):
        reach += (kernel - stride) / 2 / stride / rate  # the transposed conv's overlap, in input frames
        rate *= stride
        reach += max(sum((k - 1) * d / 2 + (k - 1) / 2 + 2 * activation for d in dil)
                     for k, dil in zip(c.resblock_kernel_sizes, c.resblock_dilation_sizes)) / rate
    return reach + (activation + 3) / rate  # activation_post, conv_post (kernel 7)


# Streaming trade-off.

EVERYTHING = StreamContext(left=10**6, ahead=10**6, chunk=10**6, vocoder=10**6)  # one window: the forward


def float64_answer(model, codes: torch.Tensor, voice: Voice, seed: int) -> np.ndarray:
    """The forward's function in float64 (one window over everything, the same float32 noise):
    what float32 rounding is measured against."""
    twin = Token2WavRunner(copy.deepcopy(model).double())
    decoder = Token2WavDecoder(twin, voice, seed, EVERYTHING)
    decoder.stream.push(codes)
    decoder.stream.finish()
    for window in decoder.stream.dit_windows():
        decoder.stream.accept_mel(window, twin.sample_mel([window], [voice])[0])
    (window,) = decoder.stream.vocoder_windows()
    return twin.vocode([window])[0].numpy()


def plan_figures(geometry, context: StreamContext, n_tokens: int = 1200) -> dict:
    """Without the model: tokens received when the first audio comes out, and the DiT's work per
    token of a long stream (sum of window lengths / tokens; 1 = the whole forward's)."""
    s = Token2WavStream(geometry, context, 0)
    first, work = None, 0
    for _ in range(n_tokens):
        s.push(torch.zeros(1, dtype=torch.long))
        for w in s.dit_windows():
            work += w.end - w.start
            s.accept_mel(w, w.noise)
        for w in s.vocoder_windows():
            s.accept_audio(w, torch.zeros((w.end - w.start) * geometry.samples_per_mel))
            first = s.received if first is None else first
    return {"first_audio_tokens": first, "first_audio_s": first * geometry.samples_per_frame / geometry.sample_rate,
            "dit_work": round(work / n_tokens, 2)}


def whole_mel(runner: Token2WavRunner, codes: torch.Tensor, voice: Voice, seed: int) -> torch.Tensor:
    """The whole forward's mel (one window over everything: bit-identical to `sample`'s): [N*r, mel_dim]."""
    n = codes.shape[0]
    return runner.sample_mel([DitWindow(0, n, 0, n, codes, NoiseStream(seed, runner.geometry).draw(n))], [voice])[0]


def chunk_error(runner: Token2WavRunner, voice: Voice, codes: torch.Tensor, seed: int, mel: torch.Tensor,
                wav: np.ndarray, context: StreamContext) -> dict:
    """One interior grid chunk decoded from its window (the stream's computation for it) against the
    whole forward: SNR of its mel, and of the audio with that chunk's mel put in the whole mel
    (over the chunk's samples plus BigVGAN's spill). Interior chunks set a long stream's SNR."""
    g, n, c = runner.geometry, codes.shape[0], context
    r, u = g.repeats, g.samples_per_mel
    s = (n // 2) // c.chunk * c.chunk
    a, b = max(0, s - c.left), min(n, s + c.chunk + c.ahead)
    noise = NoiseStream(seed, g).draw(n)
    window = DitWindow(a, b, s, s + c.chunk, codes[a:b], noise[a * r:b * r])
    kept = runner.sample_mel([window], [voice])[0][(s - a) * r:(s + c.chunk - a) * r]
    patched = mel.clone()
    patched[s * r:(s + c.chunk) * r] = kept
    audio = runner.vocode([VocoderWindow(0, n * r, 0, n * r, patched)])[0].numpy()
    lo, hi = max(0, (s * r - 32) * u), min(wav.size, ((s + c.chunk) * r + 32) * u)
    return {"mel_snr_db": round(snr_db(mel[s * r:(s + c.chunk) * r].numpy(), kept.numpy()), 1),
            "audio_snr_db": round(snr_db(wav[lo:hi], audio[lo:hi]), 1)}


def vocoder_error(runner: Token2WavRunner, mel: torch.Tensor, wav: np.ndarray, context: StreamContext) -> float:
    """BigVGAN in the stream's windows (grid, `vocoder` frames each side) over the whole mel vs one pass."""
    s = Token2WavStream(runner.geometry, context, 0)
    n = mel.shape[0] // runner.geometry.repeats
    s.push(torch.zeros(n, dtype=torch.long))
    s.finish()
    for w in s.dit_windows():
        s.accept_mel(w, mel[w.start * runner.geometry.repeats:w.end * runner.geometry.repeats])
    audio = np.concatenate([s.accept_audio(w, runner.vocode([w])[0]) for w in s.vocoder_windows()])
    return round(snr_db(wav, audio), 1)


def context_table(runner: Token2WavRunner, voice: Voice, n_tokens: int, contexts: list[StreamContext],
                  vocoder_contexts: list[int], seed: int = 0, float64: bool = True) -> None:
    codes = random_codes(n_tokens)
    mel = whole_mel(runner, codes, voice, seed)
    wav = runner.vocode([VocoderWindow(0, mel.shape[0], 0, mel.shape[0], mel)])[0].numpy()
    if float64:
        print(json.dumps({"float32_forward_vs_float64_db": round(snr_db(float64_answer(runner.model, codes, voice, seed),
                                                                        wav), 1)}), flush=True)
    for v in vocoder_contexts:
        print(json.dumps({"vocoder": v, "audio_snr_db": vocoder_error(runner, mel, wav, StreamContext(vocoder=v))}),
              flush=True)
    for ctx in contexts:
        started = time.perf_counter()
        row = {"left": ctx.left, "ahead": ctx.ahead, "chunk": ctx.chunk, "vocoder": ctx.vocoder,
               **chunk_error(runner, voice, codes, seed, mel, wav, ctx), **plan_figures(runner.geometry, ctx),
               "seconds": round(time.perf_counter() - started, 1)}
        print(json.dumps(row), flush=True)


def join_samples(geometry, context: StreamContext, n_tokens: int) -> np.ndarray:
    """Sample indices where one window's output meets the next's: DiT chunk ends and BigVGAN window ends."""
    dit = np.arange(context.chunk, n_tokens, context.chunk) * geometry.samples_per_frame
    step = context.chunk * geometry.repeats
    voc = (np.arange(step, n_tokens * geometry.repeats, step) - context.vocoder) * geometry.samples_per_mel
    return np.unique(np.concatenate([dit, voc[voc > 0]]))


def join_figures(full: np.ndarray, audio: np.ndarray, joins: np.ndarray, half_width: int = 60) -> dict:
    """The error near joins (within `half_width` samples, 2.5 ms) against the error elsewhere: SNR
    of each part, and the largest jump of the error from one sample to the next at a join against
    the 99th percentile of those jumps everywhere (a click would be a jump far above it)."""
    near = np.zeros(full.size, dtype=bool)
    for j in joins:
        near[max(0, j - half_width):j + half_width] = True
    error = audio.astype(np.float64) - full.astype(np.float64)
    jumps = np.abs(np.diff(error))
    return {"near_joins_snr_db": round(snr_db(full[near], audio[near]), 1),
            "elsewhere_snr_db": round(snr_db(full[~near], audio[~near]), 1),
            "max_jump_at_joins": float(jumps[joins - 1].max()) if joins.size else 0.0,
            "p99_jump": float(np.percentile(jumps, 99)), "signal_rms": float(np.sqrt(np.mean(full.astype(np.float64) ** 2)))}


def stream_check(runner: Token2WavRunner, voice: Voice, n_tokens: int, context: StreamContext, sizes: list[int],
                 seed: int = 0, float64: bool = True) -> dict:
    """A whole stream against the whole forward (and the forward's float64 answer), and its joins."""
    codes = random_codes(n_tokens)
    full = decode_full(runner.model, codes, voice, seed, runner.sampling)
    audio, first = stream(runner, codes, voice, seed, context, sizes)
    out = {"tokens": n_tokens, "context": [context.left, context.ahead, context.chunk, context.vocoder],
           "snr_db": round(snr_db(full, audio), 1), "first_audio_tokens": first,
           **join_figures(full, audio, join_samples(runner.geometry, context, n_tokens))}
    if float64:
        truth = float64_answer(runner.model, codes, voice, seed)
        out |= {"float32_forward_vs_float64_db": round(snr_db(truth, full), 1),
                "stream_vs_float64_db": round(snr_db(truth, audio), 1)}
    return out


def noise_facts(n_tokens: int = 500) -> dict:
    per_token = 2 * 80
    gen = lambda: torch.Generator().manual_seed(7)  # noqa: E731
    whole = torch.randn(n_tokens * per_token, generator=gen())
    g = gen()
    pieces = torch.cat([torch.randn(per_token, generator=g) for _ in range(n_tokens)])
    torch.manual_seed(7)
    global_draw = torch.randn([1, n_tokens * 2, 80]).reshape(-1)
    odd = {s: bool(torch.equal(torch.randn(s, generator=gen()), whole[:s])) for s in (8, 15, 17, 24, 40, 100)}
    return {"token_by_token_equals_whole": bool(torch.equal(pieces, whole)),
            "prefixes_equal": all(torch.equal(torch.randn(n * per_token, generator=gen()), whole[:n * per_token])
                                  for n in (1, 2, 3, 13, 100, n_tokens - 1)),
            "global_generator_equals_seeded_generator": bool(torch.equal(global_draw, whole)),
            "other_sizes_prefix": odd, "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["reach", "table", "stream", "noise"])
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="tiny")
    p.add_argument("--tokens", type=int, default=240)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sizes", type=int, nargs="+", default=[4, 8, 16, 25])
    p.add_argument("--contexts", nargs="+", default=None, help="left:ahead:chunk:vocoder, tokens (vocoder: mel frames)")
    p.add_argument("--vocoder", type=int, nargs="*", default=[8, 16, 24, 26, 28, 30, 32])
    p.add_argument("--no-float64", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.what == "noise":
        print(json.dumps(noise_facts(), indent=1))
        return 0
    model = build_random_token2wav(LAYOUTS[args.layout])
    runner = Token2WavRunner(model)
    voice = random_voice(model)
    if args.what == "reach":
        mid = args.tokens // 2
        print(json.dumps({"evaluation": [evaluation_reach(runner, voice, args.tokens, t) for t in (mid, mid + 5, mid + 11)]}))
        print(json.dumps({"bigvgan": bigvgan_reach(runner), "bigvgan_analytic": bigvgan_reach_analytic(model.config)}))
        print(json.dumps({"ode": ode_reach(runner, voice, args.tokens, mid)}))
    elif args.what == "stream":
        ctx = StreamContext(*(int(x) for x in args.contexts[0].split(":"))) if args.contexts else StreamContext()
        print(json.dumps(stream_check(runner, voice, args.tokens, ctx, args.sizes, float64=not args.no_float64)))
    else:
        specs = args.contexts or ["96:96:12:32", "48:24:12:32"]
        contexts = [StreamContext(*(int(x) for x in s.split(":"))) for s in specs]
        context_table(runner, voice, args.tokens, contexts, args.vocoder, float64=not args.no_float64)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
