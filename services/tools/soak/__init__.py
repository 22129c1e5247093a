"""`omni-soak`: a bounded mix of requests against the stack for a given time, then a leak check.

`omni-soak --checkpoint DIR --duration-s 60` starts its own stack (2 talker replicas, tight
admission limits); `--target HOST:PORT` uses a running router instead (with `--router-metrics URL`
or `--stage-address stage=host:port`, so it can read every stage's load at the end). Worker loops
send normal requests, text-only ones, ones cancelled at a random point, ones whose deadline
expires mid-stream, malformed ones, slow readers (a pause after each message) and churn (a
connection of its own, closed once the call ended or after its first message); `--chaos` also
kills a talker replica (SIGKILL) a third of the way in and restarts it. Then it waits for the
stack to settle and reads every stage replica's `GetLoad`: `leaked` is the sum of their in-flight
streams plus the router's admitted requests, and must be 0. Prints the counts (one JSON line with `--json`); exits 1 if anything
leaked or hung, or a request ended in a way its kind never should.

A file a piece: call.py (one call, watched and cancellable), malformed.py, leaks.py (loads, gauges,
settling), mix.py (the kinds of request, chaos, the driver), cli.py (the command, the summary); the
reliability tests (tests/reliability) use them too.
"""

from services.tools.soak.call import Call, CancelPoint, CancelWhen, method_for
from services.tools.soak.cli import main, summarize
from services.tools.soak.leaks import STAGES, Settled, StageLoad, read_load, read_loads, read_router_gauges, wait_settled
from services.tools.soak.malformed import malformed_requests

__all__ = ["STAGES", "Call", "CancelPoint", "CancelWhen", "Settled", "StageLoad", "main", "malformed_requests",
           "method_for", "read_load", "read_loads", "read_router_gauges", "summarize", "wait_settled"]
