"""`omni-bench --gateway`: opt-in, and its report is the gateway's cost against the pipeline."""

from __future__ import annotations

from bench.config import build_parser, config_from_args
from bench.metrics import RequestTiming, summarize
from bench.prompts import BenchPrompt
from bench.report import ResultRow, gateway_cost_for, ratios_for
from bench.systems import GatewaySystem, System


def config(*args: str):
    return config_from_args(build_parser().parse_args(["--checkpoint", "ckpt", *args]))


def test_gateway_is_opt_in():
    assert System.GATEWAY not in config().systems
    assert System.GATEWAY in config("--gateway").systems
    assert System.GATEWAY not in config("--gateway", "--skip", "gateway").systems


def row(system: System, ttft: float, ttfp: float, done: float) -> ResultRow:
    timing = RequestTiming(text_times=(ttft,), audio_times=(ttfp,), audio_durations=(1.0,), done=done)
    return ResultRow(system, 1, summarize([timing, timing], errors=0, wall_s=2 * done), None)


def test_gateway_cost_is_added_latency_and_throughput_ratio():
    results = [row(System.PIPELINE, 0.010, 0.100, 1.0), row(System.GATEWAY, 0.012, 0.105, 1.25)]
    (cost,) = gateway_cost_for(results)
    assert round(cost.added_ttft_ms, 6) == 2.0 and round(cost.added_ttfp_ms, 6) == 5.0
    assert round(cost.req_per_s, 6) == 0.8
    assert ratios_for(results) == []  # the gateway is not a baseline of the pipeline


def test_gateway_request_is_a_streamed_chat_completion_with_pcm16_audio():
    import json

    body = json.loads(GatewaySystem("http://127.0.0.1:1", "chelsie", 16, 5).request(
        BenchPrompt(label="p", text="Hi", system="Be brief.", audio=None, image=None)))
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["audio"] == {"voice": "chelsie", "format": "pcm16"} and body["max_tokens"] == 16
    assert [m["role"] for m in body["messages"]] == ["system", "user"]
