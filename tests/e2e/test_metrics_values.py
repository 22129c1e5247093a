"""Metrics hold the values a known workload implies (not just that they exist).

A stack of its own (fresh counters), every process serving /metrics. The workload runs one request
at a time, so every engine step has a batch of one and the step counts follow from the lengths:
the thinker makes one token per step (prefill included), the talker one code per step (its last
code gets no frame), code2wav one step per decode, each sending one audio chunk (a block of its
grid: 4, then 8, 9 frames = 4 + 5; the open second block is decoded once the end came or, where the
start-up check lets open blocks be decoded, when its listener needs it, so a slow talker can cut it
in more decodes), and one for the end of the stream.
"""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest

from services.tools.client import build_request, collect, connect
from services.tools.launcher import free_port
from services.tools.soak import read_loads, read_router_gauges
from tests.stacks import stack_of

# slow: a stack of its own (fresh counters, every process's metrics port): ~20 s of make test's 2 cores;
# make test-slow (CI) runs it.
pytestmark = pytest.mark.slow

AUDIO_REQUESTS, TEXT_REQUESTS = 3, 2
TEXT_TOKENS, TALKER_TOKENS = 4, 10  # 9 frames each: chunks of 4 and 5
TEXT_ONLY_TOKENS = 5


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def measured(tiny_checkpoint):
    ports = {name: free_port() for name in ("router", "thinker", "talker", "code2wav")}
    flag = lambda name: ("--metrics-port", str(ports[name]))  # noqa: E731
    with stack_of(tiny_checkpoint, thinker_args=flag("thinker"), talker_args=flag("talker"),
                  code2wav_args=flag("code2wav"), router_args=flag("router")) as stack:
        channel, omni = connect(stack.target)
        chunks = 0  # audio chunks, one per code2wav decode
        with channel:
            for i in range(AUDIO_REQUESTS):
                got = collect(omni, build_request(f"audio {i}", max_new_tokens=TEXT_TOKENS,
                                                  talker_max_new_tokens=TALKER_TOKENS), timeout=120)
                assert len(got.thinker_token_ids) == TEXT_TOKENS and got.final.usage.codec_frames == TALKER_TOKENS - 1
                assert len(got.audio_chunks) >= 2  # the block of 4 and the rest
                chunks += len(got.audio_chunks)
            for i in range(TEXT_REQUESTS):
                got = collect(omni, build_request(f"text {i}", text_only=True, max_new_tokens=TEXT_ONLY_TOKENS),
                              timeout=120)
                assert len(got.thinker_token_ids) == TEXT_ONLY_TOKENS
            after_ok = {name: scrape(port) for name, port in ports.items() if name != "router"}
            with pytest.raises(grpc.RpcError) as bad:
                collect(omni, build_request("hi", voice="nobody"), timeout=60)
            assert bad.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            # Text only, and long: the cancel lands before it ends and it can never have a first audio
            # (with audio, a loaded machine can relay the first chunk before the cancel reaches the
            # router, and its TTFP would count). Cancels through the talker and code2wav are
            # tests/reliability/test_aborts_stop_work.py's.
            cancelled = omni.Generate(build_request("cancel me", text_only=True, max_new_tokens=2000), timeout=120)
            next(iter(cancelled))  # started: the first response is here
            cancelled.cancel()
            replicas = {stage: tuple(stack.addresses(stage)) for stage in ("thinker", "talker", "code2wav")}
            deadline = time.monotonic() + 60
            while not all(load.idle for load in read_loads(replicas)):
                assert time.monotonic() < deadline, "stages still busy"
                time.sleep(0.05)
            # The router's own counts, not a fixed wait: it has ended every request (its outcome
            # counter, incremented as each handler ends: the cancelled one too), holds none, and its
            # last poll of every stage saw them idle.
            sent = AUDIO_REQUESTS + TEXT_REQUESTS + 2  # the refused one and the cancelled one
            while True:
                router = read_router_gauges(f"http://127.0.0.1:{ports['router']}/metrics")
                if (sum(router.outcomes.values()) == sent and router.in_flight == router.queue_depth == 0
                        and not any(router.reported.values())):
                    break
                assert time.monotonic() < deadline, (router.outcomes, router.in_flight, router.reported)
                time.sleep(0.05)
            final = {name: scrape(port) for name, port in ports.items()}
            yield after_ok, final, chunks


