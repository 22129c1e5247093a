"""`fuse_rms_norms` (services/runtime/lm/kernels.py): where no bits are promised (exact batching off
on a GPU), every Qwen RMSNorm of a decoder runs as one `F.rms_norm`: the module's math in one op
instead of eight; the decoder's outputs stay those of the modules to float32 rounding."""

from __future__ import annotations

import copy

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from services.runtime.lm.kernels import fuse_rms_norms
from services.runtime.model.checkpoint import Stage, load_stage


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_fused_norms_keep_the_decoders_outputs_in_one_op_a_norm(tiny_checkpoint):
    model = load_stage(tiny_checkpoint, Stage.THINKER).model
    decoder = model.model
    fused = copy.deepcopy(decoder)
    norms = fuse_rms_norms(fused)
    layers = decoder.config.num_hidden_layers
    assert norms == 4 * layers + 1  # input, post-attention, q and k norms a layer, and the final one
    ids = torch.randint(0, decoder.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = decoder(input_ids=ids).last_hidden_state
        with _Ops() as counted:
            got = fused(input_ids=ids).last_hidden_state
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert counted.ops.count("rms_norm") == norms and "rsqrt" not in counted.ops
    norm = fused.norm
    x = torch.randn(3, decoder.config.hidden_size, dtype=torch.bfloat16)
    with torch.inference_mode():  # bfloat16: the weight multiplies before the one rounding, within an ulp
        reference = type(norm).forward(norm.to(torch.bfloat16), x)
        torch.testing.assert_close(norm(x), reference, rtol=1.6e-2, atol=1e-2)
