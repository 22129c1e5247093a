"""The prepared device script (bench/device_check.sh) in its CPU dry run, `DEVICE=cpu SMALL=1`, so
it cannot rot between GPU leases: the flow a lent GPU runs (the environment check, the layout
without weights, the profile of each stage in process, the benchmark's stack as processes and its
closed and open loops), on the tiny layout in float32; about 75 s on 2 cores, so `slow`
(make test-slow). Its figures say the script works, nothing about a GPU (docs/gpu.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_device_scripts_cpu_dry_run_profiles_every_stage_and_benchmarks_every_level(tmp_path):
    results = tmp_path / "results"
    env = os.environ | {"DEVICE": "cpu", "SMALL": "1", "RESULTS": str(results), "FOLDER": str(tmp_path / "layout"),
                        "PY": sys.executable}
    run = subprocess.run(["bash", "bench/device_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=540)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "imports ok" in (results / "env.txt").read_text()

    profile = json.loads((results / "gpu_steps.json").read_text())
    stages = {stage["stage"]: stage for stage in profile["stages"]}
    assert set(stages) == {"thinker", "talker", "code2wav"}
    for name, stage in stages.items():
        assert [d["batch"] for d in stage["decode"]] == [1, 2] and all(d["step_ms_mean"] > 0 for d in stage["decode"])
        assert (results / stage["profile"]["table"]).is_file(), name
    assert all(p["tokens"] == 25 * p["prompts"] for name in ("thinker", "talker") for p in stages[name]["prefill"])

    bench = json.loads((results / "device_bench.json").read_text())
    assert [m["error"] for m in bench["modes"]] == [None]
    levels = [(level["loop"], level["concurrency"], level["rate_per_s"]) for level in bench["levels"]]
    assert levels == [("closed", 1, None), ("closed", 4, None), ("open", 0, 2.0)]
    for level in bench["levels"]:
        assert level["skipped"] is None and level["errors"] == 0 and level["ttfp_ms_p50"] > 0, level
    assert (results / "device_bench.md").is_file() and (results / "device_bench.png").is_file()
