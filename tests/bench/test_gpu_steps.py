"""bench/probes/gpu_steps.py on CPU: it finds the graph runners it times wherever an engine keeps
them, and (slow) its dry run on the tiny checkpoint writes every phase of every stage to its JSON."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from bench.probes import gpu_steps
from services.runtime.lm.cuda_graphs import GraphRunner


class Vocoder:
    def __init__(self):
        self.runner = GraphRunner(lambda x: x, enabled=False, name="windows")

    def decode(self, codes):
        return self.runner(0, codes)


def test_graph_runners_are_found_behind_hooks_and_bound_methods():
    decode = GraphRunner(lambda x: x, enabled=False, name="decode")
    predictor = GraphRunner(lambda x: x, enabled=False, name="predictor")
    engine = SimpleNamespace(graphs=SimpleNamespace(runner=decode), predictor_graphs=SimpleNamespace(runner=predictor),
                             vocode=Vocoder().decode, model=torch.nn.Linear(2, 2), cache=torch.zeros(2))
    engine.itself = engine  # cycles end
    assert sorted(r.name for r in gpu_steps.find_runners(engine)) == ["decode", "predictor", "windows"]
    assert gpu_steps.find_runners(SimpleNamespace(model=torch.nn.Linear(2, 2))) == []


@pytest.mark.slow
def test_the_cpu_dry_run_writes_each_stage_phases(tiny_checkpoint, tmp_path):
    code = gpu_steps.main(["--checkpoint", str(tiny_checkpoint), "--out", str(tmp_path), "--device", "cpu",
                           "--dtype", "float32", "--batches", "1,2", "--steps", "2", "--warmup", "1",
                           "--profile-batch", "2", "--profile-steps", "1", "--max-model-len", "128",
                           "--buckets", "1,2", "--threads", "1"])
    assert code == 0
    report = json.loads((tmp_path / "gpu_steps.json").read_text())
    stages = {s["stage"]: s for s in report["stages"]}
    assert list(stages) == ["thinker", "talker", "code2wav"]
    for name, stage in stages.items():
        assert stage["error"] is None and stage["build_s"] is not None
        assert [d["batch"] for d in stage["decode"]] == [1, 2]
        assert all(d["steps"] == 2 and d["step_ms_p50"] > 0 and d["syncs_per_step"] is None for d in stage["decode"])
        assert stage["profile"]["batch"] == 2 and (tmp_path / stage["profile"]["table"]).is_file()
        if name != "code2wav":  # code2wav has no prompt to prefill
            assert [(p["prompts"], p["tokens"]) for p in stage["prefill"]] == [(1, 25), (2, 50)]
            assert all(p["steps"] >= 1 for p in stage["prefill"])
