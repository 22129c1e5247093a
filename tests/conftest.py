"""Shared fixtures: the tiny checkpoint, built once per session, and small input files.

Processes (stage servers, the router) are started through tests/stacks.py only, so every test
area shares one way of doing it.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pytest

from tests.threads import configured_threads, torch_threads

# `make test-vllm` sets this: the vLLM tests are what the run is for, so vLLM failing to import is
# an error of the run (exit 4), not 11 skips and a green exit.
REQUIRE_VLLM = "OMNI_REQUIRE_VLLM"

# Every process a test starts inherits this: on SIGTERM, stop at once rather than keep taking calls
# for 2 s while routers notice NOT_SERVING (that delay is for production's probes; every stack's
# teardown paid it). The drain tests set --drain-delay-s themselves; the k8s tests drop OMNI_*.
os.environ.setdefault("OMNI_DRAIN_DELAY_S", "0")


def pytest_report_header(config) -> str:
    from tests.fuzzing import SEED, SEED_ENV

    return f"fuzz seed: {SEED} (replay the fuzz tests' cases with {SEED_ENV}={SEED})"


def pytest_terminal_summary(terminalreporter) -> None:
    from tests.fuzzing import SEED, SEED_ENV

    terminalreporter.write_line(f"fuzz seed: {SEED} ({SEED_ENV}={SEED} replays the fuzz tests' cases)")


def pytest_configure(config) -> None:
    from tests.fuzzing import SEED, SEED_ENV

    os.environ[SEED_ENV] = str(SEED)  # xdist's workers start later, from this environment: one seed per run
    if "OMNI_CHECK_CACHE" not in os.environ:
        # Start-up check verdicts (services/runtime/checks.py) kept for this run only: a
        # stage a test starts never adopts one a run before it kept in the user's cache.
        import tempfile

        os.environ["OMNI_CHECK_CACHE"] = tempfile.mkdtemp(prefix="omni-checks-")
    try:
        threads = configured_threads()
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    workers = getattr(config, "workerinput", {}).get("workercount")
    if threads is None and workers:
        # Under xdist, each worker's in-process torch gets its share of the cores (at least one):
        # workers each with torch's default of one thread a core ran the compute tests 2-4x slower.
        threads = max(1, (os.cpu_count() or 1) // int(workers))
    if (configured_threads() or 1) > 1:
        # Stage processes on several threads each share the cores with up to seven others (the
        # migration stack has 8 processes): OpenMP's default wait policy spins at every barrier, and
        # on 2 cores at 2 threads they starved each other (a code2wav start-up ran past its 180 s).
        # A passive wait sleeps instead; how an op splits its work, and so its bits, is unchanged.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if threads is not None:
        # OMNI_TEST_THREADS (tests/threads.py) sets it for every process, xdist or not. Tests about
        # thread counts set their own; stage processes get --threads from tests/stacks.py.
        import torch

        torch.set_num_threads(threads)
    if os.environ.get(REQUIRE_VLLM) == "1":
        from services.thinker.vllm_backend import vllm_available

        ok, detail = vllm_available()
        if not ok:
            raise pytest.UsageError(f"{REQUIRE_VLLM}=1 but vLLM does not import: {detail} "
                                    "(make setup-vllm installs it into .venv-vllm)")


# Packages whose tests share one stack (a session- or package-scoped fixture in their conftest):
# under pytest-xdist (`make test` runs three workers, --dist loadscope) each goes to one worker whole,
# so its stack starts once; every other test goes with its module (module-scoped stacks start once).
SHARED_STACK_PACKAGES = ("reliability", "e2e", "gateway", "hostile", "observability", "k8s", "sessions")
# Packages that share one stack between them (`shared_stack` below): one scope, so one worker and
# one start. e2e's tests come first (file order), on a stack no hostile test has touched yet.
SAME_STACK = {"hostile": "e2e", "sessions": "e2e"}


# Modules of a minute or more of the two cores each (make test: test_token2wav; make test-slow: the
# others), handed out right after the packages so that none starts last and runs on alone.
LONG_MODULES = ("tests/code2wav/test_real_width.py", "tests/migration/test_migration.py", "tests/bench/test_real_run.py",
                "tests/code2wav/test_token2wav.py", "tests/migration/test_migration_qwen2_5.py")


def stack_scope(nodeid: str) -> tuple[int, str]:
    """(order, scope) of a test: shared-stack packages first (the longest units: they start first
    and the short modules fill in behind them), then the long modules, then the rest in file order."""
    path = nodeid.split("::")[0]
    parts = path.split("/")
    if len(parts) > 2 and parts[1] in SHARED_STACK_PACKAGES:
        package = SAME_STACK.get(parts[1], parts[1])
        return SHARED_STACK_PACKAGES.index(package), f"{parts[0]}/{package}"
    if path in LONG_MODULES:
        return len(SHARED_STACK_PACKAGES), path
    return len(SHARED_STACK_PACKAGES) + 1, path


def pytest_xdist_make_scheduler(config, log):
    """--dist loadscope with `stack_scope` as the scope. NOTE: not --dist loadgroup with marks:
    xdist 3.8 groups by rewriting item._nodeid, which pytest 9 no longer reads."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByStack(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return stack_scope(nodeid)[1]

    return ByStack(config, log)


def pytest_collection_modifyitems(config, items) -> None:
    if not hasattr(config, "workerinput"):  # not an xdist worker: collection order as it is
        return
    # NOTE: stable, and the same on every worker (xdist checks that the collections are equal);
    # with --no-loadscope-reorder the scopes are handed out in this order.
    order = {item.nodeid: i for i, item in enumerate(items)}
    items.sort(key=lambda item: (stack_scope(item.nodeid)[0], order[item.nodeid]))


