"""The one wire format for tensors, audio and codec frames, used by every service.

Tensors cross as raw little-endian bytes with dtype and shape: no pickle, no JSON floats.
bfloat16 has no numpy dtype, so it crosses as its 16-bit pattern.
"""

from __future__ import annotations

import math
import sys

import numpy as np
import torch

from omni.v1 import common_pb2
from services.serving.metrics import timed_wire as _timed
from services.serving.status import WireError

assert sys.byteorder == "little", "the wire format assumes a little-endian host"

_TORCH_TO_WIRE = {
    torch.float32: common_pb2.Tensor.DTYPE_FLOAT32,
    torch.float16: common_pb2.Tensor.DTYPE_FLOAT16,
    torch.bfloat16: common_pb2.Tensor.DTYPE_BFLOAT16,
    torch.int64: common_pb2.Tensor.DTYPE_INT64,
    torch.int32: common_pb2.Tensor.DTYPE_INT32,
}
_WIRE_TO_TORCH = {v: k for k, v in _TORCH_TO_WIRE.items()}
# The dtype whose bytes carry each wire dtype (bfloat16 travels as its int16 bit pattern).
_CARRIER = {torch.bfloat16: torch.int16}



@_timed
def tensor_to_proto(t: torch.Tensor) -> common_pb2.Tensor:
    if t.dtype not in _TORCH_TO_WIRE:
        raise WireError(f"dtype {t.dtype} has no wire encoding")
    flat = t.detach().to("cpu").contiguous()
    carrier = flat.view(_CARRIER.get(flat.dtype, flat.dtype))
    return common_pb2.Tensor(
        dtype=_TORCH_TO_WIRE[t.dtype], shape=list(t.shape), data=carrier.numpy().tobytes()
    )


@_timed
def tensor_from_proto(p: common_pb2.Tensor) -> torch.Tensor:
    if p.dtype not in _WIRE_TO_TORCH:
        raise WireError(f"unknown tensor dtype {p.dtype}")
    dtype = _WIRE_TO_TORCH[p.dtype]
    carrier = _CARRIER.get(dtype, dtype)
    itemsize = torch.empty((), dtype=carrier).element_size()
    count = math.prod(p.shape)  # exact Python ints: no int64 wrap-around on absurd shapes
    if any(d < 0 for d in p.shape) or count * itemsize != len(p.data):
        raise WireError(f"tensor bytes ({len(p.data)}) do not match shape {list(p.shape)} of {dtype}")
    if count == 0:
        return torch.empty(tuple(p.shape), dtype=dtype)
    # bytearray: torch wants a writable buffer; one copy, then no more.
    t = torch.frombuffer(bytearray(p.data), dtype=carrier).reshape(tuple(p.shape))
    return t.view(dtype) if carrier is not dtype else t


@_timed
def audio_to_proto(samples: np.ndarray, sample_rate: int, index: int, first_frame: int = 0,
                   end_frame: int = 0, samples_per_frame: int = 0) -> common_pb2.AudioChunk:
    pcm = np.ascontiguousarray(samples, dtype="<f4")
    return common_pb2.AudioChunk(pcm=pcm.tobytes(), sample_rate=sample_rate, index=index, num_samples=pcm.size,
                                 first_frame=first_frame, end_frame=end_frame, samples_per_frame=samples_per_frame)


@_timed
def audio_from_proto(chunk: common_pb2.AudioChunk) -> np.ndarray:
    if len(chunk.pcm) % 4:
        raise WireError(f"audio chunk has {len(chunk.pcm)} bytes, not a whole number of float32 samples")
    return np.frombuffer(chunk.pcm, dtype="<f4")


@_timed
def frames_to_proto(frames: torch.Tensor, first_frame: int) -> common_pb2.CodecFrames:
    """frames: [n, num_code_groups] integer codes."""
    return common_pb2.CodecFrames(
        first_frame=first_frame, num_code_groups=int(frames.shape[1]), ids=frames.reshape(-1).tolist()
    )


@_timed
def frames_from_proto(p: common_pb2.CodecFrames) -> torch.Tensor:
    """-> [n, num_code_groups] int64."""
    groups = p.num_code_groups
    if groups <= 0 or len(p.ids) % groups:
        raise WireError(f"{len(p.ids)} codec ids do not split into frames of {groups}")
    return torch.tensor(list(p.ids), dtype=torch.int64).reshape(-1, groups)
