"""The sessions tests' processes: the end-to-end ones run on the stack tests/e2e shares (its
sessions service included: tests/conftest.py's `shared_stack`), through tests/e2e's own fixtures
(`stack`, and `omni` for the one-shot requests a turn is compared with); tests/sessions/procs.py
starts the extra routers and sessions services a test needs of its own."""

from tests.e2e.conftest import omni, stack  # noqa: F401 - the shared stack's fixtures
