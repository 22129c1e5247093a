"""The device benchmark's pure parts, on CPU without a stack: the load loops (a closed loop keeps c
requests in flight over 3c requests; an open loop sends at its seeded arrival times whatever is in
flight), the metrics scrape parser and the level sampler against a local metrics page (no GPU here:
recorded as absent, not an error), and the report made of made-up timelines."""

from __future__ import annotations

import http.server
import json
import statistics
import threading
import time
from dataclasses import asdict

import pytest

from bench import level_sampler
from bench.device_bench import LONG_ANSWER, parse_args
from bench.device_report import LevelResult, ModeResult, Report, StageLevel, Timeline, summarize, write_markdown
from bench.level_sampler import Gauge, LevelSampler, LevelSamples, StageGauges, parse_smi_line
from bench.loop import arrival_times, closed_loop, closed_loop_requests, open_loop
from bench.stage_metrics import StageTimes, interval, parse


class InFlight:
    """A call that sleeps `hold_s(item)` and records how many calls were running as each one started, and when."""

    def __init__(self, hold_s):
        self.hold_s = hold_s
        self.lock = threading.Lock()
        self.running = 0
        self.at_start: list[int] = []
        self.sent: list[float] = []
        self.began = time.perf_counter()

    def __call__(self, item):
        with self.lock:
            self.running += 1
            self.at_start.append(self.running)
            self.sent.append(time.perf_counter() - self.began)
        time.sleep(self.hold_s(item))
        with self.lock:
            self.running -= 1
        return item


# ---- the loops ----

@pytest.mark.parametrize("concurrency", [1, 4, 8])
def test_a_closed_loop_keeps_c_in_flight_over_3c_requests(concurrency):
    n = closed_loop_requests(concurrency, per_client=3)
    assert n == 3 * concurrency
    call = InFlight(lambda item: 0.02 + 0.013 * (item % 3))  # unequal, so the clients do not move in step
    results, wall = closed_loop(list(range(n)), concurrency, call, lambda exc: None)
    assert results == list(range(n))  # every request ran once, results in the items' order
    assert max(call.at_start) == concurrency  # never more than c
    # A client sends its next request as its last one ends: apart from the first c starts (the
    # batch filling), each start finds the other c - 1 clients' requests still running.
    assert statistics.median(call.at_start[concurrency:]) == concurrency
    assert wall >= 3 * 0.02  # three requests back to back per client


def test_closed_loop_requests_is_per_client_times_c_with_a_floor():
    assert closed_loop_requests(64, 3) == 192
    assert closed_loop_requests(1, 3, minimum=4) == 4
    assert closed_loop_requests(32, 4, minimum=4) == 128


def test_a_failed_call_is_its_result_and_the_loop_goes_on():
    def call(item):
        if item == 2:
            raise RuntimeError("boom")
        return item

    results, _ = closed_loop([0, 1, 2, 3], 2, call, lambda exc: f"failed: {exc}")
    assert results == [0, 1, "failed: boom", 3]
    results, _ = open_loop([0, 1, 2, 3], 200.0, call, lambda exc: f"failed: {exc}")
    assert results == [0, 1, "failed: boom", 3]


def test_arrival_times_are_a_seeded_poisson_process():
    times = arrival_times(4000, 20.0, seed=3)
    assert times[0] == 0.0 and times == sorted(times)
    assert times == arrival_times(4000, 20.0, seed=3)  # two runs offer the same load
    assert times != arrival_times(4000, 20.0, seed=4)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert statistics.fmean(gaps) == pytest.approx(1 / 20.0, rel=0.05)
    assert statistics.pstdev(gaps) == pytest.approx(1 / 20.0, rel=0.1)  # exponential: sd = mean
    with pytest.raises(ValueError):
        arrival_times(3, 0.0)


def test_an_open_loop_sends_at_its_arrival_times_whatever_is_in_flight():
    call = InFlight(lambda item: 0.6)  # each request outlasts every arrival gap
    results, wall = open_loop(list(range(6)), 40.0, call, lambda exc: None, seed=1)
    assert results == list(range(6))
    expected = arrival_times(6, 40.0, seed=1)
    assert expected[-1] < 0.3
    assert max(call.at_start) == 6  # none waited for another to end
    assert all(abs(s - call.sent[0] - e) < 0.1 for s, e in zip(call.sent, expected))
    assert expected[-1] + 0.6 <= wall < expected[-1] + 1.2