@pytest.fixture(scope="session")
def shared_stack(tiny_checkpoint):
    """The stack tests/e2e, tests/hostile and tests/sessions share (one start for all: `SAME_STACK`):
    code2wav, talker, thinker, router and sessions service as processes, with the hostile tests' input limits (the e2e tests'
    inputs are within them) and the router's metrics, as a `Reliable` (tests/reliability/support.py)."""
    from services.tools.launcher import free_port
    from tests.hostile.support import MAX_AUDIO_SECONDS, MAX_IMAGE_PIXELS, MAX_IN_FLIGHT
    from tests.reliability.support import Reliable
    from tests.stacks import stack_of

    metrics_port = free_port()
    stack = stack_of(
        tiny_checkpoint,
        thinker_args=("--max-audio-seconds", str(MAX_AUDIO_SECONDS), "--max-image-pixels", str(MAX_IMAGE_PIXELS)),
        router_args=("--max-in-flight", str(MAX_IN_FLIGHT), "--max-queue", "64", "--metrics-port", str(metrics_port)),
    )
    with stack:
        yield Reliable(stack, f"http://127.0.0.1:{metrics_port}/metrics")


# 1 s of a 440 Hz sine at 16 kHz, the rate the Whisper feature extractor wants (no resampling).
WAV_SAMPLE_RATE = 16000
WAV_SECONDS = 1.0
WAV_HZ = 440.0
# [height, width] of the test image: inside the tiny checkpoint's 32x32..64x64 pixel bounds.
PNG_SHAPE = (48, 64)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A complete tiny Qwen3-Omni checkpoint folder (seed 0), built once per test session.

    Treat it as read-only: every test of the session shares it.
    """
    from services.tools.tiny_checkpoint import build

    return build(tmp_path_factory.mktemp("ckpt") / "tiny", seed=0)


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread (OMNI_TEST_THREADS' count when set: tests/threads.py) for a module of
    tiny-model tests, restored after: at these widths thread start-up and synchronisation dominate
    (tests/tools/test_tiny_qwen2_5_omni.py took 165 s with the default threads on two busy cores, 23 s
    with one)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(torch_threads(1))
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def wide_checkpoint(tmp_path_factory) -> Path:
    """The wide bench preset's Qwen3-Omni checkpoint (bench/presets.py: hidden 512, weights up to
    3 MB, so the column-tiled batch-invariant products run), built once per session; read-only."""
    from bench.presets import WIDE_LAYOUT
    from services.tools.tiny_checkpoint import build

    return build(tmp_path_factory.mktemp("ckpt") / "wide", seed=0, layout=WIDE_LAYOUT)


@pytest.fixture(scope="session")
def tiny_qwen2_5_checkpoint(tmp_path_factory) -> Path:
    """A complete tiny Qwen2.5-Omni checkpoint folder (seed 0, spk_dict.pt included), built once per
    test session. Treat it as read-only: every test of the session shares it."""
    from services.tools.tiny_qwen2_5_omni import build

    return build(tmp_path_factory.mktemp("ckpt25") / "tiny25", seed=0)


# The other Qwen2.5-Omni configuration the exactness tests run on (merged over the tiny one):
# deeper, wider, more heads, grouped-query attention in the talker; head_dim stays 16, which the
# tiny mrope_section [2, 3, 3] fills.
QWEN2_5_WIDE_LAYOUT = dict(
    thinker_config=dict(
        text_config=dict(hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=3,
                         num_key_value_heads=1),
        audio_config=dict(output_dim=48),
        vision_config=dict(out_hidden_size=48),
    ),
    talker_config=dict(embedding_size=48, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16),
)


@pytest.fixture(scope="session")
def tiny_qwen2_5_checkpoint_wide(tmp_path_factory) -> Path:
    """`omni-tiny-checkpoint --family qwen2_5_omni --seed 1 --layout` of QWEN2_5_WIDE_LAYOUT, built
    once per test session; read-only."""
    from services.tools.tiny_qwen2_5_omni import build

    return build(tmp_path_factory.mktemp("ckpt25") / "wide25", seed=1, layout=QWEN2_5_WIDE_LAYOUT)


@pytest.fixture(scope="session")
def wav_bytes() -> bytes:
    """A mono float wav file's bytes: 1 s of a 440 Hz sine at 16 kHz, amplitude 0.5."""
    import soundfile as sf

    t = np.arange(int(WAV_SAMPLE_RATE * WAV_SECONDS)) / WAV_SAMPLE_RATE
    samples = (0.5 * np.sin(2 * np.pi * WAV_HZ * t)).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, samples, WAV_SAMPLE_RATE, format="WAV", subtype="FLOAT")
    return buf.getvalue()


@pytest.fixture(scope="session")
def png_bytes() -> bytes:
    """A 48x64 RGB png file's bytes with random pixels from a fixed seed."""
    from PIL import Image

    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, size=(*PNG_SHAPE, 3), dtype=np.uint8)  # [H, W, 3]
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="session")
def wav_file(tmp_path_factory, wav_bytes) -> Path:
    path = tmp_path_factory.mktemp("inputs") / "sine440.wav"
    path.write_bytes(wav_bytes)
    return path


@pytest.fixture(scope="session")
def png_file(tmp_path_factory, png_bytes) -> Path:
    path = tmp_path_factory.mktemp("inputs") / "noise48x64.png"
    path.write_bytes(png_bytes)
    return path

