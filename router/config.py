"""The router's configuration: its replica sources, admission, polling and migration settings."""

from __future__ import annotations

from dataclasses import dataclass

from router.admission import AdmissionConfig
from services.serving.config import ServingConfig
from services.serving.prefix_routing import DEFAULT_PREFIX_WEIGHT, Routing
from services.serving.replicas import ReplicaSource


@dataclass(frozen=True)
class RouterConfig:
    thinker: ReplicaSource
    talker: ReplicaSource
    code2wav: ReplicaSource
    # Where it listens, message limit, grace, metrics, TLS (client -> router and router -> thinker,
    # and the stages' health/load), health port, the stages' idle timeout: what every server has.
    serving: ServingConfig = ServingConfig(port=50051)
    admission: AdmissionConfig = AdmissionConfig()
    poll_interval_s: float = 1.0
    dns_refresh_s: float = 5.0
    auth_tokens: tuple[bytes, ...] = ()  # bearer tokens callers must present; empty = no authentication
    max_migrations: int = 2  # moves to another replica per request and hop when one dies mid-stream
    routing: Routing = Routing.PREFIX  # how a thinker replica is chosen (services/serving/prefix_routing.py)
    prefix_weight: float = DEFAULT_PREFIX_WEIGHT

    @property
    def thinker_stall_s(self) -> float:
        """A thinker replica that sends nothing this long is taken as hung: one step above the
        thinker's own wait on the two stages below it (ServingConfig.stall_timeout_s), 2.5x the
        idle timeout."""
        return self.serving.stall_timeout_s(stages_below=3)
