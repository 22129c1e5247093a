"""The sessions service's objects: Deployment, Service and the headless Service the gateway finds its
pods by, disruption budget, CPU autoscaler, and how it is wired to its neighbours: the gateway's
OMNI_SESSIONS names its headless Service and port, its OMNI_ROUTER every router pod. Its container's
args and environment go through its own parser with the other components' (test_service_flags.py),
its NetworkPolicy with the others' (test_network_policy.py)."""

from __future__ import annotations

import pytest

from .manifests import (
    KUSTOMIZATIONS,
    argv_of,
    container_env,
    container_port,
    entry_point,
    main_container,
    parse_with_service,
    pod_spec,
)


def parsed(objects, component: str):
    container = main_container(objects.deployment(component))
    return container, parse_with_service(entry_point(container), argv_of(container), container_env(objects, container)).args


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_sessions_deployment_services_budget_and_drain(rendered, kustomization):
    objects = rendered[kustomization]
    workload = objects.deployment("sessions")
    container, args = parsed(objects, "sessions")
    assert container["command"] == ["omni-session"]
    assert args.port == container_port(container, "grpc") and args.metrics_port == container_port(container, "metrics")
    assert workload["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(args.metrics_port)
    labels = workload["spec"]["template"]["metadata"]["labels"]
    for name in ("omni-sessions", "omni-sessions-headless"):
        service = objects.get("Service", name)
        assert service["spec"]["selector"].items() <= labels.items(), name
        (port,) = service["spec"]["ports"]
        assert port["targetPort"] == "grpc" and port["port"] == args.port, name
    assert objects.get("Service", "omni-sessions-headless")["spec"]["clusterIP"] == "None"
    pdb = objects.get("PodDisruptionBudget", "omni-sessions")
    assert pdb["spec"].get("maxUnavailable") == 1 and "minAvailable" not in pdb["spec"]
    # SIGKILL never cuts a session's turn the pod is still finishing; a turn is a router stream.
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pod_spec(workload)["terminationGracePeriodSeconds"] >= float(pre_stop[1]) + args.grace_s + 10
    _, router_args = parsed(objects, "router")
    assert args.grace_s >= router_args.grace_s


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_the_gateway_finds_every_sessions_pod_and_the_sessions_every_router_pod(rendered, kustomization):
    objects = rendered[kustomization]
    _, gateway = parsed(objects, "gateway")
    _, sessions = parsed(objects, "sessions")
    _, router = parsed(objects, "router")
    assert gateway.sessions == f"dns:///omni-sessions-headless:{sessions.port}"
    assert sessions.router == f"dns:///omni-router-headless:{router.port}"
    assert sessions.tls_server_name == "omni-router"  # under mTLS, the name the router's certificate carries


@pytest.mark.parametrize("kustomization", ["base", "overlays/gpu"])
def test_sessions_autoscale_on_cpu_from_their_replicas(rendered, kustomization):
    objects = rendered[kustomization]
    hpa = objects.get("HorizontalPodAutoscaler", "omni-sessions")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "omni-sessions"}
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Resource" and metric["resource"]["name"] == "cpu"
    assert metric["resource"]["target"]["type"] == "Utilization"
    # The Deployment's replicas are the autoscaler's floor, so `kubectl apply` does not fight it.
    replicas = objects.deployment("sessions")["spec"]["replicas"]
    assert hpa["spec"]["minReplicas"] == replicas < hpa["spec"]["maxReplicas"]
    # CPU limits are what utilization is measured against.
    assert main_container(objects.deployment("sessions"))["resources"]["requests"]["cpu"]
