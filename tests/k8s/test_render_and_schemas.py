"""Every kustomization renders with `kubectl kustomize`, and every object it renders is valid
against the Kubernetes OpenAPI schemas (kubernetes-validate, strict: unknown fields fail)."""

from __future__ import annotations

import copy
import functools
from unittest import mock

import kubernetes_validate
import kubernetes_validate.utils
import pytest
import yaml

from .manifests import COMPONENTS, K8S, KUSTOMIZATIONS, STAGES, custom_resource_errors

# The oldest Kubernetes these manifests are for (native gRPC probes GA in 1.27; 1.29 is the oldest
# still maintained by the big providers) and the version of the kubectl they are rendered with.
K8S_VERSIONS = ("1.29", "1.32")


@pytest.fixture(scope="module")
def validate():
    """kubernetes_validate.validate with its schema files read once, not once per object."""
    cached = functools.lru_cache(maxsize=None)(kubernetes_validate.utils.schema_contents)
    with mock.patch.object(kubernetes_validate.utils, "schema_contents", cached):
        yield kubernetes_validate.validate


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_kustomization_renders_the_whole_pipeline(rendered, kustomization):
    objects = rendered[kustomization]
    for component in COMPONENTS:
        objects.get("Deployment", f"omni-{component}")
        objects.get("Service", f"omni-{component}")
        objects.get("PodDisruptionBudget", f"omni-{component}")
        objects.get("NetworkPolicy", f"omni-{component}")


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_is_valid_against_the_kubernetes_schemas_in_strict_mode(rendered, validate, kustomization,
                                                                             version):
    # Every object has a schema: a missing one fails here instead of being skipped. The only
    # custom resources are cert-manager's (k8s/components/mtls), checked against the vendored
    # schemas (tests/k8s/schemas), strictly as well.
    failures = []
    for obj in rendered[kustomization].objects:
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        custom = custom_resource_errors(obj)
        if custom is not None:
            failures += [f"{where}: {error}" for error in custom]
            continue
        try:
            validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            failures.append(f"{where}: {'.'.join(map(str, exc.path))}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            failures.append(f"{where}: no schema ({exc.message}); a CRD needs its own check")
    assert not failures, f"k8s/{kustomization} against Kubernetes {version}:\n" + "\n".join(failures)


def test_strict_validation_rejects_an_unknown_field(rendered, validate):
    """Guards the test above: strict mode really fails a misspelt field."""
    deployment = copy.deepcopy(rendered["overlays/gpu"].deployment("talker"))
    deployment["spec"]["template"]["spec"]["containers"][0]["grpcProbe"] = {"port": 50062}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment, K8S_VERSIONS[-1], strict=True)


def test_custom_resource_validation_rejects_unknown_fields_bad_values_and_missing_required_ones(rendered):
    """Guards the cert-manager part of the strict check above."""
    certificate = rendered["overlays/gpu"].get("Certificate", "omni-talker")
    assert custom_resource_errors(certificate) == []
    broken = copy.deepcopy(certificate)
    broken["spec"]["dnsName"] = ["omni-talker"]  # misspelt dnsNames
    broken["spec"]["usages"].append("server-auth")  # not one of the usages
    broken["spec"]["privateKey"]["rotationPolicy"] = "Sometimes"
    del broken["spec"]["issuerRef"]["name"]
    errors = "\n".join(custom_resource_errors(broken))
    for expected in ("dnsName", "server-auth", "Sometimes", "'name' is a required property"):
        assert expected in errors, errors


@pytest.mark.parametrize("overlay", ["dev-cpu", "gpu"])
def test_overlay_deploys_into_its_own_restricted_namespace(overlays, overlay):
    objects = overlays[overlay]
    (namespace,) = objects.of_kind("Namespace")
    name = namespace["metadata"]["name"]
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for obj in objects.objects:
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == name, f"{obj['kind']}/{obj['metadata']['name']}"


def test_podmonitor_scrapes_the_metrics_port_of_every_component(overlays):
    """PodMonitor is a CRD (monitoring.coreos.com/v1) with no bundled schema: checked by hand."""
    monitor = yaml.safe_load((K8S / "monitoring" / "podmonitor.yaml").read_text())
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["kind"] == "PodMonitor"
    assert set(monitor["spec"]) == {"selector", "podMetricsEndpoints"}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert set(endpoint) <= {"port", "path", "interval"} and endpoint["path"] == "/metrics"
    # The gateway's metrics port wants a bearer token: its own PodMonitor sends one.
    gateway = yaml.safe_load((K8S / "monitoring" / "gateway-podmonitor.yaml").read_text())
    assert monitor["spec"]["selector"]["matchExpressions"] == [
        {"key": "app.kubernetes.io/component", "operator": "NotIn", "values": ["gateway"]}]
    (gateway_endpoint,) = gateway["spec"]["podMetricsEndpoints"]
    assert gateway_endpoint["authorization"] == {"type": "Bearer", "credentials": {
        "name": "omni-gateway-tokens", "key": "metrics"}}
    for objects in overlays.values():
        for component in COMPONENTS:
            template = objects.deployment(component)["spec"]["template"]
            labels = template["metadata"]["labels"]
            chosen = gateway if labels.get("app.kubernetes.io/component") == "gateway" else monitor
            assert chosen["spec"]["selector"]["matchLabels"].items() <= labels.items(), component
            ports = {p["name"] for p in template["spec"]["containers"][0]["ports"]}
            assert endpoint["port"] in ports and gateway_endpoint["port"] == endpoint["port"], component


def test_prometheus_adapter_serves_the_metric_the_autoscalers_read(overlays):
    values = yaml.safe_load((K8S / "monitoring" / "prometheus-adapter-values.yaml").read_text())
    exposed = {rule["name"]["as"]: rule for rule in values["rules"]["custom"]}
    # The gateway's and the sessions service's autoscalers read CPU (a Resource metric, metrics-server):
    # no adapter rule.
    hpas = [h for h in overlays["gpu"].of_kind("HorizontalPodAutoscaler")
            if h["spec"]["scaleTargetRef"]["name"] not in ("omni-gateway", "omni-sessions")]
    assert {h["spec"]["scaleTargetRef"]["name"] for h in hpas} == {f"omni-{s}" for s in STAGES}
    for hpa in hpas:
        (metric,) = hpa["spec"]["metrics"]
        name = metric["pods"]["metric"]["name"]
        assert name in exposed, f"{hpa['metadata']['name']}: {name} is not served by prometheus-adapter"
        rule = exposed[name]
        assert rule["seriesQuery"].startswith(name + "{")
        assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
        assert rule["resources"]["overrides"]["namespace"] == {"resource": "namespace"}
