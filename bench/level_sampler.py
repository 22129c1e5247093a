"""What the stages and the GPU do during one level of the device benchmark, sampled on a thread of
its own every `interval_s`: each stage process's queue depth and running batch (its Prometheus
gauges, services/serving/metrics.py) and each GPU's utilisation and memory in use (NVML through
pynvml where it imports, else one `nvidia-smi -lms` process for the level). Neither (a CPU run, a
machine without the driver's tools) is no GPU samples and a `gpu_source` that says why, not an error.

NVML's utilisation is the share of the last sample period in which any kernel ran on the GPU: a
GPU at 100 % may still leave most SMs idle (a decode step of small kernels), so it bounds how busy
the GPU was from above, and a low figure is a GPU that waited on the host.
"""

from __future__ import annotations

import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, field

from bench.stage_metrics import scrape


@dataclass(frozen=True)
class Gauge:
    """One gauge over a level's samples."""

    mean: float | None
    max: float | None
    samples: int

    @classmethod
    def of(cls, values: list[float]) -> Gauge:
        return cls(round(statistics.fmean(values), 3) if values else None, max(values) if values else None, len(values))


@dataclass(frozen=True)
class StageGauges:
    queue_depth: Gauge  # requests admitted, waiting for a slot or input
    running: Gauge  # requests holding a slot / decoder


@dataclass(frozen=True)
class GpuGauges:
    index: int
    util_pct: Gauge  # NVML utilisation.gpu: the share of time any kernel ran
    memory_used_mib: Gauge


@dataclass(frozen=True)
class LevelSamples:
    interval_s: float
    gpu_source: str  # "nvml", "nvidia-smi", or why there are no GPU samples ("absent: ...", "off: ...")
    stages: dict[str, StageGauges]  # process name -> its gauges
    gpus: list[GpuGauges]


@dataclass
class _Series:
    values: dict[tuple[str, str], list[float]] = field(default_factory=dict)  # (key, gauge) -> samples

    def add(self, key: str, gauge: str, value: float) -> None:
        self.values.setdefault((key, gauge), []).append(float(value))

    def gauge(self, key: str, gauge: str) -> Gauge:
        return Gauge.of(self.values.get((key, gauge), []))


SMI = "nvidia-smi"


def parse_smi_line(line: str) -> tuple[int, float, float] | None:
    """(index, utilisation %, memory used MiB) from a line of `nvidia-smi --query-gpu=index,
    utilization.gpu,memory.used --format=csv,noheader,nounits`; None for "[N/A]" or a partial line."""
    parts = [p.strip() for p in line.split(",")]
    try:
        return int(parts[0]), float(parts[1]), float(parts[2])
    except (ValueError, IndexError):
        return None


def _nvml():
    """pynvml, initialised, or None."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # not installed, or no driver: the nvidia-smi reader or nothing
        return None


class LevelSampler:
    """A context manager around one level: samples while the level runs, `result()` after."""

    def __init__(self, endpoints: dict[str, tuple[str, str]], interval_s: float = 0.5, gpu: bool = True):
        self.endpoints = endpoints  # process name -> (stage, metrics url)
        self.interval_s = interval_s
        self.gpu = gpu  # False: the stages run on the CPU, no GPU to sample
        self._series = _Series()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._smi: subprocess.Popen | None = None
        self._source = "absent: no NVML (pynvml), no nvidia-smi" if gpu else "off: the stages run on the CPU"
        self._nvml = None

    def __enter__(self) -> LevelSampler:
        if self.gpu:
            self._nvml = _nvml()
            if self._nvml is not None:
                self._source = "nvml"
            else:
                self._start_smi()
        self._threads.append(threading.Thread(target=self._poll, daemon=True))
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._smi is not None and self._smi.poll() is None:
            self._smi.terminate()
        for thread in self._threads:
            thread.join(timeout=5)
        if self._smi is not None:
            try:
                self._smi.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._smi.kill()

    def _start_smi(self) -> None:
        try:
            self._smi = subprocess.Popen(
                [SMI, "--query-gpu=index,utilization.gpu,memory.used", "--format=csv,noheader,nounits",
                 "-lms", str(int(self.interval_s * 1000))],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            return  # no nvidia-smi: no GPU samples
        self._source = "nvidia-smi"
        self._threads.append(threading.Thread(target=self._read_smi, daemon=True))

    def _read_smi(self) -> None:
        for line in self._smi.stdout:
            reading = parse_smi_line(line)
            if reading is None:
                continue
            index, util, memory = reading
            self._series.add(f"gpu{index}", "util", util)
            self._series.add(f"gpu{index}", "memory", memory)

    def _poll(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            for name, (stage, url) in self.endpoints.items():
                try:
                    samples = scrape(url, timeout_s=self.interval_s * 2)
                except OSError:
                    continue
                for gauge, metric in (("queue", "omni_stage_queue_depth"), ("running", "omni_stage_running_batch")):
                    value = samples.get((metric, (("stage", stage),)))
                    if value is not None:
                        self._series.add(name, gauge, value)
            if self._nvml is not None:
                self._sample_nvml()
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - began)))

    def _sample_nvml(self) -> None:
        nvml = self._nvml
        try:
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                self._series.add(f"gpu{index}", "util", nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
                self._series.add(f"gpu{index}", "memory", nvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20)
        except Exception:  # noqa: BLE001 - a failed reading is a missing sample
            pass

    def result(self) -> LevelSamples:
        series = self._series
        gpus = sorted({int(key[3:]) for key, _ in series.values if key.startswith("gpu") and key[3:].isdigit()})
        source = self._source
        if not gpus and source in ("nvml", "nvidia-smi"):
            source = f"absent: {source} gave no readings"
        return LevelSamples(
            interval_s=self.interval_s, gpu_source=source,
            stages={name: StageGauges(series.gauge(name, "queue"), series.gauge(name, "running"))
                    for name in self.endpoints},
            gpus=[GpuGauges(i, series.gauge(f"gpu{i}", "util"), series.gauge(f"gpu{i}", "memory")) for i in gpus])
