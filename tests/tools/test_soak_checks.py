"""The soak's leak check (services/tools/soak/leaks.py) counts a replica it cannot read as busy: a hung
stage (here a port that accepts connections and never answers, as a SIGSTOPped server does) and a
dead one (nothing listening) must never pass for idle in `wait_settled`, `busy()` or the summary."""

from __future__ import annotations

import socket

from services.tools.soak import Settled, StageLoad, read_load, summarize, wait_settled


def test_a_hung_or_dead_replica_is_never_idle():
    hung = socket.create_server(("127.0.0.1", 0))  # the kernel accepts; no one ever answers
    dead = socket.create_server(("127.0.0.1", 0))
    dead_address = f"127.0.0.1:{dead.getsockname()[1]}"
    dead.close()
    try:
        hung_address = f"127.0.0.1:{hung.getsockname()[1]}"
        for address in (hung_address, dead_address):
            load = read_load("talker", address, timeout=0.5)
            assert not load.reachable and not load.idle, load
        settled = wait_settled({"thinker": (), "talker": (hung_address,), "code2wav": (dead_address,)}, None, 1.0)
        assert not settled.idle
        assert settled.busy() == {f"talker {hung_address}": "unreachable", f"code2wav {dead_address}": "unreachable"}
    finally:
        hung.close()


def test_the_soak_summary_fails_with_an_unreachable_replica():
    loads = (StageLoad("thinker", "a:1"), StageLoad("talker", "b:2", reachable=False))
    summary = summarize([], 0, Settled(loads, None, 0.1), 1.0)
    assert summary.leaked == 0 and summary.unreachable == ["talker b:2"]
    assert not summary.ok
    assert summarize([], 0, Settled(loads[:1], None, 0.1), 1.0).ok
