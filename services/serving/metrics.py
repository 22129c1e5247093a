"""Prometheus metrics of a stage: queue depth, running batch, step time, KV cache use, streams.

Each service serves them over HTTP on `--metrics-port` (0 = off) at /metrics.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

PAUSE_BUCKETS = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)


class StageMetrics:
    def __init__(self, stage: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        labels = {"stage": stage}
        r = self.registry
        self.queue_depth = Gauge("omni_stage_queue_depth", "Requests admitted, waiting for a slot or input",
                                 ["stage"], registry=r).labels(**labels)
        self.running = Gauge("omni_stage_running_batch", "Requests holding a KV slot / decoder", ["stage"],
                             registry=r).labels(**labels)
        self.batch_size = Histogram("omni_stage_batch_size", "Requests per engine step", ["stage"], registry=r,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128)).labels(**labels)
        self.step_seconds = Histogram("omni_stage_step_seconds", "Engine step time", ["stage"], registry=r,
                                      buckets=STEP_BUCKETS).labels(**labels)
        self.cache_used = Gauge("omni_stage_cache_slots_used", "KV cache slots in use", ["stage"],
                                registry=r).labels(**labels)
        self.cache_capacity = Gauge("omni_stage_cache_slots", "KV cache slots", ["stage"],
                                    registry=r).labels(**labels)
        self.in_flight = Gauge("omni_stage_in_flight", "Streams open on this stage", ["stage"],
                               registry=r).labels(**labels)
        # Moves of a request to another replica of the next stage (services/serving/migration.py):
        # outcome moved (replayed there), failed (no fallback or moves left), diverged (the replay
        # parted from what was delivered).
        self.migrations = Counter("omni_stage_migrations", "Requests moved off a dead replica of the next stage",
                                  ["stage", "peer", "outcome"], registry=r)
        self.migration_pause = Histogram("omni_stage_migration_pause_seconds",
                                         "From a replica's failure to the first new output after the move",
                                         ["stage", "peer"], registry=r, buckets=PAUSE_BUCKETS)

    def serve(self, port: int, host: str = "0.0.0.0") -> int | None:
        if not port:
            return None
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port
