"""The sessions service's Prometheus metrics: sessions open and ended, turns by status and their
retries, barge-ins, end of speech to first audio, and what turn detection costs."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, start_http_server

from services.serving.gc_heap import GCCollector

LATENCY_BUCKETS = (0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)


class SessionMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        r.register(GCCollector())
        ProcessCollector(registry=r)  # process_start_time_seconds: the crash-loop alert (k8s/monitoring)
        self.sessions_open = Gauge("omni_session_open", "Realtime sessions open", registry=r)
        self.sessions = Counter("omni_session_sessions", "Realtime sessions ended, by how (ended: the client closed; "
                                "idle_timeout, turn_limit, slow_reader: the service closed it; cancelled; rejected: "
                                "over --max-sessions at connect)", ["outcome"], registry=r)
        self.turns = Counter("omni_session_turns", "Responses of realtime sessions, by status", ["status"], registry=r)
        for status in ("completed", "cancelled", "failed"):
            self.turns.labels(status)  # a series from the start (the dashboard's rate by status)
        self.turn_retries = Counter("omni_session_turn_retries", "Turns whose router call failed UNAVAILABLE before any "
                                    "output and were sent again, to the next router target", registry=r)
        self.barge_ins = Counter("omni_session_barge_ins",
                                 "Speech that started while a response was playing (it was cancelled)", registry=r)
        self.first_audio = Histogram("omni_session_first_audio_seconds",
                                     "Speech stop detected to the response's first audio chunk written",
                                     buckets=LATENCY_BUCKETS, registry=r)

    def serve(self, port: int, host: str = "0.0.0.0") -> int | None:
        if not port:
            return None
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port
