"""Streaming Token2Wav, Qwen2.5-Omni's code2wav: codec tokens arriving in chunks -> one PCM stream.

`Qwen2_5OmniToken2WavModel.forward(code [1, N], conditioning, reference_mel)` draws the ODE's
start `torch.randn([1, N*r, mel_dim])` once, integrates a DiT flow-matching ODE over all N*r mel
frames (RK4 over `num_steps` time points: 4 DiT evaluations an interval, 36 at the defaults, each
a classifier-free-guidance batch of 2), then BigVGAN turns the mel into N*r*240 samples.

NOTE: algorithm (docs/qwen2_5-omni-token2wav.md has the measurements behind every number).
The DiT attends block-locally: one evaluation's output in block b (`block_size` mel frames)
depends on blocks b-2 .. b+1 only, so the final mel depends on 72 blocks back and 36 ahead (17 s
and 8.6 s): for any real utterance, everything. The dependence decays fast with distance, so a
window of context recovers the whole-sequence answer to a measured SNR:

  - DiT: the token axis is cut into a fixed grid of `chunk` tokens. Chunk [s, s + chunk) is
    decoded once `ahead` tokens after it have arrived (or the stream ended), by one ODE over the
    window [s - left, s + chunk + ahead) clipped to [0, received): the window's own slice of the
    noise, absolute rotary positions and absolute block indices (so every rounding that depends
    on position is the whole forward's), the chunk's mel kept. Windows depend on tokens and
    noise only, never on earlier windows, so all windows ready at a step decode as one batch.
  - BigVGAN (a finite receptive field, 29 mel frames each side): audio is emitted for mel
    frames with `vocoder` frames of final mel (or the stream's true edge) on both sides.
  - Noise: the CPU generator's normal draws of any multiple of 16 values are a prefix of a longer
    draw from the same state, and a token's noise is repeats*mel_dim = 160 values, so drawing
    each token's noise as it arrives reproduces the whole-sequence draw without knowing N.

The grid makes the audio a function of the token sequence alone, not of how the talker cut it,
so a migrated request's replay decodes the same windows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from services.base.stages import SPEECH_SAMPLE_RATE

EMPTY = np.zeros(0, dtype=np.float32)
# The CPU generator's normal kernel fills 16 values at a time and redraws the last 16 of a draw
# whose size is not a multiple of 16: only multiples of 16 concatenate into the longer draw.
NOISE_GRAIN = 16
VOICE_CACHE = 16  # speaker-encoder outputs kept (a checkpoint has a handful of voices)


@dataclass(frozen=True)
class Token2WavGeometry:
    repeats: int  # mel frames per codec token (2)
    block_size: int  # DiT attention block, in mel frames (24)
    mel_dim: int  # 80
    samples_per_mel: int  # BigVGAN upsampling, the product of upsample_rates (240)
    max_mel_frames: int  # the DiT's max_position_embeddings (32768)
    num_embeds: int  # codec embedding rows: valid ids are [0, num_embeds)
    sample_rate: int = SPEECH_SAMPLE_RATE  # BigVGAN's output rate

    @property
    def samples_per_frame(self) -> int:
        """Samples per codec token (480): a frame of this family is one token."""
        return self.repeats * self.samples_per_mel


def geometry_of(model) -> Token2WavGeometry:
    """The stream's sizes from a `Qwen2_5OmniToken2WavModel`'s config."""
    dit, bigvgan = model.config.dit_config, model.config.bigvgan_config
    return Token2WavGeometry(
        repeats=int(dit.repeats), block_size=int(dit.block_size), mel_dim=int(dit.mel_dim),
        samples_per_mel=math.prod(int(u) for u in bigvgan.upsample_rates),
        max_mel_frames=int(dit.max_position_embeddings),
        num_embeds=int(model.code2wav_dit_model.text_embed.codec_embed.num_embeddings),
    )


@dataclass(frozen=True)
class StreamContext:
    """How much context each window decodes with, in codec tokens (mel frames for the vocoder).

    The DiT's reach is counted in whole attention blocks (12 tokens): a window edge inside a
    block loses up to one block of context, so `left`, `ahead` and `chunk` are best multiples of
    12 (docs/qwen2_5-omni-token2wav.md, the context table)."""

    # Measured on the tiny checkpoint (`omni-tiny-checkpoint --family qwen2_5_omni`, whose DiT has
    # the 7B's look-back/look-ahead pattern: layers 0 and 3 look back, layer 2 ahead): 48:24 gives
    # 68.6 dB against one whole forward, 48:48 81.2 dB, 96:24 68.8 dB, 96:48 109.1 dB. The reach
    # depends on the weights, so measure a real checkpoint (bench/probes/token2wav_reach.py) and set
    # --token2wav-context; these defaults keep the tiny checkpoint above 100 dB.
    left: int = 96  # tokens of DiT context before each chunk (8 blocks)
    ahead: int = 48  # tokens the DiT waits for after each chunk (4 blocks: the look-ahead latency)
    chunk: int = 24  # tokens of mel made final per DiT window: the grid
    vocoder: int = 32  # mel frames of BigVGAN context each side of the frames it emits (reach: 29)

    def __post_init__(self):
        if self.chunk < 1 or self.left < 0 or self.ahead < 0 or self.vocoder < 0:
            raise ValueError(f"invalid token2wav context {self}")

    @classmethod
    def parse(cls, text: str) -> StreamContext:
        """`LEFT:AHEAD[:CHUNK[:VOCODER]]` (a `--token2wav-context` flag's value); omitted fields keep the defaults."""
        parts = text.split(":")
        if not 2 <= len(parts) <= 4 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"token2wav context must be LEFT:AHEAD[:CHUNK[:VOCODER]] (integers), got {text!r}")
        names = ("left", "ahead", "chunk", "vocoder")
        return cls(**{name: int(p) for name, p in zip(names, parts)})


