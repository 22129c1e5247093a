"""The NetworkPolicies let exactly the pipeline's hops through: clients -> router -> thinker ->
talker -> code2wav, clients -> sessions (whose turns are the router's clients), the router's replica
poll, and Prometheus on the metrics port; nothing else."""

from __future__ import annotations

import itertools

import pytest

from .manifests import (
    COMPONENTS,
    KUSTOMIZATIONS,
    Peer,
    container_port,
    ingress_allowed,
    main_container,
)

MONITORING = "monitoring"

# The public APIs, open to clients anywhere: omni.v1.Omni (router) and omni.v1.Sessions (sessions).
PUBLIC = ("router", "sessions")
# (source, destination) pairs allowed on the destination's gRPC port.
DATA_PATH = {("router", "thinker"), ("thinker", "talker"), ("talker", "code2wav")}
# The router polls every replica's grpc.health.v1 status and GetLoad (services/serving/replicas.py): an L4
# policy cannot tell that poll from a stream, so the router reaches the talker and code2wav too.
ROUTER_POLL = {("router", "talker"), ("router", "code2wav")}


def sources(namespace: str, objects) -> dict[str, Peer]:
    """Every party that might connect: the five components, a client elsewhere, Prometheus."""
    peers = {}
    for component in COMPONENTS:
        labels = objects.deployment(component)["spec"]["template"]["metadata"]["labels"]
        peers[component] = Peer(namespace, (("kubernetes.io/metadata.name", namespace),),
                                tuple(sorted(labels.items())))
    peers["client"] = Peer("apps", (("kubernetes.io/metadata.name", "apps"),), (("app", "client"),))
    peers["prometheus"] = Peer(MONITORING, (("kubernetes.io/metadata.name", MONITORING),),
                               (("app.kubernetes.io/name", "prometheus"),))
    return peers


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_only_the_pipeline_hops_reach_each_grpc_port_and_only_prometheus_the_metrics(rendered, kustomization):
    objects = rendered[kustomization]
    namespace = objects.deployment("router")["metadata"].get("namespace", "default")
    policies = objects.of_kind("NetworkPolicy")
    peers = sources(namespace, objects)
    wrong = []
    for source, target in itertools.product(peers, COMPONENTS):
        workload = objects.deployment(target)
        container = main_container(workload)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        labels = workload["spec"]["template"]["metadata"]["labels"]
        grpc, metrics = container_port(container, "grpc"), container_port(container, "metrics")
        expect_grpc = target in PUBLIC or (source, target) in DATA_PATH | ROUTER_POLL
        expect_metrics = source == "prometheus"
        for port, expected in ((grpc, expect_grpc), (metrics, expect_metrics)):
            got = ingress_allowed(policies, namespace, labels, ports, peers[source], port)
            if got != expected:
                wrong.append(f"{source} -> {target}:{port} {'allowed' if got else 'denied'}, "
                             f"expected {'allowed' if expected else 'denied'}")
    assert not wrong, f"k8s/{kustomization}:\n" + "\n".join(wrong)
