"""The window decoder (`--decoder window`): codec frames arriving in chunks -> one continuous PCM
stream, each chunk decoded together with a left context of the frames before it.

The talker emits codec frames a few at a time; the client should hear audio as soon as the first
chunk is decoded, and the concatenated stream must equal one vocoder forward over all frames
(`vocoder.decode_full`, the reference), within float tolerance.

NOTE: algorithm. The vocoder is causal (vocoder.py, U and L), so a forward over frames [a, b)
returns the samples of the true answer at global positions [a*U, b*U - L), exactly, provided
frame a has enough frames before it.

Each push decodes the new chunk [s, e) together with the last `left_context` frames before it,
window [s - c, e), and emits global samples [s*U - L, e*U - L) ([0, e*U - L) for the first
chunk): the L samples held back at the previous chunk's end (they depend on frame s, so only this
window can produce them) plus the new chunk's own samples, less its own last L. The window's first
c*U - L samples belong to the context and are dropped; they were emitted before. Hence
c >= ceil(L/U) = 1 frame is required. Only the last `left_context` frames are kept.

The window start is a cut, so its first samples differ from the true answer (zero padding in
the convolutions, attention without the earlier frames); 25 frames of context cover the tiny
checkpoint's reach (~24 frames), so the emitted part matches there within float32 rounding. The
real vocoder (sliding window 72 over 8 layers) reaches ~580 frames back: 25 frames (the upstream
`chunked_decode` default) give ~3 dB SNR there, which is why the default decoder is
incremental.py's (docs/qwen3-omni.md, sections "The vocoder" and "Float32 and float64").

The vocoder's forward trims the L look-ahead samples itself, so nothing else is ever pending and
`finish()` returns an empty array; after it, total emitted == n_total*U - L == len(decode_full).
"""

from __future__ import annotations

import numpy as np
import torch

from services.code2wav.vocoder import EMPTY, VocoderGeometry, forward, model_device


class WindowDecoder:
    """Per-request window decoder state (not thread-safe; one per request)."""

    def __init__(self, model, geometry: VocoderGeometry, left_context: int = 25):
        if left_context < geometry.min_left_context:
            raise ValueError(
                f"left_context={left_context} frames cannot regenerate the {geometry.lookahead_samples} "
                f"held-back samples; need at least {geometry.min_left_context}"
            )
        self.model = model
        self.geometry = geometry
        self.left_context = left_context
        self.num_quantizers = int(model.config.num_quantizers)
        # [<= left_context, Q] int64 on the model's device: the frames before the next chunk.
        # Bounded, so memory does not grow with the stream.
        self._context = torch.zeros((0, self.num_quantizers), dtype=torch.long, device=model_device(model))
        self._frames_seen = 0
        self._samples_emitted = 0
        self._finished = False

    @property
    def frames_seen(self) -> int:
        return self._frames_seen

    @property
    def samples_emitted(self) -> int:
        return self._samples_emitted

    def window(self, frames: torch.Tensor) -> torch.Tensor:
        """The frames to decode for this chunk: [c + n, Q], the left context then the chunk."""
        if self._finished:
            raise RuntimeError("push() after finish()")
        if frames.dim() != 2 or frames.shape[1] != self.num_quantizers:
            raise ValueError(f"expected frames [n, {self.num_quantizers}], got {list(frames.shape)}")
        frames = frames.to(device=self._context.device, dtype=torch.long)
        return torch.cat([self._context, frames])

    def accept(self, window: torch.Tensor, wav: torch.Tensor) -> np.ndarray:
        """Take the vocoder's output for `window` (from `window()`, possibly decoded in a batch
        with other requests' windows); advance; return the float32 samples now final."""
        U, L = self.geometry.samples_per_frame, self.geometry.lookahead_samples
        n = window.shape[0] - self._context.shape[0]
        window_start = self._frames_seen - self._context.shape[0]  # global frame index of window[0]
        # wav holds global samples [window_start*U, (frames_seen+n)*U - L)
        new = wav[self._samples_emitted - window_start * U :]  # [n*U] after the first chunk, n*U - L on it
        # Clone: a view would keep the whole [c + n, Q] window alive.
        self._context = window[max(0, window.shape[0] - self.left_context) :].clone()
        self._frames_seen += n
        self._samples_emitted += new.shape[-1]
        assert self._samples_emitted == self._frames_seen * U - L, "vocoder output length drifted"
        return new.cpu().numpy()

    def push(self, frames: torch.Tensor) -> np.ndarray:
        """Decode a chunk of frames [n, Q]; return the float32 samples that are now final."""
        if frames.shape[0] == 0 and not self._finished:
            return EMPTY.copy()
        window = self.window(frames)
        return self.accept(window, forward(self.model, window))

    def finish(self) -> np.ndarray:
        """End of stream: the held-back tail. The forward already trims the L samples that
        need later frames and the stream has none, so it is empty for this vocoder."""
        self._finished = True
        self._context = self._context[:0]
        return EMPTY.copy()