@dataclass(frozen=True)
class Sampling:
    """Token2Wav's ODE settings (the forward's keyword arguments, at their defaults)."""

    num_steps: int = 10
    guidance_scale: float = 0.5
    sway_coefficient: float | None = -1.0


@dataclass(frozen=True)
class Voice:
    """A speaker's conditioning, as in the checkpoint's speaker dictionary."""

    conditioning: torch.Tensor  # [enc_emb_dim] float32 ("cond")
    reference_mel: torch.Tensor  # [T, mel_dim] float32 ("ref_mel")


def voices_of(checkpoint_voices: dict, mel_dim: int) -> dict[str, Voice]:
    """`services.runtime.model.checkpoint.load_voices`'s voices (name -> Voice with cond [1, E] and
    ref_mel [1, T, mel]) -> name -> this module's Voice, the conditioning Token2Wav takes."""
    return {name: Voice(v.cond.float().reshape(-1), v.ref_mel.float().reshape(-1, mel_dim))
            for name, v in checkpoint_voices.items()}


class NoiseStream:
    """One request's ODE start, drawn token by token: equal to the whole forward's draw
    `torch.randn([1, N*r, mel_dim])` after `torch.manual_seed(seed)`, for any N (CPU generator)."""

    def __init__(self, seed: int, geometry: Token2WavGeometry):
        self.per_token = geometry.repeats * geometry.mel_dim
        if self.per_token % NOISE_GRAIN:
            raise ValueError(f"{self.per_token} noise values a token are not a multiple of {NOISE_GRAIN}: "
                             "token-by-token draws would not reproduce the whole draw")
        self.geometry = geometry
        self.generator = torch.Generator(device="cpu").manual_seed(seed)

    def draw(self, tokens: int) -> torch.Tensor:
        """The next `tokens` tokens' noise: [tokens*r, mel_dim] float32."""
        noise = torch.randn(tokens * self.per_token, generator=self.generator, dtype=torch.float32)
        return noise.view(tokens * self.geometry.repeats, self.geometry.mel_dim)


@dataclass(frozen=True)
class DitWindow:
    """One ODE over tokens [start, end) whose mel for tokens [keep_start, keep_end) becomes final."""

    start: int
    end: int
    keep_start: int
    keep_end: int
    codes: torch.Tensor  # [end - start] int64
    noise: torch.Tensor  # [(end - start)*r, mel_dim] float32


@dataclass(frozen=True)
class VocoderWindow:
    """BigVGAN over mel frames [start, end) whose samples for frames [keep_start, keep_end) are emitted."""

    start: int
    end: int
    keep_start: int
    keep_end: int
    mel: torch.Tensor  # [end - start, mel_dim] float32


