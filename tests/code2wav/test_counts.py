"""Counts that cannot regress: the incremental decoder's ops and host transfers per call, at the
real Qwen3-Omni vocoder layout (8 layers, hidden 1024, decoder dim 1536, window 72), counted on the
meta device, where every op runs for its shapes alone (no memory, no arithmetic: a second a call).

What a call costs on a GPU is mostly its kernel count and its waits for the device, not its
arithmetic (docs/gpu.md, "code2wav"), and both are deterministic: every aten op a decode call
dispatches goes through `Counted` (views and composite ops included, so the counts are upper
bounds of the kernels), split by where its tensors live, with each copy between the host and the
device and each read of a device value on the host (`item`, `nonzero`, a copy to the CPU: the
paths that wait for the device) counted apart. Before the slot pool (the decoder of issue 50),
at blocks of 25 frames: 818 device ops at one request, 1,979 at 16 and 5,579 at 64 (36 state
clones and 36 slices a request), 10 uploads and 1 + G downloads a call; now the device ops are
the same at any batch and a call uploads one tensor and downloads one.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from services.code2wav.blocks import BlockGrid, BlockStream
from services.code2wav.incremental import IncrementalVocoder
from services.code2wav.vocoder import VocoderGeometry
from services.runtime.chunking import DEFAULT_CHUNKS
from services.runtime.model.full_size import REAL_LAYOUT

aten = torch.ops.aten
GRID = BlockGrid(DEFAULT_CHUNKS.schedule())  # 4, 8, 16, 25
REAL_GEOMETRY = VocoderGeometry(1920, 555, 24000)  # what measure_geometry finds at the real layout
READS = (aten._local_scalar_dense.default, aten.item.default, aten.nonzero.default)


class Counted(TorchDispatchMode):
    """Every aten op dispatched inside it: on the device (any tensor argument on meta) or on the
    host, and the transfers apart. A device value read on the host gets a stand-in (zeros): meta
    tensors have no data."""

    def __init__(self):
        super().__init__()
        self.device = self.host = self.uploads = self.downloads = 0
        self.kernels = 0  # device ops that are not views (an upper bound of the kernels launched)
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops[func] += 1
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on_device = any(t.device.type == "meta" for t in tensors)
        self.device += on_device
        self.kernels += on_device and not func.is_view
        self.host += not on_device
        if func in READS and on_device:
            self.downloads += 1
            return torch.zeros((0, args[0].dim()), dtype=torch.long) if func is aten.nonzero.default else 0
        moved = self._moved(func, args, kwargs)
        if moved == ("meta", "cpu"):
            self.downloads += 1
            return (args[0] if func is aten.copy_.default else
                    torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype))
        self.uploads += moved == ("cpu", "meta")
        return func(*args, **kwargs)

    @staticmethod
    def _moved(func, args, kwargs) -> tuple[str, str] | None:
        """(from, to) device types of a copy between devices, else None."""
        if func is aten.copy_.default:
            return args[1].device.type, args[0].device.type
        if func.overloadpacket in (aten._to_copy, aten.to):
            to = kwargs.get("device", next((a for a in args[1:] if isinstance(a, torch.device | str)), None))
            if to is not None and torch.device(to).type != args[0].device.type:
                return args[0].device.type, torch.device(to).type
        return None


@pytest.fixture(scope="module")
def vocoder() -> IncrementalVocoder:
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

    with torch.device("meta"):
        model = Qwen3OmniMoeCode2Wav._from_config(Qwen3OmniMoeCode2WavConfig(**REAL_LAYOUT["code2wav_config"]))
    vocoder = IncrementalVocoder(model.eval(), REAL_GEOMETRY, GRID)
    one_call(vocoder, 1, len(GRID.sizes) - 1)  # every shape once: its mask's pieces are built on first use
    return vocoder


def one_call(vocoder: IncrementalVocoder, batch: int, index: int, full: bool = True) -> Counted:
    """The engine's work for one call (engine.py, `_decode`): `batch` requests' block `index` (the
    requests' whole blocks before it decoded first, uncounted), decoded, each row's audio taken."""
    size = GRID.size(index)
    frames = GRID.first_frame(index) + (size if full else size - 1)
    streams = [BlockStream(GRID, REAL_GEOMETRY) for _ in range(batch)]
    slots = [vocoder.start() for _ in range(batch)]
    for stream in streams:
        stream.push(torch.zeros((frames, 16), dtype=torch.long))
    with Counted():  # the whole blocks before, of the shapes the vocoder has seen
        while streams[0].blocks < index:
            blocks = [stream.next_block() for stream in streams]
            wav, _ = vocoder.decode(blocks, slots)
            for stream, block, row in zip(streams, blocks, wav):
                stream.accept(block, row, vocoder.first_sample(block))
    with Counted() as counted:
        blocks = [stream.next_block() for stream in streams]
        wav, after = vocoder.decode(blocks, slots)
        for stream, block, row in zip(streams, blocks, wav):
            stream.accept(block, row, vocoder.first_sample(block))
    assert wav.shape == (batch, size * 1920 - (0 if index else 555)) and wav.device.type == "cpu"
    assert after == (slots if full else [None] * batch)
    return counted


@pytest.mark.parametrize("index", [0, 3])  # the first block (4 frames), a repeating one (25 frames)
def test_a_calls_device_ops_do_not_grow_with_the_batch(vocoder, index):
    calls = {batch: one_call(vocoder, batch, index) for batch in (1, 16, 64)}
    kernels = {batch: counted.kernels for batch, counted in calls.items()}
    device = {batch: counted.device for batch, counted in calls.items()}
    # At the real layout: 575 ops that are not views at the first block, 580 at the others (the
    # transposed convolutions' histories), at any batch; 793 and 870 with the views, 3 fewer at
    # one request (its index columns are contiguous already). Before the pool: 579, 1,155 and
    # 2,883 at 1, 16 and 64 requests.
    assert kernels[1] == kernels[16] == kernels[64] <= 580, kernels
    assert device[1] <= device[16] == device[64] <= 870, device
    # every request's state read in one gather (a first block reads none)
    assert calls[64].ops[aten.index_select.default] == (index > 0)
    assert calls[64].ops[aten.index_copy_.default] <= 36  # and written in place, a write a history
    # The host's share: the engine's bookkeeping of each request's block (cutting its frames,
    # taking its samples: 11 ops a request on CPU tensors) and one packing of the call's input.
    for batch, counted in calls.items():
        assert counted.host <= 8 + 11 * batch, (batch, counted.host)


@pytest.mark.parametrize("full", [True, False])
@pytest.mark.parametrize("batch", [1, 16, 64])
def test_a_call_uploads_one_tensor_and_downloads_one(vocoder, batch, full):
    counted = one_call(vocoder, batch, 3, full)
    assert (counted.uploads, counted.downloads) == (1, 1), (counted.uploads, counted.downloads)


def test_the_rotary_table_and_the_masks_are_built_once(vocoder):
    one_call(vocoder, 2, 4)
    table = vocoder._rotary.cos
    counted = one_call(vocoder, 2, 4)
    assert vocoder._rotary.cos is table  # 4,096 positions (5.5 minutes of audio) before it grows
    assert counted.ops[aten.arange.default] == counted.ops[aten.arange.start] == 0