def test_router_outcomes_and_latency_histograms_count_the_workload(measured):
    router = measured[1]["router"]
    assert value(router, "omni_router_requests_total", outcome="ok") == AUDIO_REQUESTS + TEXT_REQUESTS
    assert value(router, "omni_router_requests_total", outcome="invalid_argument") == 1
    assert value(router, "omni_router_requests_total", outcome="cancelled") == 1
    assert value(router, "omni_router_requests_total", outcome="rejected") == 0
    # Every request that produced text (the OK ones and the cancelled one) has a TTFT; audio ones a TTFP.
    assert value(router, "omni_router_ttft_seconds_count") == AUDIO_REQUESTS + TEXT_REQUESTS + 1
    assert value(router, "omni_router_ttfp_seconds_count") == AUDIO_REQUESTS
    assert value(router, "omni_router_rtf_count") == AUDIO_REQUESTS  # the cancelled one never finished
    assert value(router, "omni_router_rtf_sum") > 0
    assert value(router, "omni_router_in_flight") == 0 and value(router, "omni_router_queue_depth") == 0


def test_stage_batch_slot_and_queue_figures_follow_from_the_lengths(measured):
    after_ok, final, chunks = measured
    thinker, talker, code2wav = after_ok["thinker"], after_ok["talker"], after_ok["code2wav"]
    thinker_steps = AUDIO_REQUESTS * TEXT_TOKENS + TEXT_REQUESTS * TEXT_ONLY_TOKENS
    talker_steps = AUDIO_REQUESTS * TALKER_TOKENS
    code2wav_steps = chunks + AUDIO_REQUESTS  # a decode per chunk, then the end
    for samples, stage, steps in ((thinker, "thinker", thinker_steps), (talker, "talker", talker_steps),
                                  (code2wav, "code2wav", code2wav_steps)):
        count = value(samples, "omni_stage_batch_size_count", stage=stage)
        assert count == steps, (stage, count, steps)
        assert value(samples, "omni_stage_batch_size_sum", stage=stage) == count, stage  # every batch was 1
        assert value(samples, "omni_stage_batch_size_bucket", stage=stage, le="1.0") == count, stage
        assert value(samples, "omni_stage_step_seconds_count", stage=stage) >= count, stage
    for stage in ("thinker", "talker", "code2wav"):  # after the cancel too: nothing held anywhere
        for gauge in ("omni_stage_queue_depth", "omni_stage_running_batch", "omni_stage_cache_slots_used",
                      "omni_stage_in_flight"):
            assert value(final[stage], gauge, stage=stage) == 0, (stage, gauge)
    for stage in ("thinker", "talker"):
        assert value(final[stage], "omni_stage_cache_slots", stage=stage) > 0, stage
    for stage in ("thinker", "talker", "code2wav"):  # Linux schedstat: some wakeup always waits a little
        waited = value(final[stage], "omni_stage_process_cpu_wait_seconds", stage=stage)
        assert 0 < waited < value(final[stage], "omni_stage_process_cpu_seconds", stage=stage) + 60, stage


def test_every_process_froze_its_start_up_heap_and_reports_its_collections(measured):
    # services/serving/gc_heap.py: a full collection over a stage's start-up heap stalls it for a
    # quarter of a second; frozen, collections skip it. Each gc pause is a histogram sample.
    final = measured[1]
    for name, samples in final.items():
        assert value(samples, "omni_gc_frozen_objects") > 10_000, name
        collections = sum(value(samples, "omni_gc_pause_seconds_count", generation=str(g)) for g in range(3))
        assert collections > 0, name
        assert value(samples, "omni_gc_pause_seconds_bucket", generation="0", le="+Inf") == \
            value(samples, "omni_gc_pause_seconds_count", generation="0"), name


def test_the_lm_stages_export_the_kernel_path_their_probe_chose_for_each_op(measured):
    # One series per op with value 1 (services/runtime/lm/invariance.py): what exact batching runs here.
    final = measured[1]
    for stage in ("thinker", "talker"):
        series = {dict(labels)["op"]: dict(labels)["path"] for (name, labels), v in final[stage].items()
                  if name == "omni_exact_kernel_info" and v == 1}
        prefix = series.pop("prefix_hit", None)  # the thinker's and talker's prefix caches (on by default)
        assert set(series) == {"linear", "experts", "attention"}, stage
        assert set(series.values()) <= {"rows", "batched"}, stage  # gemm only with --exact-batching gemm
        # per-row kernels: a prefill from cached blocks is not the cold one's bits, so hits are refused
        assert prefix == "refused", stage
    thinker = {dict(labels)["op"]: dict(labels)["path"] for (name, labels), _ in final["thinker"].items()
               if name == "omni_exact_kernel_info"}
    assert thinker["attention"] == "rows"  # the thinker attends per row over each row's own slot
