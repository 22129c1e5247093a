"""The thinker's media encoders, one media item a call, their outputs kept by content hash.

A voice session re-sends its whole audio history every turn, and a chat conversation re-sends its
images: without this, each turn runs the audio / vision tower over every item again.
`PerItemEncoders` replaces the model's `get_audio_features`, `get_image_features` and
`get_video_features` for the prompt's forward (on the instance: the model's own forward calls them,
so prefill, chunking and the prefix cache are unchanged) with versions that encode each item alone,
through the model's own method, and keep what it gave in an `EncoderCache`: a later prompt with the
same item takes the kept tensors.

NOTE: one item a call. Transformers encodes a prompt's items of one modality in one call, and an
item's bits then depend on its neighbours: the audio towers run their convolutions over all the
call's mel chunks at once, and oneDNN blocks a convolution by its batch. On the tiny checkpoints a
0.8 s clip encoded alone and beside three others differed in the last bits (Qwen3-Omni already at
the first encoder layer's input, even with each clip's chunks padded to the call's width;
Qwen2.5-Omni by up to 1.7e-6). An item encoded alone is a function of itself, so its kept output is
the bits encoding it again gives, whatever else the prompt holds. The price: a prompt with several
items of one modality no longer has the bits of `generate`'s one call (the last bits of the
encoder outputs; with one item per modality it does). So the cache is off by default
(`--encoder-cache-mb 0`: the model's own call, generate's bits) and on where repeated media matter
more than that (voice sessions: docs/operations.md, "The encoder cache").

The key: a hash of the item's encoder input as the tower gets it (mel features or pixel patches,
after preprocessing, in the model's dtype, with their shape; for vision its grid), the modality,
and the encoder's identity (checkpoint, dtype, device, gemm mode), so no setting that changes the
output can share an entry. Qwen3-Omni's feature extractor pads a prompt's clips to the longest
before the STFT, so the longest clip's last mel frames differ from the same clip's beside a longer
one: that clip misses once more when a longer one joins the history (its features, hence its
output, really differ), and hits from then on. Bounded in bytes, least recently used evicted.

The same cache keeps each audio part's mel features for the prompt builder (`PromptBuilder.
feature_cache`, key "audio_features": the part's samples and the length it is padded to), so a
turn computes the features of its new clip only (services/runtime/inputs/prompt.py,
`_audio_features`). The engine thread and the admission workers call it; the lock guards the
entries and the counters the metrics scrape reads.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from services.runtime.inputs.prompt import FEATURES, ClipFeatures


@dataclass(frozen=True)
class Encoded:
    """One media item's encoder output: `pooled` [tokens, hidden] (what replaces its placeholders),
    `deepstack` (Qwen3-Omni vision: one [tokens, hidden] per deepstack layer; else empty)."""
    pooled: torch.Tensor
    deepstack: tuple[torch.Tensor, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.pooled, *self.deepstack))


@dataclass
class EncoderStats:
    """Counters since start (omni_encoder_cache_*), per modality (audio, image, video)."""
    hits: dict[str, int]  # modality -> items found
    misses: dict[str, int]  # modality -> items encoded
    evictions: int = 0


MODALITIES = ("audio", "image", "video")
COUNTED = MODALITIES + (FEATURES,)  # and the prompt builder's audio features, kept here too
MEDIA_INPUTS = frozenset({"input_features", "pixel_values", "pixel_values_videos"})  # the forward's media kwargs


class EncoderCache:
    """Encoder outputs by key, at most `capacity_bytes` of tensors; 0 keeps nothing (counted still)."""

    def __init__(self, capacity_bytes: int, identity: str):
        self.capacity_bytes = capacity_bytes
        self.identity = identity.encode()  # what else decides the output: checkpoint, dtype, device, exact mode
        self._entries: OrderedDict[bytes, Encoded | ClipFeatures] = OrderedDict()  # key -> output, least recently used first
        self.bytes = 0
        self.stats = EncoderStats({m: 0 for m in COUNTED}, {m: 0 for m in COUNTED})
        self._lock = threading.Lock()

    def key(self, modality: str, tensor: torch.Tensor, *extra: torch.Tensor) -> bytes:
        """The item's key: its encoder input's bits, dtype and shape (and `extra`, e.g. its grid)."""
        digest = hashlib.blake2b(self.identity + modality.encode(), digest_size=32)
        for t in (tensor, *extra):
            digest.update(f"{t.dtype}{tuple(t.shape)}".encode())
            t = t.detach().reshape(-1).contiguous().cpu()
            digest.update(t.view(torch.uint8).numpy() if t.numel() else b"")
        return digest.digest()

    def get(self, modality: str, key: bytes) -> Encoded | ClipFeatures | None:
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                self.stats.misses[modality] += 1
                return None
            self._entries.move_to_end(key)
            self.stats.hits[modality] += 1
            return found

    def put(self, key: bytes, encoded: Encoded | ClipFeatures) -> None:
        """Keep `encoded`, evicting the least recently used entries to fit; one larger than the whole
        cache is not kept."""
        size = encoded.nbytes
        with self._lock:
            if size > self.capacity_bytes or key in self._entries:
                return
            while self.bytes + size > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.bytes -= evicted.nbytes
                self.stats.evictions += 1
            self._entries[key] = encoded
            self.bytes += size

    @property
    def entries(self) -> int:
        return len(self._entries)


class PerItemEncoders:
    """The model's media feature methods, one item a call through the originals, with `cache`.
    A prompt's forward runs inside `with encoders:`; the model's forward then calls them."""

    def __init__(self, model, cache: EncoderCache):
        self.model, self.cache = model, cache
        # the model's own methods (bound), which these call one item at a time
        self.originals = {m: getattr(model, f"get_{m}_features") for m in MODALITIES}

    def __enter__(self) -> PerItemEncoders:
        """These in place of the model's own for one forward (instance attributes, removed after:
        engines that share a model each bring their own cache)."""
        for modality in MODALITIES:
            setattr(self.model, f"get_{modality}_features", getattr(self, modality))
        return self

    def __exit__(self, *exc) -> None:
        for modality in MODALITIES:
            delattr(self.model, f"get_{modality}_features")

    def audio(self, input_features: torch.Tensor, feature_attention_mask: torch.Tensor | None = None,
              audio_feature_lengths: torch.Tensor | None = None, **kwargs):
        """input_features [items, mel, frames], feature_attention_mask [items, frames] (both families
        pass it; generate's path then ignores `audio_feature_lengths`). Returns what the model's
        forward reads: `last_hidden_state` [sum of items' tokens, hidden]."""
        if feature_attention_mask is None:  # not a call the thinker makes: the model's own
            return self.originals["audio"](input_features, feature_attention_mask, audio_feature_lengths, **kwargs)
        outputs = []
        for features, mask in zip(input_features, feature_attention_mask):
            frames = int(mask.sum())
            item, item_mask = features[None, :, :frames], mask[None, :frames]
            outputs.append(self._encoded("audio", (item,), lambda item=item, item_mask=item_mask: Encoded(
                self.originals["audio"](item, item_mask, None, **kwargs).last_hidden_state)).pooled)
        return SimpleNamespace(last_hidden_state=torch.cat(outputs))

    def image(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor | None = None, **kwargs):
        return self._vision("image", pixel_values, image_grid_thw, **kwargs)

    def video(self, pixel_values_videos: torch.Tensor, video_grid_thw: torch.Tensor | None = None, **kwargs):
        return self._vision("video", pixel_values_videos, video_grid_thw, **kwargs)

    def _vision(self, modality: str, pixels: torch.Tensor, grid_thw: torch.Tensor, **kwargs):
        """pixels [sum of items' patches, patch dim], grid_thw [items, 3] (an item's patches: its
        product). Returns what the model's forward reads: `pooler_output` (a tensor per item) and,
        for Qwen3-Omni, `deepstack_features` (per layer, a tensor per item)."""
        items, start = [], 0
        for grid in grid_thw:
            patches = int(grid.prod())
            item, item_grid = pixels[start:start + patches], grid[None]
            start += patches

            def encode(item=item, item_grid=item_grid) -> Encoded:
                out = self.originals[modality](item, item_grid, **kwargs)
                return Encoded(out.pooler_output[0], tuple(layer[0] for layer in getattr(out, "deepstack_features", None) or ()))
            items.append(self._encoded(modality, (item, item_grid), encode))
        deepstack = [tuple(item.deepstack[layer] for item in items) for layer in range(len(items[0].deepstack))]
        return SimpleNamespace(pooler_output=tuple(item.pooled for item in items), deepstack_features=deepstack)

    def _encoded(self, modality: str, inputs: tuple[torch.Tensor, ...], encode) -> Encoded:
        key = self.cache.key(modality, *inputs)
        found = self.cache.get(modality, key)
        if found is None:
            found = encode()
            self.cache.put(key, found)
        return found