def test_the_flags_keep_3c_requests_and_the_long_answer_mode():
    args = parse_args(["--checkpoint", "x", "--out", "y", "--levels", "64,1,32", "--rates", "2,4.5",
                       "--gpu-sharing", "none,mps"])
    assert args.levels == [1, 32, 64] and args.rates == [2.0, 4.5]
    assert [s.value for s in args.gpu_sharing] == ["none", "mps"]
    with pytest.raises(SystemExit):
        parse_args(["--checkpoint", "x", "--out", "y", "--requests-per-client", "2"])
    with pytest.raises(SystemExit):
        parse_args(["--checkpoint", "x", "--out", "y", "--rates", "0"])
    long = parse_args(["--checkpoint", "x", "--out", "y", "--long-answer"])
    assert (long.thinker_tokens, long.talker_tokens) == LONG_ANSWER[:2]
    assert 200 <= long.talker_tokens - 1 <= 400  # talker frames: the steady state
    assert long.max_model_len >= LONG_ANSWER[2]


# ---- the stages' metrics and the GPU ----

PAGE = """# HELP omni_stage_step_seconds Engine step wall time
# TYPE omni_stage_step_seconds histogram
omni_stage_step_seconds_bucket{le="0.01",stage="talker"} 3.0
omni_stage_step_seconds_bucket{le="+Inf",stage="talker"} 10.0
omni_stage_step_seconds_count{stage="talker"} 10.0
omni_stage_step_seconds_sum{stage="talker"} 0.5
# TYPE omni_stage_batch_size histogram
omni_stage_batch_size_count{stage="talker"} 10.0
omni_stage_batch_size_sum{stage="talker"} 40.0
# TYPE omni_stage_loop_seconds counter
omni_stage_loop_seconds_total{phase="forward",stage="talker"} 0.4
omni_stage_loop_seconds_total{phase="engine",stage="talker"} 0.1
omni_stage_loop_seconds_total{phase="idle",stage="talker"} 1.5
# TYPE omni_stage_queue_depth gauge
omni_stage_queue_depth{stage="talker"} 3.0
# TYPE omni_stage_running_batch gauge
omni_stage_running_batch{stage="talker"} 4.0
"""


def test_the_scrape_parser_reads_labelled_samples_into_stage_times():
    samples = parse(PAGE)
    assert samples[("omni_stage_queue_depth", (("stage", "talker"),))] == 3.0
    assert samples[("omni_stage_step_seconds_bucket", (("le", "+Inf"), ("stage", "talker")))] == 10.0
    after = StageTimes.from_samples(samples, "talker")
    assert (after.steps, after.step_s, after.batch_sum, after.forward_s, after.idle_s) == (10, 0.5, 40, 0.4, 1.5)
    before = StageTimes(steps=2, step_s=0.1, batch_sum=4, batch_steps=2, forward_s=0.08, engine_s=0.02)
    level = interval({"talker-0": before}, {"talker-0": after, "code2wav-0": after})
    assert list(level) == ["talker-0"]  # a stage scraped only once is left out
    row = StageLevel.of(level["talker-0"], None, wall_s=2.0)
    assert (row.steps, row.step_ms_mean, row.batch_mean) == (8, 50.0, 4.5)
    assert row.forward_share == pytest.approx(0.8) and row.busy_share == pytest.approx(0.2)
    assert row.queue_depth == Gauge(None, None, 0)


def test_nvidia_smi_lines_parse_and_not_available_is_skipped():
    assert parse_smi_line("0, 87, 40960\n") == (0, 87.0, 40960.0)
    assert parse_smi_line("1, [N/A], 1024") is None
    assert parse_smi_line("") is None


@pytest.fixture
def metrics_page():
    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = PAGE.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()
    server.server_close()


def test_the_sampler_reads_each_stage_gauges_and_records_a_missing_gpu_as_absent(metrics_page, monkeypatch):
    monkeypatch.setattr(level_sampler, "_nvml", lambda: None)
    monkeypatch.setattr(level_sampler, "SMI", "nvidia-smi-not-on-this-machine")
    endpoints = {"talker-0": ("talker", metrics_page), "gone-0": ("thinker", "http://127.0.0.1:9/metrics")}
    with LevelSampler(endpoints, interval_s=0.05, gpu=True) as sampler:
        time.sleep(0.3)
    result = sampler.result()
    talker = result.stages["talker-0"]
    assert talker.queue_depth.samples >= 2 and (talker.queue_depth.mean, talker.running.max) == (3.0, 4.0)
    assert result.stages["gone-0"].queue_depth == Gauge(None, None, 0)  # a stage that does not answer: no samples
    assert result.gpus == [] and result.gpu_source.startswith("absent")
    with LevelSampler({}, interval_s=0.05, gpu=False) as cpu:
        pass
    assert cpu.result().gpu_source.startswith("off") and cpu.result().gpus == []


