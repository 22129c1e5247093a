"""Every pod that the overlays run: probes, resources, security context, GPUs, replicas, graceful
termination, disruption budgets and autoscalers."""

from __future__ import annotations

import pytest

from .manifests import (
    COMPONENTS,
    KUSTOMIZATIONS,
    STAGES,
    argv_of,
    container_env,
    container_port,
    entry_point,
    main_container,
    parse_with_service,
    pod_spec,
    quantity,
)

GPU = "nvidia.com/gpu"


def all_containers(workload: dict) -> list[tuple[str, dict]]:
    spec = pod_spec(workload)
    return ([("init", c) for c in spec.get("initContainers", [])] + [("main", c) for c in spec["containers"]])


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_container_has_resources_and_a_locked_down_security_context(rendered, kustomization):
    for workload in rendered[kustomization].workloads():
        name = workload["metadata"]["name"]
        spec = pod_spec(workload)
        pod_security = spec.get("securityContext", {})
        assert pod_security.get("runAsNonRoot") is True, name
        assert pod_security.get("runAsUser", 0) > 0, name
        assert pod_security.get("seccompProfile") == {"type": "RuntimeDefault"}, name
        assert spec.get("automountServiceAccountToken") is False, f"{name}: no API access needed"
        # Service links would add OMNI_ROUTER_PORT=tcp://... and the like: the OMNI_* namespace
        # is the services' configuration.
        assert spec.get("enableServiceLinks") is False, name
        for _role, container in all_containers(workload):
            where = f"{name}/{container['name']}"
            security = container.get("securityContext", {})
            assert security.get("allowPrivilegeEscalation") is False, where
            assert security.get("readOnlyRootFilesystem") is True, where
            assert security.get("runAsNonRoot", pod_security.get("runAsNonRoot")) is True, where
            assert security.get("capabilities", {}).get("drop") == ["ALL"], where
            assert not security.get("capabilities", {}).get("add"), where
            assert not security.get("privileged"), where
            resources = container.get("resources", {})
            for key in ("cpu", "memory"):
                request, limit = resources.get("requests", {}).get(key), resources.get("limits", {}).get(key)
                assert request is not None and limit is not None, f"{where}: {key} request and limit"
                assert quantity(request) <= quantity(limit), f"{where}: {key} request above its limit"
            # The only writable path: an emptyDir on /tmp (HOME and every cache, see the Dockerfile).
            mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
            volumes = {v["name"]: v for v in spec.get("volumes", [])}
            assert "/tmp" in mounts and "emptyDir" in volumes[mounts["/tmp"]], f"{where}: emptyDir on /tmp"


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_volume_has_exactly_one_source(rendered, kustomization):
    """An overlay that swaps a volume's source must remove the base's one (`emptyDir: null`)."""
    sources = {"emptyDir", "persistentVolumeClaim", "configMap", "secret", "hostPath", "projected", "csi",
               "ephemeral", "nfs", "downwardAPI"}
    for workload in rendered[kustomization].workloads():
        for volume in pod_spec(workload).get("volumes", []):
            present = sources & set(volume)
            assert len(present) == 1, f"{workload['metadata']['name']} volume {volume['name']}: {present}"


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_container_has_startup_readiness_and_liveness_probes_on_its_grpc_port(rendered, kustomization):
    """On the gRPC port, or with mutual TLS (k8s/components/mtls) on the plaintext health-only port
    `health` (--health-port, checked in tests/k8s/test_mtls.py): the kubelet speaks no TLS."""
    for workload in rendered[kustomization].workloads():
        if workload["metadata"]["name"] == "omni-gateway":
            continue  # HTTP, not gRPC: its probes are checked in test_gateway_manifests.py
        for role, container in all_containers(workload):
            where = f"{workload['metadata']['name']}/{container['name']}"
            if role == "init":
                assert not {"startupProbe", "readinessProbe", "livenessProbe"} & set(container), where
                continue
            names = {p["name"] for p in container.get("ports", [])}
            port = container_port(container, "health" if "health" in names else "grpc")
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert probe in container, f"{where}: no {probe}"
            # Readiness is grpc.health.v1 itself: model loaded and taking work (stages), every
            # stage has a healthy replica (router, service omni.v1.Omni), the process up (sessions: a
            # session needs a router only at its first turn); NOT_SERVING while draining.
            if workload["metadata"]["name"] == "omni-router":
                assert container["readinessProbe"]["grpc"] == {"port": port, "service": "omni.v1.Omni"}, where
                # Liveness reads the overall status "", which does not follow the stages, so a stage
                # outage does not restart every router.
                for probe in ("startupProbe", "livenessProbe"):
                    assert container[probe]["grpc"] == {"port": port}, f"{where} {probe}"
            elif workload["metadata"]["name"] == "omni-sessions":  # no model: it serves within a second
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    assert container[probe]["grpc"] == {"port": port}, f"{where} {probe}"
            else:
                assert container["readinessProbe"]["grpc"] == {"port": port}, where
                for probe in ("startupProbe", "livenessProbe"):
                    assert container[probe]["grpc"] == {"port": port}, f"{where} {probe}"
                startup = container["startupProbe"]
                # The port opens only after the model is loaded: minutes for the real checkpoint.
                assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, where


