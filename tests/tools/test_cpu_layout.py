"""The launcher's CPU layout: each talker replica on CPUs of its own, every other process on the
rest (services/tools/launcher.py, `cpu_layout`). On a running stack: tests/e2e/test_cpu_layout.py."""

from __future__ import annotations

import pytest

from services.tools.launcher import cpu_layout


def test_the_talker_takes_the_last_cpus_and_the_rest_share_the_others():
    assert cpu_layout([0, 1], threads=1, talkers=1) == ([frozenset({1})], frozenset({0}))
    talkers, rest = cpu_layout(list(range(16)), threads=5, talkers=1)
    assert talkers == [frozenset(range(11, 16))] and rest == frozenset(range(11))
    talkers, rest = cpu_layout(list(range(8)), threads=2, talkers=2)
    assert talkers == [frozenset({6, 7}), frozenset({4, 5})] and rest == frozenset(range(4))


def test_cpus_the_caller_may_not_use_are_never_handed_out():
    talkers, rest = cpu_layout([2, 5, 7], threads=1, talkers=1)  # e.g. under taskset or a cgroup's cpuset
    assert talkers == [frozenset({7})] and rest == frozenset({2, 5})


@pytest.mark.parametrize("cpus, threads, talkers", [([0], 1, 1), ([0, 1], 1, 2), ([0, 1, 2, 3], 2, 2), ([0, 1], 2, 1)])
def test_no_layout_when_the_other_processes_would_be_left_no_cpu(cpus, threads, talkers):
    assert cpu_layout(cpus, threads, talkers) is None


def test_light_load_cpus_parse_and_refuse_what_is_not_a_cpu_list():
    from services.base.errors import UserError
    from services.serving.placement import parse_cpus

    assert parse_cpus("") is None
    assert parse_cpus("1") == frozenset({1}) and parse_cpus("0,2") == frozenset({0, 2})
    for bad in ("a", "1-3", "-1", "1,,2"):
        with pytest.raises(UserError, match="--light-load-cpus"):
            parse_cpus(bad)
