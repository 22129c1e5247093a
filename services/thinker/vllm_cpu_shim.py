"""`python -m services.thinker.vllm_cpu_shim`: make PyPI's CUDA-built torchvision import beside
the CPU torch wheel in the vLLM virtualenv (`make setup-vllm` runs it once).

Standard library only, and no project imports: it runs before the shim exists, when importing
transformers' vision code would still fail.
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

# NOTE: written into the vLLM virtualenv's site-packages by this module, with a .pth file
# that imports it at interpreter start (vLLM's child processes included). Costs nothing until
# torchvision is imported.
CPU_SHIM = '''"""omni-serve: let PyPI's CUDA-built torchvision import beside the CPU torch wheel.

Its _C extension needs libc10_cuda.so, so on torch+cpu it does not load, and then
torchvision/_meta_registrations.py fails on register_fake("torchvision::nms") ("operator
torchvision::nms does not exist"). Declaring the two schemas first (no kernels) lets the
pure-Python parts import (transforms.v2, which transformers' Qwen2-VL image processor needs);
torchvision.ops.nms then raises when called. Does nothing when _C loads (a matching build).
"""
import importlib.abc
import importlib.util
import os
import sys


class _TorchvisionShim(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torchvision")
        if spec is None or not spec.submodule_search_locations:
            return None
        import torch

        folder = list(spec.submodule_search_locations)[0]
        libs = [f for f in os.listdir(folder) if f.startswith("_C") and f.endswith(".so")]
        try:
            for lib in libs:
                torch.ops.load_library(os.path.join(folder, lib))
            return None  # the extension loads: nothing to do
        except OSError:
            pass
        lib = torch.library.Library("torchvision", "FRAGMENT")
        lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _KEEP.append(lib)
        return None


_KEEP = []
sys.meta_path.insert(0, _TorchvisionShim())
'''
CPU_SHIM_MODULE = "_omni_torchvision_shim"


def install_cpu_shim(site_packages: Path) -> list[Path]:
    """Write CPU_SHIM and its .pth into this interpreter's site-packages; returns the paths."""
    module = site_packages / f"{CPU_SHIM_MODULE}.py"
    pth = site_packages / f"{CPU_SHIM_MODULE}.pth"
    module.write_text(CPU_SHIM)
    pth.write_text(f"import {CPU_SHIM_MODULE}\n")
    return [module, pth]


def main() -> int:
    import torch  # only its version: whether a shim is needed at all

    if torch.version.cuda is not None:
        print("torch is a CUDA build: no shim needed")
        return 0
    for path in install_cpu_shim(Path(sysconfig.get_paths()["purelib"])):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