def test_only_the_gpu_overlay_requests_gpus_one_per_stage_pod(overlays, rendered):
    for component in COMPONENTS:
        for name, objects in [("base", rendered["base"]), ("dev-cpu", overlays["dev-cpu"])]:
            for _role, container in all_containers(objects.deployment(component)):
                resources = container["resources"]
                assert GPU not in resources.get("requests", {}) and GPU not in resources.get("limits", {}), (
                    f"{name} {component}/{container['name']}")
        gpu_resources = main_container(overlays["gpu"].deployment(component))["resources"]
        if component in ("router", "sessions"):
            assert GPU not in gpu_resources.get("limits", {}), f"the {component} runs on CPU"
            continue
        # Extended resources: request == limit, one whole GPU per stage pod.
        assert quantity(gpu_resources["limits"][GPU]) == 1, component
        assert quantity(gpu_resources["requests"][GPU]) == 1, component
        tolerations = pod_spec(overlays["gpu"].deployment(component)).get("tolerations", [])
        assert any(t.get("key") == GPU for t in tolerations), f"{component}: tolerates the GPU nodes' taint"


@pytest.mark.parametrize("overlay", ["dev-cpu", "gpu"])
def test_device_follows_the_gpu_request(overlays, overlay):
    """--device cuda exactly where the pod has a GPU; bfloat16 only on the GPU."""
    objects = overlays[overlay]
    for stage in STAGES:
        container = main_container(objects.deployment(stage))
        parsed = parse_with_service(entry_point(container), argv_of(container), container_env(objects, container))
        has_gpu = GPU in container["resources"].get("limits", {})
        assert parsed.args.device.startswith("cuda") == has_gpu, f"{overlay} {stage}: device {parsed.args.device}"
        assert (parsed.args.dtype == "bfloat16") == has_gpu, f"{overlay} {stage}: dtype {parsed.args.dtype}"


def test_replicas_dev_cpu_one_each_gpu_talker_and_code2wav_two(overlays):
    expected = {"dev-cpu": {"thinker": 1, "talker": 1, "code2wav": 1, "router": 1, "sessions": 1},
                "gpu": {"thinker": 1, "talker": 2, "code2wav": 2, "router": 2, "sessions": 2}}
    for overlay, replicas in expected.items():
        for component, count in replicas.items():
            assert overlays[overlay].deployment(component)["spec"]["replicas"] == count, f"{overlay} {component}"
    assert not overlays["dev-cpu"].of_kind("HorizontalPodAutoscaler"), "dev-cpu: one replica each, no autoscaler"


