"""What the figures were measured on: CPU, cores, memory, accelerators, library versions, load."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from importlib import metadata


@dataclass(frozen=True)
class Machine:
    cpu_model: str
    logical_cores: int
    usable_cores: int  # this process's CPU affinity
    memory_gb: float | None
    os: str
    python: str
    torch: str
    transformers: str
    grpcio: str
    numpy: str
    torch_threads: int  # intra-op threads in the benchmark process (reference and floor)
    accelerators: list[str]  # e.g. "NVIDIA H200 (139.8 GiB)"; empty on a CPU-only machine
    load_average: list[float]  # 1, 5, 15 minutes, at the start: other work on the machine shows here

    @property
    def label(self) -> str:
        """One line naming the machine, for the table and the plot."""
        accel = f", {', '.join(self.accelerators)}" if self.accelerators else ""
        return f"{self.cpu_model}, {self.usable_cores} cores{accel}"


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gb() -> float | None:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _accelerators() -> list[str]:
    import torch

    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        out.append(f"{props.name} ({props.total_memory / 2**30:.1f} GiB)")
    return out


def describe_machine() -> Machine:
    import torch

    return Machine(
        cpu_model=_cpu_model(),
        logical_cores=os.cpu_count() or 1,
        usable_cores=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1),
        memory_gb=_memory_gb(),
        os=f"{platform.system()} {platform.release()}",
        python=platform.python_version(),
        torch=torch.__version__,
        transformers=_version("transformers"),
        grpcio=_version("grpcio"),
        numpy=_version("numpy"),
        torch_threads=torch.get_num_threads(),
        accelerators=_accelerators(),
        load_average=[round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else [],
    )
