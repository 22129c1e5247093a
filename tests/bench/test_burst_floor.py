"""The burst floor (bench/floor.py): n requests arriving together, driven through the services'
engines in-process, each to its first audio; the engines hold nothing afterwards."""

from __future__ import annotations

import pytest

from bench.floor import FloorMeter
from bench.prompts import built_in_prompts
from services.tools.reference import ReferenceRunner

MAX_TEXT, MAX_TALKER = 8, 12

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.fixture(scope="module")
def meter(tiny_checkpoint) -> FloorMeter:
    return FloorMeter(ReferenceRunner(tiny_checkpoint), "cpu", None, MAX_TEXT, MAX_TALKER)


def assert_engines_empty(meter: FloorMeter) -> None:
    for engine in (meter.lms.thinker, meter.lms.talker):
        assert engine.running == 0 and engine.queue_depth == 0 and not engine.has_work()


@pytest.mark.slow  # 7 s: a burst through the in-process floor: make test-slow (CI)
def test_every_request_of_a_burst_reaches_its_first_audio_and_nothing_is_left(meter):
    prompts = built_in_prompts()[:5]
    times = meter.measure_burst(prompts)
    assert len(times) == 5 and times == sorted(times) and times[0] > 0
    assert_engines_empty(meter)
    # Again on the same engines: a second burst is not disturbed by the first.
    assert len(meter.measure_burst(prompts)) == 5
    assert_engines_empty(meter)
