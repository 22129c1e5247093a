"""The gateway's objects: Deployment (HTTP probes on /health and /live), Service, disruption
budget, CPU autoscaler, and a NetworkPolicy that lets callers in and the gateway out to the
router and the sessions service alone. Its container's args and environment go through its own parser with the other
components' (test_service_flags.py iterates every workload)."""

from __future__ import annotations

import pytest

from .manifests import (
    KUSTOMIZATIONS,
    STAGES,
    Peer,
    argv_of,
    container_env,
    container_port,
    entry_point,
    ingress_allowed,
    main_container,
    parse_with_service,
    pod_spec,
)

MONITORING = "monitoring"


def parsed_gateway(objects):
    container = main_container(objects.deployment("gateway"))
    return container, parse_with_service(entry_point(container), argv_of(container), container_env(objects, container))


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_gateway_deployment_service_and_budget(rendered, kustomization):
    objects = rendered[kustomization]
    workload = objects.deployment("gateway")
    container, parsed = parsed_gateway(objects)
    assert container["command"] == ["omni-gateway"]
    assert parsed.args.port == container_port(container, "http")
    assert parsed.args.metrics_port == container_port(container, "metrics") > 0
    annotations = workload["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(parsed.args.metrics_port)
    service = objects.get("Service", "omni-gateway")
    assert service["spec"]["selector"].items() <= workload["spec"]["template"]["metadata"]["labels"].items()
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == "http"
    pdb = objects.get("PodDisruptionBudget", "omni-gateway")
    assert pdb["spec"].get("maxUnavailable") == 1 and "minAvailable" not in pdb["spec"]
    # The gateway reaches every router pod through the router's headless Service (round robin over
    # its addresses), on the port the router listens on, checking the router's own name under mTLS.
    router_service = objects.get("Service", "omni-router-headless")
    assert router_service["spec"]["clusterIP"] == "None"
    assert router_service["spec"]["selector"] == objects.get("Service", "omni-router")["spec"]["selector"]
    host, _, router_port = parsed.args.router.rpartition(":")
    assert host == "dns:///" + router_service["metadata"]["name"]
    assert parsed.args.tls_server_name == "omni-router"
    router_container = main_container(objects.deployment("router"))
    router_args = parse_with_service(entry_point(router_container), argv_of(router_container),
                                     container_env(objects, router_container)).args
    assert int(router_port) == router_args.port
    assert set(parsed.args.voices.split(",")) == {"chelsie", "ethan", "aiden"}
    # SIGKILL never cuts a stream the gateway is still finishing.
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert pod_spec(workload)["terminationGracePeriodSeconds"] >= float(pre_stop[1]) + parsed.args.grace_s + 10
    # A gateway stream is a router stream: its drain is at least the router's.
    assert parsed.args.grace_s >= router_args.grace_s


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_gateway_requires_tokens_from_its_secret(rendered, kustomization):
    """No open port without a token: --require-auth, and the token file is a non-optional Secret
    mounted as a folder (no subPath)."""
    objects = rendered[kustomization]
    workload = objects.deployment("gateway")
    container, parsed = parsed_gateway(objects)
    assert parsed.args.require_auth
    folder, _, name = parsed.args.auth_token_file.rpartition("/")
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == folder]
    assert "subPath" not in mount and mount.get("readOnly")
    (volume,) = [v for v in pod_spec(workload)["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == "omni-gateway-tokens" and not volume["secret"].get("optional")
    assert name == "tokens"


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_gateway_probes_are_http_readiness_follows_the_router_liveness_does_not(rendered, kustomization):
    container, _ = parsed_gateway(rendered[kustomization])
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    for probe in ("startupProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/live", "port": "http"}, probe


@pytest.mark.parametrize("kustomization", ["base", "overlays/gpu"])
def test_gateway_autoscales_on_cpu_from_its_replicas(rendered, kustomization):
    objects = rendered[kustomization]
    (hpa,) = [h for h in objects.of_kind("HorizontalPodAutoscaler")
              if h["spec"]["scaleTargetRef"]["name"] == "omni-gateway"]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "omni-gateway"}
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Resource" and metric["resource"]["name"] == "cpu"
    replicas = objects.deployment("gateway")["spec"]["replicas"]
    assert hpa["spec"]["minReplicas"] == replicas < hpa["spec"]["maxReplicas"]
    container = main_container(objects.deployment("gateway"))
    assert "cpu" in container["resources"]["requests"]  # Utilization is relative to the request


def test_gateway_replicas_per_overlay(overlays):
    assert overlays["dev-cpu"].deployment("gateway")["spec"]["replicas"] == 1
    assert overlays["gpu"].deployment("gateway")["spec"]["replicas"] == 2


def _peer(objects, namespace: str, component: str) -> Peer:
    labels = objects.deployment(component)["spec"]["template"]["metadata"]["labels"]
    return Peer(namespace, (("kubernetes.io/metadata.name", namespace),), tuple(sorted(labels.items())))


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def egress_allowed(policies: list[dict], namespace: str, source_labels: dict, target: Peer, port: int,
                   protocol: str = "TCP") -> bool:
    """Whether a pod with `source_labels` may open `port` on `target` under the Egress policies."""
    selecting = [p for p in policies if "Egress" in p["spec"].get("policyTypes", [])
                 and _selects(p["spec"].get("podSelector", {}), source_labels)]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("egress", []):
            ports_ok = "ports" not in rule or any(
                e.get("port") == port and e.get("protocol", "TCP") == protocol for e in rule["ports"])
            peers_ok = "to" not in rule or any(
                (_selects(peer["namespaceSelector"], dict(target.namespace_labels)) if "namespaceSelector" in peer
                 else target.namespace == namespace)
                and (_selects(peer["podSelector"], dict(target.labels)) if "podSelector" in peer else True)
                for peer in rule["to"])
            if ports_ok and peers_ok:
                return True
    return False


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_gateway_network_policy_callers_in_router_and_sessions_only_out(rendered, kustomization):
    objects = rendered[kustomization]
    namespace = objects.deployment("router")["metadata"].get("namespace", "default")
    policies = objects.of_kind("NetworkPolicy")
    workload = objects.deployment("gateway")
    container = main_container(workload)
    labels = workload["spec"]["template"]["metadata"]["labels"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    http, metrics = container_port(container, "http"), container_port(container, "metrics")
    client = Peer("apps", (("kubernetes.io/metadata.name", "apps"),), (("app", "client"),))
    prometheus = Peer(MONITORING, (("kubernetes.io/metadata.name", MONITORING),),
                      (("app.kubernetes.io/name", "prometheus"),))
    # Ingress: any caller on HTTP; only Prometheus on the metrics port.
    assert ingress_allowed(policies, namespace, labels, ports, client, http)
    assert ingress_allowed(policies, namespace, labels, ports, prometheus, metrics)
    assert not ingress_allowed(policies, namespace, labels, ports, client, metrics)
    # Egress: the router's and the sessions service's gRPC ports and cluster DNS, nothing else.
    for service in ("router", "sessions"):
        service_port = container_port(main_container(objects.deployment(service)), "grpc")
        assert egress_allowed(policies, namespace, labels, _peer(objects, namespace, service), service_port), service
    dns = Peer("kube-system", (("kubernetes.io/metadata.name", "kube-system"),), (("k8s-app", "kube-dns"),))
    assert egress_allowed(policies, namespace, labels, dns, 53, "UDP")
    for stage in STAGES:
        stage_port = container_port(main_container(objects.deployment(stage)), "grpc")
        assert not egress_allowed(policies, namespace, labels, _peer(objects, namespace, stage), stage_port), stage
    assert not egress_allowed(policies, namespace, labels, client, 443)  # it fetches nothing from outside
    # And the stages do not take the gateway's connections (their ingress is the pipeline's hops).
    gateway = _peer(objects, namespace, "gateway")
    for stage in STAGES:
        stage_workload = objects.deployment(stage)
        stage_container = main_container(stage_workload)
        stage_ports = {p["name"]: p["containerPort"] for p in stage_container["ports"]}
        assert not ingress_allowed(policies, namespace, stage_workload["spec"]["template"]["metadata"]["labels"],
                                   stage_ports, gateway, container_port(stage_container, "grpc")), stage
