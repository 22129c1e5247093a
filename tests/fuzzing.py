"""How the property-based (hypothesis) tests draw their cases: fresh each run from one seed that
the run prints (in pytest's header and in each fuzz test's output), so a failure can be replayed
with `OMNI_FUZZ_SEED=<seed> pytest ...`; no example database, no derandomized fixed set."""

from __future__ import annotations

import os
import random

from hypothesis import HealthCheck, settings
from hypothesis import seed as hypothesis_seed

SEED_ENV = "OMNI_FUZZ_SEED"
SEED = int(os.environ[SEED_ENV]) if os.environ.get(SEED_ENV) else random.SystemRandom().randrange(2**32)


def fuzz_settings(max_examples: int) -> settings:
    """Examples drawn fresh (not derandomized), no deadline (a stack on a busy machine is slow), no
    database (every run starts from the seed alone), no health checks (the strategies are slow by
    design: big bodies)."""
    return settings(max_examples=max_examples, deadline=None, database=None, derandomize=False,
                    suppress_health_check=list(HealthCheck), print_blob=True)


def seeded(test):
    """Give a @given test the run's seed and print it, so its output says how to replay it."""
    print(f"fuzz seed {SEED} (replay: {SEED_ENV}={SEED})")
    return hypothesis_seed(SEED)(test)
