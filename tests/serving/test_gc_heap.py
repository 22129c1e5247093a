"""The gc pause histogram counts real collections, and freezing takes the heap out of them."""

from __future__ import annotations

import gc

from prometheus_client import CollectorRegistry

from services.serving.gc_heap import GCCollector, freeze_startup_heap


def sample(registry: CollectorRegistry, name: str, **labels) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def test_each_collection_is_one_sample_of_its_generation():
    registry = CollectorRegistry()
    registry.register(GCCollector())
    before = sample(registry, "omni_gc_pause_seconds_count", generation="2")
    total_before = sample(registry, "omni_gc_pause_seconds_sum", generation="2")
    gc.collect()
    gc.collect()
    assert sample(registry, "omni_gc_pause_seconds_count", generation="2") == before + 2
    assert sample(registry, "omni_gc_pause_seconds_sum", generation="2") > total_before
    assert sample(registry, "omni_gc_pause_seconds_bucket", generation="2", le="+Inf") == before + 2


def test_many_registries_share_one_gc_callback():
    callbacks = len(gc.callbacks)
    for _ in range(3):
        CollectorRegistry().register(GCCollector())
    assert len(gc.callbacks) <= callbacks + 1  # +1 only if no collector existed yet


def test_freezing_moves_the_live_heap_out_of_collections():
    registry = CollectorRegistry()
    registry.register(GCCollector())
    try:
        frozen = freeze_startup_heap()
        assert frozen > 10_000  # pytest, torch and this suite's modules
        # Only falls after the freeze: a frozen object that another thread frees (threads of
        # earlier tests still run) leaves the permanent generation; CI once saw 2 go between reads.
        assert frozen - 1_000 < gc.get_freeze_count() <= frozen
        assert frozen - 1_000 < registry.get_sample_value("omni_gc_frozen_objects") <= frozen
        assert len(gc.get_objects()) < frozen  # what collections still traverse
    finally:
        gc.unfreeze()


def test_a_collection_that_starts_during_a_scrape_does_not_deadlock_it():
    # A scrape allocates, so a collection can start inside it, in the same thread, and its
    # callback takes the same lock (the first version hung every /metrics scrape this way).
    import threading

    from prometheus_client import generate_latest

    registry = CollectorRegistry()
    registry.register(GCCollector())
    thresholds = gc.get_threshold()
    done = threading.Event()

    def scrape() -> None:
        for _ in range(20):
            generate_latest(registry)
        done.set()

    gc.set_threshold(1)  # a collection on nearly every allocation
    try:
        threading.Thread(target=scrape, daemon=True).start()
        assert done.wait(30), "a scrape hung"
    finally:
        gc.set_threshold(*thresholds)