# ---- the report ----

def timeline(i: int, first: float, gap: float, chunks: int = 4, chunk_s: float = 1.0) -> Timeline:
    audio = tuple(round(first + k * gap, 4) for k in range(chunks))
    return Timeline(f"r{i}", sent_s=i * 0.1, text_times_s=(0.05,), audio_times_s=audio,
                    audio_chunk_s=(chunk_s,) * chunks, done_s=audio[-1] + 0.01)


def test_a_level_reports_ttfp_streaming_rtf_and_audio_per_gpu_apart():
    # Two requests stream a 1 s chunk every 0.5 s (streaming RTF 0.5) after TTFPs of 0.4 and 2.0 s;
    # a third fails.
    timelines = [timeline(0, 0.4, 0.5), timeline(1, 2.0, 0.5), Timeline("r2", 0.2, error="UNAVAILABLE: gone")]
    times = StageTimes(steps=10, step_s=1.0, batch_sum=20, batch_steps=10, forward_s=0.6, engine_s=0.2)
    samples = LevelSamples(0.5, "nvml", {"talker-0": StageGauges(Gauge(1.0, 2.0, 4), Gauge(2.0, 2.0, 4))},
                           [level_sampler.GpuGauges(0, Gauge(55.0, 90.0, 4), Gauge(1000.0, 1000.0, 4))])
    row = summarize(LevelResult("on", 2, 3), timelines, wall_s=4.0, gpus=2, stages={"talker-0": times},
                    samples=samples)
    assert (row.requests, row.errors, row.first_error) == (3, 1, "UNAVAILABLE: gone")
    assert row.ttfp_ms_p50 == pytest.approx(1200.0) and row.ttfp_ms_p99 == pytest.approx(1984.0)
    assert row.streaming_rtf_p50 == pytest.approx(0.5) and row.streaming_rtf_p99 == pytest.approx(0.5)
    assert row.rtf_p50 == pytest.approx((1.9 + 3.5) / 2 / 4)  # TTFP included
    assert row.underrun_requests == 0
    assert row.req_per_s == pytest.approx(0.5)
    assert row.audio_s_per_s == pytest.approx(2.0) and row.audio_s_per_s_per_gpu == pytest.approx(1.0)
    assert row.stages["talker-0"].batch_mean == 2.0 and row.stages["talker-0"].queue_depth.max == 2.0
    assert row.gpu_source == "nvml" and row.gpus[0].util_pct.mean == 55.0
    assert row.timelines == timelines  # kept in the JSON


def test_a_player_that_runs_dry_is_an_underrun_and_one_chunk_has_no_streaming_rtf():
    slow = timeline(0, 0.3, 1.5)  # a 1 s chunk every 1.5 s: streaming RTF 1.5
    single = timeline(1, 0.3, 0.5, chunks=1)
    row = summarize(LevelResult("on", 1, 2), [slow, single], 5.0, 1, {}, None)
    assert row.streaming_rtf_p50 == pytest.approx(1.5)  # the single chunk's request has none
    assert row.underrun_requests == 1
    assert row.gpu_source is None and row.stages == {}


def test_the_report_is_json_and_markdown_with_skipped_levels_named(tmp_path):
    config = {"label": "Tiny", "dtype": "float32", "device": "cpu", "thinker_tokens": 6, "talker_tokens": 12, "gpus": 1}
    report = Report(config=config, machine={"accelerators": []}, modes=[ModeResult("on", "mps", mps=False)])
    report.levels.append(summarize(LevelResult("on", 2, 2, "mps"), [timeline(0, 0.4, 0.5), timeline(1, 0.6, 0.5)],
                                   2.0, 1, {"talker-0": StageTimes(steps=4, step_s=0.2)}, None))
    report.levels.append(LevelResult("on", 0, 8, "mps", loop="open", rate_per_s=2.5, skipped="time: 3 s left"))
    data = json.loads(json.dumps(asdict(report)))
    assert data["levels"][0]["streaming_rtf_p50"] == pytest.approx(0.5)
    assert data["levels"][0]["timelines"][1]["audio_times_s"] == [0.6, 1.1, 1.6, 2.1]
    path = tmp_path / "device_bench.md"
    write_markdown(report, path)
    text = path.read_text()
    assert "| on | mps | c=2 | 2 | 500 / 598 | 0.500 / 0.500 |" in text
    assert "| on | mps | 2.5/s | - | skipped: time: 3 s left |" in text
    assert "| on | mps | c=2 | talker-0 | 4 | 50.00 |" in text
    assert "sharing mps (MPS did not start)" in text
