"""Router Prometheus metrics: requests by outcome, queue, in flight, TTFT/TTFP/RTF, per replica."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    start_http_server,
)

from services.serving.gc_heap import GCCollector
from services.serving.loop_lag import LAG_BUCKETS

LATENCY_BUCKETS = (0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)
RTF_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        r.register(GCCollector())
        ProcessCollector(registry=r)  # process_start_time_seconds: the crash-loop alert (k8s/monitoring)
        self.requests = Counter("omni_router_requests", "Requests by outcome", ["outcome"], registry=r)
        self.queue_depth = Gauge("omni_router_queue_depth", "Requests waiting for admission", registry=r)
        self.in_flight = Gauge("omni_router_in_flight", "Requests admitted and streaming", registry=r)
        # Kept at the source (Admission.peak), so a test or an alert cannot miss a spike between scrapes.
        self.in_flight_peak = Gauge("omni_router_in_flight_peak", "The most requests admitted at once since the start",
                                    registry=r)
        self.in_flight_limit = Gauge("omni_router_in_flight_limit", "Requests that may stream at once (--max-in-flight)",
                                     registry=r)
        self.queue_limit = Gauge("omni_router_queue_limit", "Requests that may wait for admission (--max-queue)",
                                 registry=r)
        self.ttft = Histogram("omni_router_ttft_seconds", "Request received to first text delta",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.ttfp = Histogram("omni_router_ttfp_seconds", "Request received to first audio chunk",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.rtf = Histogram("omni_router_rtf", "(last audio chunk - received) / audio seconds",
                             buckets=RTF_BUCKETS, registry=r)
        # A listener that plays each request's audio from its first chunk on, as it arrives here: an
        # underrun is a chunk that arrived after the audio before it had run out (omni-bench's
        # figure, seen at the router, without the last hop to the client).
        self.underruns = Counter("omni_router_underruns", "Times a request's audio ran dry before its next chunk arrived",
                                 registry=r)
        self.underrun_seconds = Counter("omni_router_underrun_seconds", "Silence those underruns add up to",
                                        registry=r)
        self.loop_lag = Histogram("omni_router_loop_lag_seconds", "How late the event loop ran a timer due every "
                                  "100 ms: what every request's relay waited behind", buckets=LAG_BUCKETS, registry=r)
        self.replica_in_flight = Gauge("omni_router_replica_in_flight", "This router's requests per replica",
                                       ["stage", "replica"], registry=r)
        self.migrations = Counter("omni_router_migrations", "Requests moved off a dead thinker replica",
                                  ["stage", "outcome"], registry=r)
        self.migration_pause = Histogram("omni_router_migration_pause_seconds",
                                         "From a thinker replica's failure to the first new output after the move",
                                         ["stage"], buckets=LATENCY_BUCKETS, registry=r)
        # Prefix routing (services/serving/prefix_routing.py): a thinker replica reported holding part of the request's
        # conversation (held) or none did (none); counted only with more than one thinker to choose from.
        self.prefix_routed = Counter("omni_router_prefix_routed", "Requests routed by prefix, by whether any thinker "
                                     "replica held part of their conversation", ["outcome"], registry=r)
        self.replica_healthy = Gauge("omni_router_replica_healthy", "1 if the replica is SERVING and not draining",
                                     ["stage", "replica"], registry=r)
        self.replica_reported_load = Gauge("omni_router_replica_reported_load",
                                           "Queued plus running requests the replica reported at the last poll",
                                           ["stage", "replica"], registry=r)
        # Totals since the start, counted in the poll itself: a short suspect spell or a brief
        # time down shows here even when no scrape of replica_state fell inside it.
        self.replica_missed_polls = Gauge("omni_router_replica_missed_polls",
                                          "Health/load polls of the replica that ran past their deadline since the start",
                                          ["stage", "replica"], registry=r)
        self.replica_downs = Gauge("omni_router_replica_downs",
                                   "Times the replica was taken out (down: refused, reset, not serving, failed a call) "
                                   "since the start", ["stage", "replica"], registry=r)
        self.replica_state = Gauge("omni_router_replica_state",
                                   "1 for the replica's state: up, suspect (polls missing their deadline, "
                                   "still used) or down (refused, reset or not serving)",
                                   ["stage", "replica", "state"], registry=r)

    def serve(self, port: int, host: str = "0.0.0.0") -> int | None:
        if not port:
            return None
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port
