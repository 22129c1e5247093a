"""grpc aio's ExecuteBatchError log on a cancelled call becomes one debug line."""

from __future__ import annotations

import logging

from services.serving.grpc_server import setup_logging


def test_execute_batch_error_of_a_cancelled_call_is_not_an_error(caplog):
    setup_logging("test")
    core = logging.getLogger("grpc._cython.cygrpc")
    with caplog.at_level(logging.DEBUG):
        try:
            raise RuntimeError("Failed \"execute_batch\"")
        except RuntimeError:
            core.exception("ExecuteBatchError raised in core by servicer method [/omni.v1.Omni/Generate]")
        core.error("Unexpected [ValueError] raised by servicer method [/omni.v1.Omni/Generate]")
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.getMessage() for r in errors] == ["Unexpected [ValueError] raised by servicer method [/omni.v1.Omni/Generate]"]
    debug = [r for r in caplog.records if r.levelno == logging.DEBUG and "raced the end of the call" in r.getMessage()]
    assert len(debug) == 1 and debug[0].exc_info is None
