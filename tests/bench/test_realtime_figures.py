"""`omni-bench --realtime`'s levels and the service figures it reads off two scrapes of /metrics
(turn detection's CPU per second of audio, the event loops' lag p99), on made-up expositions."""

from __future__ import annotations

import pytest

from bench.config import realtime_levels
from bench.realtime import ServiceMetrics
from bench.stage_metrics import histogram_quantile, parse
from services.base.errors import UserError


def exposition(cpu: float, audio: float, lag: dict[str, int], name: str) -> str:
    """Prometheus text: the two detection counters and a lag histogram (cumulative bucket counts)."""
    lines = [f"omni_session_turn_detection_cpu_seconds_total {cpu}",
             f"omni_session_turn_detection_audio_seconds_total {audio}"]
    lines += [f'{name}_bucket{{le="{le}"}} {count}' for le, count in lag.items()]
    return "\n".join(lines) + "\n"


def test_realtime_levels_take_a_list_as_given_and_one_n_as_1_and_n():
    assert realtime_levels("1,8,32") == (1, 8, 32)
    assert realtime_levels("8") == (1, 8)
    assert realtime_levels("1") == (1,)
    assert realtime_levels("") == ()
    with pytest.raises(UserError, match="--realtime"):
        realtime_levels("8,x")


def test_the_lag_p99_is_the_bucket_bound_of_the_observations_between_two_scrapes():
    name = "omni_session_loop_lag_seconds"
    before = parse(exposition(0, 0, {"0.005": 100, "0.05": 100, "+Inf": 100}, name))
    # 100 more observations: 98 within 5 ms, 1 within 50 ms, 1 beyond: p99 is the 50 ms bucket's
    after = parse(exposition(0, 0, {"0.005": 198, "0.05": 199, "+Inf": 200}, name))
    assert histogram_quantile(before, after, name, 0.99) == 0.05
    assert histogram_quantile(before, after, name, 0.5) == 0.005
    assert histogram_quantile(after, after, name, 0.99) is None  # nothing observed between


def test_the_service_figures_are_differences_over_the_level():
    router = "omni_router_loop_lag_seconds"
    sessions = "omni_session_loop_lag_seconds"
    before = (parse(exposition(1.0, 100.0, {"0.01": 10, "+Inf": 10}, sessions)),
              parse(exposition(0, 0, {"0.01": 10, "+Inf": 10}, router)))
    after = (parse(exposition(1.5, 200.0, {"0.01": 20, "+Inf": 20}, sessions)),
             parse(exposition(0, 0, {"0.01": 10, "+Inf": 30}, router)))
    figures = ServiceMetrics("127.0.0.1", 1, 2).figures(before, after)
    assert figures == {"detection_cpu_ms_per_s": 5.0, "sessions_lag_p99_ms": 10.0, "router_lag_p99_ms": float("inf")}
