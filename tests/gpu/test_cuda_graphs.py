"""services/runtime/lm/cuda_graphs.py on CPU: bucket choice, padding plans, flags, and the eager
fallback of GraphRunner (what CPU runs). Capture and replay need a GPU: bench/device_check.sh."""

from __future__ import annotations

import argparse

import pytest
import torch

from services.base.errors import UserError
from services.runtime.lm.cuda_graphs import (
    GraphRunner,
    PaddingPlan,
    pad_rows,
    pick_bucket,
    plan_padding,
)
from services.runtime.model.settings import (
    DEFAULT_BUCKETS,
    GraphSettings,
    add_model_flags,
    graphs_wanted,
    model_config_from_args,
    parse_buckets,
)


@pytest.mark.parametrize("batch, bucket", [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (17, 32), (33, 64), (64, 64)])
def test_pick_bucket_takes_the_smallest_bucket_that_holds_the_batch(batch, bucket):
    assert pick_bucket(batch, DEFAULT_BUCKETS) == bucket


def test_pick_bucket_is_none_above_the_largest_bucket():
    assert pick_bucket(65, DEFAULT_BUCKETS) is None
    assert pick_bucket(3, (2,)) is None


def test_pick_bucket_reads_unsorted_buckets_and_rejects_empty_batches():
    assert pick_bucket(3, (8, 1, 4)) == 4
    with pytest.raises(ValueError):
        pick_bucket(0, DEFAULT_BUCKETS)


def test_padding_plan_counts_the_padded_rows():
    assert plan_padding(5, DEFAULT_BUCKETS) == PaddingPlan(batch=5, bucket=8)
    assert plan_padding(5, DEFAULT_BUCKETS).pad == 3
    assert plan_padding(8, DEFAULT_BUCKETS).pad == 0
    assert plan_padding(100, DEFAULT_BUCKETS) is None


def test_pad_rows_repeats_row_zero_or_the_fill_row_and_keeps_the_real_rows_first():
    x = torch.arange(6).view(3, 2)
    plan = PaddingPlan(3, 4)
    assert pad_rows(x, plan).tolist() == [[0, 1], [2, 3], [4, 5], [0, 1]]
    assert pad_rows(x, plan, fill=torch.tensor([9, 9])).tolist()[-1] == [9, 9]
    positions = torch.arange(12).view(4, 3, 1)  # [4, B, 1]: pad along dim 1
    padded = pad_rows(positions, PaddingPlan(3, 8), dim=1)
    assert padded.shape == (4, 8, 1)
    assert torch.equal(padded[:, :3], positions) and torch.equal(padded[:, 7], positions[:, 0])
    assert pad_rows(x, PaddingPlan(3, 3)) is x
    with pytest.raises(ValueError):
        pad_rows(x, PaddingPlan(2, 4))


def test_parse_buckets_sorts_and_validates():
    assert parse_buckets("8, 1,4,4") == (1, 4, 8)
    for bad in ("", "0,1", "a", "-2"):
        with pytest.raises(UserError):
            parse_buckets(bad)


@pytest.mark.parametrize("flag, device, on", [("auto", "cpu", False), ("auto", "cuda", True), ("auto", "cuda:1", True),
                                              ("off", "cuda", False), ("on", "cuda:0", True), ("off", "cpu", False)])
def test_graphs_default_on_for_cuda_and_off_for_cpu(flag, device, on):
    assert graphs_wanted(flag, device) is on


def test_graphs_on_for_cpu_is_refused():
    with pytest.raises(UserError, match="cuda"):
        graphs_wanted("on", "cpu")


def test_model_flags_reach_the_model_config():
    parser = argparse.ArgumentParser()
    add_model_flags(parser)
    cpu = model_config_from_args(parser.parse_args(["--checkpoint", "x"]))
    assert cpu.graphs == GraphSettings(False, DEFAULT_BUCKETS) and not cpu.random_weights
    cuda = model_config_from_args(parser.parse_args(
        ["--checkpoint", "x", "--device", "cuda", "--graph-buckets", "1,8", "--random-weights", "--random-seed", "3"]))
    assert cuda.graphs == GraphSettings(True, (1, 8)) and cuda.random_weights and cuda.random_seed == 3
    off = model_config_from_args(parser.parse_args(["--checkpoint", "x", "--device", "cuda", "--cuda-graphs", "off"]))
    assert not off.graphs.enabled


def test_disabled_runner_calls_the_function_directly():
    weight = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))

    def step(x, y):
        return x @ weight.t(), y * 2

    runner = GraphRunner(step, enabled=False, name="test")
    x, y = torch.randn(5, 3), torch.arange(5)
    got = runner((5,), x, y)
    want = step(x, y)
    assert isinstance(got, tuple) and len(got) == 2
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    single = GraphRunner(lambda x: x + 1, enabled=False)((1,), x)
    assert isinstance(single, tuple) and torch.equal(single[0], x + 1)
    assert runner.stats.eager_calls == 1 and runner.stats.captures == 0
    assert runner.capture((5,), x, y) is None  # capture is a no-op when disabled


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_enabled_runner_without_cuda_is_refused():
    with pytest.raises(UserError, match="CUDA"):
        GraphRunner(lambda x: x, enabled=True)


@pytest.mark.exactness
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_replayed_graph_equals_the_eager_call_on_cuda():
    weight = torch.randn(64, 32, device="cuda")
    runner = GraphRunner(lambda x: torch.relu(x @ weight.t()), enabled=True)
    for batch in (1, 3, 3, 8):
        x = torch.randn(batch, 32, device="cuda")
        (got,) = runner((batch,), x)
        torch.testing.assert_close(got, torch.relu(x @ weight.t()))
    assert runner.stats.captures == 3 and runner.stats.replays == 4 and runner.stats.failed is None


def test_a_batch_above_the_largest_bucket_is_left_to_the_eager_step_logged_once(caplog):
    runner = GraphRunner(lambda x: x, enabled=False, name="thinker decode")
    with caplog.at_level("WARNING"):
        assert runner.plan(3, (1, 2, 4)) == PaddingPlan(3, 4)
        assert runner.plan(9, (1, 2, 4)) is None and runner.plan(12, (1, 2, 4)) is None
    said = [r.getMessage() for r in caplog.records if "above the largest CUDA graph bucket" in r.getMessage()]
    assert said == ["thinker decode: a batch of 9 is above the largest CUDA graph bucket (4): such batches run "
                    "eagerly, batched (logged once)"]
