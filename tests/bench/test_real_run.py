"""One short real run on the tiny checkpoint: the stack, the reference and the floor, every field."""

from __future__ import annotations

import contextlib
import io
import json
import time

import pytest

from bench.harness import main

MAX_TEXT, MAX_TALKER = 8, 12  # 11 frames: a first chunk of 4, then the rest
# Fields that are legitimately empty: optional flags left unset, errors of requests that succeeded.
MAY_BE_NULL = {"error", "voice", "target", "prompts_file", "gateway_url"}


def nulls(value, path="") -> list[str]:
    if isinstance(value, dict):
        return [p for k, v in value.items() if k not in MAY_BE_NULL for p in nulls(v, f"{path}.{k}")]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in nulls(v, f"{path}[{i}]")]
    return [path] if value is None else []


@pytest.fixture(scope="module")
def bench_run(tiny_checkpoint, tmp_path_factory, wav_file, png_file):
    out = tmp_path_factory.mktemp("bench")
    # Level 1 gets prompts 0 and 1, level 2 prompts 2 and 0: a batch mixing text and audio.
    prompts = out / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in (
        {"prompt": "What do you hear?", "audio": str(wav_file)},
        {"prompt": "Describe the picture.", "system": "Answer briefly.", "image": str(png_file)},
        {"prompt": "Hello! How are you today?"},
    )))
    started = time.perf_counter()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["--checkpoint", str(tiny_checkpoint), "--out", str(out), "--prompts", str(prompts),
                     "--concurrency", "1,2", "--requests", "2", "--rounds", "1", "--max-new-tokens", str(MAX_TEXT),
                     "--talker-max-new-tokens", str(MAX_TALKER), "--floor-repeats", "1"])
    return code, out, time.perf_counter() - started, printed.getvalue()


@pytest.mark.slow  # a real bench run (~25 s): make test-slow (and CI) run it
def test_short_real_run_writes_json_and_png_with_every_figure(bench_run):
    code, out, _, _ = bench_run
    assert code == 0
    assert (out / "bench.png").stat().st_size > 10_000
    report = json.loads((out / "bench.json").read_text())
    assert nulls(report) == []  # every figure present, none undefined

    rows = {(r["system"], r["concurrency"]) for r in report["results"]}
    assert rows == {("reference", 1), ("pipeline", 1), ("pipeline-unbatched", 1), ("reference", 2),
                    ("reference-batched", 2), ("pipeline", 2), ("pipeline-unbatched", 2)}
    for row in report["results"]:
        s = row["summary"]
        assert s["requests"] == 2 and s["errors"] == 0
        for figure in ("ttft_ms", "ttfp_ms", "rtf"):
            assert s[figure]["p50"] <= s[figure]["p90"] <= s[figure]["p99"]
        assert s["req_per_s"] > 0 and s["audio_s_per_s"] > 0 and row["ttfp_over_floor"] > 0
        assert set(s["continuity"]) >= {"underruns_per_request", "underrun_s_per_request", "requests_with_underrun"}
    assert {(r["baseline"], r["concurrency"]) for r in report["ratios"]} == {
        ("reference", 1), ("pipeline-unbatched", 1), ("reference", 2), ("reference-batched", 2),
        ("pipeline-unbatched", 2)}
    assert report["skipped"] == [{"system": "reference-batched", "concurrency": 1,
                                  "reason": "a batch of one is the reference row"}]

    floor = report["floor"]
    assert floor["floor_ms"] > 0 and floor["first_chunk_frames"] == 4
    assert set(report["burst_floor"]) == {"2"} and report["burst_floor"]["2"] > 0  # levels above 1
    assert all(s["frames"] == 4 and s["thinker_tokens"] == 4 for s in floor["samples"])

    machine = report["machine"]
    assert machine["cpu_model"] and machine["logical_cores"] >= 1 and machine["torch"]
    jsonl = out / "prompts.jsonl"
    assert report["prompts"] == [f"{jsonl}:1 (text+audio)", f"{jsonl}:2 (text+image)", f"{jsonl}:3 (text)"]

    # Same prompts, greedy, random weights that never stop: every system did the same work.
    requests = report["requests"]
    assert len(requests) == 14  # 7 (system, level) rows x 2 requests
    assert {r["text_tokens"] for r in requests} == {MAX_TEXT}
    assert len({round(r["audio_seconds"], 6) for r in requests}) == 1
    streamed = [r for r in requests if r["system"] == "pipeline"]
    # 4 frames, then 7: in one chunk, or in more where a slow talker cut early (services/runtime/chunking.py)
    assert all(len(r["timeline_s"]["audio"]) >= 2 for r in streamed)
    assert len({r["timeline_s"]["audio_durations"][0] for r in streamed}) == 1  # the first chunk: 4 frames
    assert all(r["ttft_ms"] < r["ttfp_ms"] for r in streamed)

    # Every stage's own metrics, scraped around each pipeline block: where its time went.
    times = {(t["system"], t["concurrency"]): t for t in report["stage_times"]}
    assert set(times) == {("pipeline", 1), ("pipeline", 2), ("pipeline-unbatched", 1), ("pipeline-unbatched", 2)}
    for entry in times.values():
        stages = entry["stages"]
        assert set(stages) == {"thinker-0", "talker-0", "code2wav-0"}
        for name, t in stages.items():
            assert t["steps"] > 0 and t["forward_s"] > 0 and t["process_cpu_s"] > 0, name
            assert 0 < t["forward_s"] + t["engine_s"] <= entry["wall_s"] * 1.05, name  # the engine thread's wall
            assert abs(sum(t["shares"].values()) - 1) < 1e-4, name  # rounded to 6 places in the JSON
        assert stages["talker-0"]["wire_s"] > 0  # text rows decoded, frames encoded


@pytest.mark.slow
def test_short_real_run_prints_the_table(bench_run):
    code, out, wall, printed = bench_run
    assert code == 0
    header = next(line for line in printed.splitlines() if line.startswith("system "))
    for column in ("TTFT ms p50/p90/p99", "TTFP ms p50/p90/p99", "RTF p50/p90/p99", "req/s", "audio s/s",
                   "underruns/req", "TTFP/floor"):
        assert column in header
    assert "system / baseline" in printed and "pipeline / reference" in printed and f"wrote {out / 'bench.json'}" in printed
    assert "burst floor" in printed and "c=2 " in printed
    assert "pipeline stages: where the time goes" in printed and "bottleneck at concurrency 2:" in printed
    # About 25 s on 2 idle cores (stack start-up is half of it); not asserted, as a busy machine may double it.
    print(f"short real run: {wall:.0f} s")


@pytest.mark.slow
@pytest.mark.long
def test_default_run_finishes_within_the_ten_minutes_make_bench_has(tiny_checkpoint, tmp_path):
    started = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(["--checkpoint", str(tiny_checkpoint), "--out", str(tmp_path)])
    wall = time.perf_counter() - started
    assert code == 0
    assert (tmp_path / "bench.json").is_file() and (tmp_path / "bench.png").is_file()
    assert wall < 600, f"default run took {wall:.0f} s"