@pytest.mark.parametrize("kustomization", ["base", "overlays/gpu"])
def test_each_stage_autoscales_on_its_own_queue_depth(rendered, kustomization):
    objects = rendered[kustomization]
    hpas = {h["spec"]["scaleTargetRef"]["name"]: h for h in objects.of_kind("HorizontalPodAutoscaler")}
    hpas.pop("omni-gateway", None)  # on CPU, not a queue: test_gateway_manifests.py
    hpas.pop("omni-sessions", None)  # on CPU, not a queue: test_sessions_manifests.py
    assert set(hpas) == {f"omni-{s}" for s in STAGES}, "one autoscaler per stage, none for the router"
    for stage in STAGES:
        hpa = hpas[f"omni-{stage}"]
        assert hpa["apiVersion"] == "autoscaling/v2"
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                                 "name": f"omni-{stage}"}
        (metric,) = hpa["spec"]["metrics"]
        assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == "omni_stage_queue_depth"
        assert metric["pods"]["target"]["type"] == "AverageValue"
        # The Deployment's replicas are the autoscaler's floor, so `kubectl apply` does not fight it.
        replicas = objects.deployment(stage)["spec"]["replicas"]
        assert hpa["spec"]["minReplicas"] == replicas, stage
        assert hpa["spec"]["maxReplicas"] > replicas, stage


def test_the_autoscalers_metric_is_the_one_each_stage_exports():
    from prometheus_client import generate_latest

    from services.serving.metrics import StageMetrics

    for stage in STAGES:
        text = generate_latest(StageMetrics(stage).registry).decode()
        assert f'omni_stage_queue_depth{{stage="{stage}"}}' in text


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_termination_grace_covers_prestop_and_the_services_drain(rendered, kustomization):
    """terminationGracePeriodSeconds > preStop sleep + --grace-s (the longest stream), with margin,
    so SIGKILL never cuts a stream the service is still finishing."""
    objects = rendered[kustomization]
    for component in COMPONENTS:
        workload = objects.deployment(component)
        container = main_container(workload)
        parsed = parse_with_service(entry_point(container), argv_of(container), container_env(objects, container))
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        assert pre_stop[:1] == ["sleep"], f"{component}: preStop sleeps while the router drops the pod"
        sleep_s = float(pre_stop[1])
        total = pod_spec(workload)["terminationGracePeriodSeconds"]
        assert total >= sleep_s + parsed.args.grace_s + 10, (
            f"{kustomization} {component}: terminationGracePeriodSeconds {total} < preStop {sleep_s} + "
            f"--grace-s {parsed.args.grace_s} + 10")


def test_talker_output_bound_fits_the_drain(overlays):
    """The longest stream: the talker's max_new_tokens limit in seconds of audio (12.5 frames/s),
    streamed at real time or faster, must fit in --grace-s (gpu overlay: the real model)."""
    objects = overlays["gpu"]
    container = main_container(objects.deployment("talker"))
    parsed = parse_with_service(entry_point(container), argv_of(container), container_env(objects, container))
    assert parsed.args.max_new_tokens_limit / 12.5 <= parsed.args.grace_s


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_component_has_a_disruption_budget_that_allows_drains(rendered, kustomization):
    objects = rendered[kustomization]
    for component in COMPONENTS:
        pdb = objects.get("PodDisruptionBudget", f"omni-{component}")
        labels = objects.deployment(component)["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items(), component
        # maxUnavailable, not minAvailable: a one-replica stage must not block node drains forever.
        assert pdb["spec"].get("maxUnavailable") == 1 and "minAvailable" not in pdb["spec"], component


@pytest.mark.parametrize("overlay", ["dev-cpu", "gpu"])
def test_torch_threads_fit_the_cpu_limit(overlays, overlay):
    objects = overlays[overlay]
    for stage in STAGES:
        container = main_container(objects.deployment(stage))
        parsed = parse_with_service(entry_point(container), argv_of(container), container_env(objects, container))
        limit = quantity(container["resources"]["limits"]["cpu"])
        assert 0 < parsed.args.threads <= limit, f"{overlay} {stage}: --threads {parsed.args.threads}, cpu {limit}"
