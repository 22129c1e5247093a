"""The manifests speak the services' language: each container's command, args and OMNI_*
environment parse with that service's own argparse, every variable set is one the service reads,
ports and Service names line up, and code2wav actually starts from its dev-cpu pod spec."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from .manifests import (
    COMPONENTS,
    KUSTOMIZATIONS,
    STAGES,
    argv_of,
    container_env,
    container_port,
    dockerfile_env,
    entry_point,
    flag_value,
    main_container,
    parse_with_service,
    pod_spec,
    with_flag,
)

# Seconds for code2wav to load the tiny checkpoint and answer SERVING (about 15 s on 2 busy cores).
START_TIMEOUT_S = 120


def every_container(objects):
    for workload in objects.workloads():
        spec = pod_spec(workload)
        for container in spec.get("initContainers", []) + spec["containers"]:
            yield workload, container


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_container_command_args_and_env_parse_with_its_services_own_parser(rendered, kustomization):
    objects = rendered[kustomization]
    for _workload, container in every_container(objects):
        # Raises with the service's own argparse message on an unknown flag or a bad value.
        parse_with_service(entry_point(container), argv_of(container), container_env(objects, container))


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_omni_variable_a_container_gets_is_one_its_service_reads(rendered, kustomization):
    """A misspelt or misplaced OMNI_* variable is silently ignored by the service: catch it here."""
    objects = rendered[kustomization]
    for workload, container in every_container(objects):
        env = container_env(objects, container)
        parsed = parse_with_service(entry_point(container), argv_of(container), env)
        unread = sorted(k for k in env if k.startswith("OMNI_") and k not in parsed.env_read)
        assert not unread, f"{kustomization} {workload['metadata']['name']}/{container['name']}: {unread} are not read"


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_listen_ports_match_container_ports_services_and_scrape_annotations(rendered, kustomization):
    objects = rendered[kustomization]
    for component in COMPONENTS:
        workload = objects.deployment(component)
        container = main_container(workload)
        parsed = parse_with_service(entry_point(container), argv_of(container), container_env(objects, container))
        assert parsed.args.port == container_port(container, "grpc"), component
        assert parsed.args.metrics_port == container_port(container, "metrics") > 0, component
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(parsed.args.metrics_port), component
        service = objects.get("Service", f"omni-{component}")
        assert service["spec"]["selector"].items() <= workload["spec"]["template"]["metadata"]["labels"].items()
        (port,) = service["spec"]["ports"]
        assert port["targetPort"] in ("grpc", parsed.args.port), component


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_router_finds_every_stage_through_its_headless_service(rendered, kustomization):
    from services.serving.replicas import ReplicaSource

    objects = rendered[kustomization]
    router = main_container(objects.deployment("router"))
    parsed = parse_with_service(entry_point(router), argv_of(router), container_env(objects, router))
    for stage in STAGES:
        flag = getattr(parsed.args, stage)
        source = ReplicaSource.parse(flag, f"--{stage}")
        assert source.dns_host is not None, f"--{stage}={flag}: replicas come from DNS, not a fixed list"
        service = objects.get("Service", source.dns_host)
        # Headless: one A record per ready pod, so the router sees (and balances over) every replica.
        assert service["spec"].get("clusterIP") == "None", source.dns_host
        (port,) = service["spec"]["ports"]
        assert port["port"] == source.dns_port, f"--{stage}={flag} vs Service port {port['port']}"
        stage_container = main_container(objects.deployment(stage))
        stage_args = parse_with_service(entry_point(stage_container), argv_of(stage_container),
                                        container_env(objects, stage_container)).args
        assert source.dns_port == stage_args.port, f"--{stage}={flag}: the {stage} listens on {stage_args.port}"


@pytest.mark.parametrize("overlay", ["dev-cpu", "gpu"])
def test_each_stage_reads_its_checkpoint_from_the_checkpoint_volume(overlays, overlay):
    objects = overlays[overlay]
    for stage in STAGES:
        workload = objects.deployment(stage)
        spec = pod_spec(workload)
        container = main_container(workload)
        parsed = parse_with_service(entry_point(container), argv_of(container), container_env(objects, container))
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        mount = mounts["checkpoint"]
        assert mount.get("readOnly") is True, f"{overlay} {stage}: the stage only reads the checkpoint"
        assert parsed.args.checkpoint.startswith(mount["mountPath"].rstrip("/") + "/"), (overlay, stage)
        volume = {v["name"]: v for v in spec["volumes"]}["checkpoint"]
        if overlay == "dev-cpu":
            # Written by the initContainer into the pod's emptyDir, where the stage looks for it.
            (init,) = spec["initContainers"]
            assert entry_point(init) == "services.tools.tiny_checkpoint:main"
            assert flag_value(argv_of(init), "--out") == parsed.args.checkpoint, stage
            assert "emptyDir" in volume
            init_mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
            assert init_mounts["checkpoint"] == mount["mountPath"]
        else:
            claim = volume["persistentVolumeClaim"]["claimName"]
            pvc = objects.get("PersistentVolumeClaim", claim)
            assert "ReadOnlyMany" in pvc["spec"]["accessModes"], "every replica mounts it, on any node"


# ---- one service started from its manifest ----

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(port: int, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                pytest.fail(f"code2wav exited {process.returncode} at start-up:\n{log.read_text()[-3000:]}")
            try:
                if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    pytest.fail(f"code2wav not SERVING after {START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


def listed_services(port: int) -> set[str]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        (response,) = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                timeout=5)
        return {s.name for s in response.list_services_response.service}


@pytest.mark.slow  # a code2wav process from its pod spec: ~28 s of make test's 2 cores; make test-slow (CI)
def test_code2wav_starts_from_its_dev_cpu_pod_spec_and_reports_serving(overlays, tiny_checkpoint, tmp_path):
    """Runs the container's command with its args and environment (image ENV + ConfigMaps), its
    volumes as folders here (the checkpoint volume holding what the initContainer writes), and
    only the ports swapped for free ones; then asks grpc.health.v1, reflection and /metrics, and
    stops it with SIGTERM as the kubelet would."""
    objects = overlays["dev-cpu"]
    workload = objects.deployment("code2wav")
    container = main_container(workload)
    (init,) = pod_spec(workload)["initContainers"]

    # Volume mounts -> folders here; every path in args and env is rewritten through them.
    mounts = {m["mountPath"].rstrip("/"): tmp_path / m["name"] for m in container["volumeMounts"]}
    for folder in mounts.values():
        folder.mkdir()

    def local(value: str) -> str:
        for mount_path in sorted(mounts, key=len, reverse=True):
            if value == mount_path or value.startswith(mount_path + "/"):
                return str(mounts[mount_path]) + value[len(mount_path):]
        return value

    written = Path(local(flag_value(argv_of(init), "--out")))
    written.symlink_to(tiny_checkpoint, target_is_directory=True)

    env = {k: local(v) for k, v in (dockerfile_env() | container_env(objects, container)).items()}
    grpc_port, metrics_port = free_port(), free_port()
    argv = [local(a) for a in argv_of(container)]
    argv = with_flag(with_flag(argv, "--port", str(grpc_port)), "--metrics-port", str(metrics_port))

    script = Path(sys.executable).parent / container["command"][0]
    module = entry_point(container).split(":")[0]
    command = [str(script)] if script.exists() else [sys.executable, "-m", module]
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_")}
    log = tmp_path / "code2wav.log"
    with open(log, "w") as out:
        process = subprocess.Popen(command + argv, env=base_env | env, cwd=tmp_path, stdout=out,
                                   stderr=subprocess.STDOUT)
    try:
        wait_serving(grpc_port, process, log)
        assert "omni.v1.Code2Wav" in listed_services(grpc_port)
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
            assert 'omni_stage_queue_depth{stage="code2wav"}' in response.read().decode()
        process.send_signal(signal.SIGTERM)
        # Nothing in flight: the drain ends at once, well inside --grace-s.
        assert process.wait(timeout=30) == 0, log.read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
