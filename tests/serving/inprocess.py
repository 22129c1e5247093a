"""Stage servers started inside the test process (STYLE point 7), shared by the in-process server
tests of both families (tests/serving/test_servers_in_process.py, test_qwen2_5_servers.py)."""

from __future__ import annotations

import contextlib


@contextlib.asynccontextmanager
async def serving(create, config):
    """A stage server from its factory (`create_server`), started and marked serving; yields its
    loopback address and its engine; stopped (engine loop too) on exit."""
    handle, loop = await create(config)
    await handle.server.start()
    await handle.set_serving(True)
    try:
        yield f"127.0.0.1:{handle.port}", loop.engine
    finally:
        await handle.server.stop(0)
        loop.stop()
