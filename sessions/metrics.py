"""The sessions service's Prometheus metrics: sessions open and ended, turns by status and their
retries, transcriptions of the user's turns, barge-ins, end of speech to first audio, what turn detection costs (its CPU over the
seconds of audio it heard) and the event loop's lag."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, start_http_server

from services.serving.gc_heap import GCCollector
from services.serving.loop_lag import LAG_BUCKETS

LATENCY_BUCKETS = (0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)


class SessionMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        r.register(GCCollector())
        ProcessCollector(registry=r)  # process_start_time_seconds: the crash-loop alert (k8s/monitoring)
        self.sessions_open = Gauge("omni_session_open", "Realtime sessions open", registry=r)
        self.sessions = Counter("omni_session_sessions", "Realtime sessions ended, by how (ended: the client closed; "
                                "idle_timeout, turn_limit, slow_reader, max_duration: the service closed it; cancelled; "
                                "rejected: over --max-sessions at connect)", ["outcome"], registry=r)
        for outcome in ("ended", "cancelled", "idle_timeout", "turn_limit", "slow_reader", "max_duration", "rejected"):
            self.sessions.labels(outcome)  # a series from the start (the dashboard's rate by outcome)
        self.turns = Counter("omni_session_turns", "Responses of realtime sessions, by status", ["status"], registry=r)
        for status in ("completed", "cancelled", "failed"):
            self.turns.labels(status)  # a series from the start (the dashboard's rate by status)
        self.turn_retries = Counter("omni_session_turn_retries", "Turns whose router call failed UNAVAILABLE before any "
                                    "output and were sent again, to the next router target", registry=r)
        self.truncations = Counter("omni_session_truncations", "Turns that did not fit a stage's per-request cache "
                                   "and dropped the conversation's oldest turns (`truncation`)", registry=r)
        self.transcriptions = Counter("omni_session_transcriptions", "Transcriptions of committed input audio turns "
                                      "(input_transcription), by status: completed, failed", ["status"], registry=r)
        for status in ("completed", "failed"):
            self.transcriptions.labels(status)
        self.held_answers = Counter("omni_session_held_answers", "Answers started at a turn's first silent window: "
                                    "released when the silence setting confirmed the turn, or dropped (speech "
                                    "resumed, a client message)", ["outcome"], registry=r)
        self.barge_ins = Counter("omni_session_barge_ins",
                                 "Speech that started while a response was playing (it was cancelled)", registry=r)
        self.first_audio = Histogram("omni_session_first_audio_seconds",
                                     "Speech stop detected to the response's first audio chunk written",
                                     buckets=LATENCY_BUCKETS, registry=r)
        # Their ratio is turn detection's CPU per second of audio (docs/sessions.md, "What turn detection costs").
        self.detection_cpu = Counter("omni_session_turn_detection_cpu_seconds",
                                     "CPU time of the detection thread in turn detection (resampling, windows, "
                                     "Silero, whose onnxruntime session runs on that thread)", registry=r)
        self.detected_audio = Counter("omni_session_turn_detection_audio_seconds",
                                      "Seconds of input audio turn detection heard", registry=r)
        self.loop_lag = Histogram("omni_session_loop_lag_seconds", "How late the event loop ran a timer due every "
                                  "100 ms: what every session's messages waited behind", buckets=LAG_BUCKETS, registry=r)

    def serve(self, port: int, host: str = "0.0.0.0") -> int | None:
        if not port:
            return None
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port