class Token2WavStream:
    """One request's bookkeeping: tokens and noise in, windows to decode out. No model calls
    (the engine batches the windows of all requests): plan with `dit_windows` / `vocoder_windows`,
    hand the outputs back with `accept_mel` / `accept_audio` in the same order."""

    def __init__(self, geometry: Token2WavGeometry, context: StreamContext, seed: int):
        self.geometry = geometry
        self.context = context
        self.noise = NoiseStream(seed, geometry)
        self.received = 0  # tokens pushed
        self.ended = False
        self._token_base = 0  # global index of _codes[0]
        self._codes = torch.zeros(0, dtype=torch.long)  # [received - _token_base]
        self._noise = torch.zeros(0, geometry.mel_dim)  # [(received - _token_base)*r, mel_dim]
        self.planned = 0  # tokens whose DiT window has been handed out
        self.mel_final = 0  # tokens whose mel is final
        self._mel_base = 0  # global mel frame of _mel[0]
        self._mel = torch.zeros(0, geometry.mel_dim)  # final mel frames from _mel_base on
        self._vocoded = 0  # mel frames whose BigVGAN window has been handed out
        self.samples_emitted = 0

    @property
    def mel_emitted(self) -> int:
        return self.samples_emitted // self.geometry.samples_per_mel

    @property
    def done(self) -> bool:
        return self.ended and self.mel_emitted == self.received * self.geometry.repeats

    def push(self, codes: torch.Tensor) -> None:
        """codes [n] int64 in [0, num_embeds)."""
        if self.ended:
            raise RuntimeError("push() after finish()")
        if (self.received + codes.shape[0]) * self.geometry.repeats > self.geometry.max_mel_frames:
            raise ValueError(f"more than {self.geometry.max_mel_frames // self.geometry.repeats} codec tokens: "
                             "past the DiT's max_position_embeddings")
        self._codes = torch.cat([self._codes, codes.to(torch.long).cpu()])
        self._noise = torch.cat([self._noise, self.noise.draw(codes.shape[0])])
        self.received += codes.shape[0]

    def finish(self) -> None:
        self.ended = True

    def dit_windows(self) -> list[DitWindow]:
        """Every grid chunk now decodable, in order: its `ahead` tokens arrived or the stream ended."""
        c, r = self.context, self.geometry.repeats
        windows = []
        while self.planned < self.received:
            s = self.planned
            e = min(s + c.chunk, self.received)
            if not self.ended and self.received < s + c.chunk + c.ahead:
                break
            a, b = max(0, s - c.left), min(self.received, s + c.chunk + c.ahead)
            i, j = a - self._token_base, b - self._token_base
            windows.append(DitWindow(a, b, s, e, self._codes[i:j], self._noise[i * r:j * r]))
            self.planned = e
        self._trim_tokens()
        return windows

    def accept_mel(self, window: DitWindow, mel: torch.Tensor) -> None:
        """mel [(window.end - window.start)*r, mel_dim]: the window's ODE solution."""
        if window.keep_start != self.mel_final:
            raise RuntimeError(f"mel for tokens from {window.keep_start}, expected {self.mel_final}")
        r = self.geometry.repeats
        kept = mel[(window.keep_start - window.start) * r:(window.keep_end - window.start) * r]
        self._mel = torch.cat([self._mel.to(kept.dtype), kept.detach().cpu()])
        self.mel_final = window.keep_end

    def vocoder_windows(self) -> list[VocoderWindow]:
        """BigVGAN work now possible, in order: windows that emit `chunk`*r mel frames each, on a
        grid offset by `vocoder` frames (so each needs final mel up to a DiT chunk's end), every
        emitted frame with `vocoder` final frames (or the stream's edge) on both sides."""
        r, v, step = self.geometry.repeats, self.context.vocoder, self.context.chunk * self.geometry.repeats
        final, total = self.mel_final * r, self.received * r
        at_end = self.ended and self.mel_final == self.received
        windows = []
        while self._vocoded < (total if at_end else final - v):
            stop = ((self._vocoded + v) // step + 1) * step - v
            if at_end:
                stop = min(stop, total)
            elif stop + v > final:
                break
            a, b = max(0, self._vocoded - v), min(final, stop + v)
            windows.append(VocoderWindow(a, b, self._vocoded, stop, self._mel[a - self._mel_base:b - self._mel_base]))
            self._vocoded = stop
        keep_from = max(self._mel_base, self._vocoded - v)  # what the next window still needs
        if keep_from > self._mel_base:
            self._mel = self._mel[keep_from - self._mel_base:].clone()
            self._mel_base = keep_from
        return windows

    def accept_audio(self, window: VocoderWindow, wav: torch.Tensor) -> np.ndarray:
        """wav [(window.end - window.start)*samples_per_mel]: BigVGAN's output for the window."""
        if window.keep_start != self.mel_emitted:
            raise RuntimeError(f"audio from mel frame {window.keep_start}, expected {self.mel_emitted}")
        u = self.geometry.samples_per_mel
        out = wav[(window.keep_start - window.start) * u:(window.keep_end - window.start) * u]
        self.samples_emitted += out.shape[0]
        return out.detach().float().cpu().numpy()

    def _trim_tokens(self) -> None:
        # Keep the tokens and noise the next window still needs: from planned - left on.
        keep_from = max(self._token_base, self.planned - self.context.left)
        cut = keep_from - self._token_base
        if cut:
            self._codes = self._codes[cut:].clone()
            self._noise = self._noise[cut * self.geometry.repeats:].clone()
            self._token_base = keep_from


class Token2WavRunner:
    """The model side: the DiT ODE over equal-length windows of several requests at once, and
    BigVGAN over equal-length mel windows. Inputs are plain tensors; it keeps no request state."""

    def __init__(self, model, sampling: Sampling = Sampling()):
        self.model = model.eval()
        self.dit = model.code2wav_dit_model
        self.bigvgan = model.code2wav_bigvgan_model
        self.sampling = sampling
        self.geometry = geometry_of(model)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype  # float32 (transformers: Token2Wav runs in float32)
        # id(voice) -> (voice, its speaker-encoder rows), the last VOICE_CACHE voices used.
        self._voices: dict[int, tuple[Voice, torch.Tensor]] = {}

    @property
    def cfg(self) -> bool:
        return self.sampling.guidance_scale >= 1e-5  # as Qwen2_5OmniToken2WavDiTModel.sample decides

    @torch.inference_mode()
    def speaker_rows(self, voice: Voice) -> torch.Tensor:
        """The DiT's speaker-encoder output for `voice`: [2, enc_dim] (conditioned, unconditioned) or
        [1, enc_dim] without guidance. Computed once per voice, as the whole forward computes it on
        every evaluation: on the batch [reference_mel, zeros]."""
        cached = self._voices.get(id(voice))
        if cached is not None and cached[0] is voice:
            return cached[1]
        ref = voice.reference_mel.to(self.device, self.dtype).unsqueeze(0)  # [1, T, mel_dim]
        if self.cfg:
            ref = torch.cat([ref, torch.zeros_like(ref)])
        rows = self.dit.input_embed.spk_encoder(ref)
        if len(self._voices) >= VOICE_CACHE:
            self._voices.pop(next(iter(self._voices)))
        self._voices[id(voice)] = (voice, rows)
        return rows

    def time_points(self) -> torch.Tensor:
        """The ODE's time grid, as `sample` builds it."""
        s = self.sampling
        t = torch.linspace(0, 1, s.num_steps, device=self.device, dtype=self.dtype)
        if s.sway_coefficient is not None:
            t += s.sway_coefficient * (torch.cos(torch.pi / 2 * t) - 1 + t)
        return t

    @torch.inference_mode()
    def sample_mel(self, windows: list[DitWindow], voices: list[Voice]) -> torch.Tensor:
        """Equal-length windows of B requests -> mel [B, M, mel_dim], M = (end - start)*r: the
        ODE of `Qwen2_5OmniToken2WavDiTModel.sample` over each window from its own noise."""
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import RungeKutta4ODESolver

        r = self.geometry.repeats
        lengths = {w.end - w.start for w in windows}
        if len(lengths) != 1:
            raise ValueError(f"windows of one batch must have equal lengths, got {sorted(lengths)}")
        codes = torch.stack([w.codes for w in windows]).to(self.device)  # [B, n]
        x0 = torch.stack([w.noise for w in windows]).to(self.device, self.dtype)  # [B, M, mel_dim]
        positions = torch.stack([torch.arange(w.start * r, w.end * r) for w in windows]).to(self.device)  # [B, M]
        inputs = self._inputs(codes, positions, voices)
        scale = self.sampling.guidance_scale

        def velocity(t, x):
            out = self._evaluate(x, t, inputs)
            if not self.cfg:
                return out
            guided, null = torch.chunk(out, 2, dim=0)
            return guided + (guided - null) * scale

        return RungeKutta4ODESolver(function=velocity, initial_value=x0).integrate(self.time_points())[-1]

    def _inputs(self, codes: torch.Tensor, positions: torch.Tensor, voices: list[Voice]) -> dict:
        # What every evaluation of one batch shares; rows are [conditioned x B, unconditioned x B]
        # as in DiTInputEmbedding's classifier-free-guidance batch (B = 1 there).
        dit, M = self.dit, positions.shape[1]
        spk = torch.stack([v.conditioning.to(self.device, self.dtype).reshape(-1) for v in voices])  # [B, S]
        speaker_rows = [self.speaker_rows(v) for v in voices]
        cond = torch.stack([rows[0] for rows in speaker_rows])  # [B, enc_dim]
        code_embed = dit.text_embed(codes)  # [B, M, emb_dim]
        if self.cfg:
            spk = torch.cat([spk, torch.zeros_like(spk)])
            cond = torch.cat([cond, torch.stack([rows[1] for rows in speaker_rows])])
            code_embed = torch.cat([code_embed, dit.text_embed(codes, drop_code=True)])
            positions = torch.cat([positions, positions])
        rows = positions.shape[0]
        cond = cond.unsqueeze(1).repeat(1, M, 1)
        spk = spk.unsqueeze(1).repeat(1, M, 1)
        blocks = positions // dit.block_size  # absolute block index of each mel frame, [rows, M]
        block_diff = (blocks.unsqueeze(1) - blocks.unsqueeze(2)).unsqueeze(1).expand(rows, dit.num_attention_heads, M, M)
        # cos/sin are elementwise in the absolute position: bit-identical to the whole forward's.
        rotary = dit.rotary_embed(code_embed, positions)
        return {"cond": cond, "spk": spk, "code_embed": code_embed, "rotary": rotary, "block_diff": block_diff}

    def _evaluate(self, x: torch.Tensor, t: torch.Tensor, inputs: dict) -> torch.Tensor:
        # x [B, M, mel_dim] -> the DiT's output rows [2B or B, M, mel_dim]: the body of
        # Qwen2_5OmniToken2WavDiTModel.forward with the speaker encoder's output precomputed and
        # absolute positions (tests/code2wav/test_token2wav.py checks it against the forward).
        dit = self.dit
        h = torch.cat([x, x]) if self.cfg else x
        t = t.repeat(h.shape[0]) if t.ndim == 0 else t
        time_embedding = dit.time_embed(t)
        h = dit.input_embed.proj(torch.cat((h, inputs["cond"], inputs["code_embed"], inputs["spk"]), dim=-1))
        for block in dit.transformer_blocks:
            h = block(h, time_embedding, position_embeddings=inputs["rotary"], block_diff=inputs["block_diff"])
        return dit.proj_out(dit.norm_out(h, time_embedding))

    @torch.inference_mode()
    def vocode(self, windows: list[VocoderWindow]) -> torch.Tensor:
        """Equal-length mel windows -> wav [B, (end - start)*samples_per_mel] float32."""
        mel = torch.stack([w.mel for w in windows]).to(self.device, self.dtype).transpose(1, 2)  # [B, mel_dim, M]
        wav = self.bigvgan(mel)  # clamped, squeezed, on the CPU
        return wav.reshape(len(windows), -1)


class Token2WavDecoder:
    """One request decoded on its own, synchronously: push tokens, get the audio now final."""

    def __init__(self, runner: Token2WavRunner, voice: Voice, seed: int, context: StreamContext = StreamContext()):
        self.runner = runner
        self.voice = voice
        self.stream = Token2WavStream(runner.geometry, context, seed)

    def push(self, codes: torch.Tensor) -> np.ndarray:
        """codes [n] int64 -> the float32 samples now final."""
        self.stream.push(codes)
        return self._decode()

    def finish(self) -> np.ndarray:
        self.stream.finish()
        return self._decode()

    def _decode(self) -> np.ndarray:
        for window in self.stream.dit_windows():
            self.stream.accept_mel(window, self.runner.sample_mel([window], [self.voice])[0])
        audio = [self.stream.accept_audio(w, self.runner.vocode([w])[0]) for w in self.stream.vocoder_windows()]
        return np.concatenate(audio) if audio else EMPTY.copy()


def decode_full(model, codes: torch.Tensor, voice: Voice, seed: int, sampling: Sampling = Sampling()) -> np.ndarray:
    """The true answer: one `Qwen2_5OmniToken2WavModel.forward` over codes [N] after
    `torch.manual_seed(seed)` (the global CPU generator is restored after) -> float32 [N*r*240].
    A CPU model's: on a GPU the forward draws its noise there, which the stream never does."""
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[]), torch.inference_mode():
        torch.manual_seed(seed)
        wav = model(codes.to(device, torch.long).unsqueeze(0), voice.conditioning.to(device).reshape(1, -1),
                    voice.reference_mel.to(device).unsqueeze(0), num_steps=sampling.num_steps,
                    guidance_scale=sampling.guidance_scale, sway_coefficient=sampling.sway_coefficient)
    return wav.reshape(-1).float().numpy()
