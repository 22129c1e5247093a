"""Running rendered pod specs on loopback: the certificates cert-manager would issue (made here with
the openssl command line from the Certificate objects), laid out the way the kubelet mounts a
Secret, and every pipeline container started as a process with its pod's command, args and
environment. What is rewritten, and nothing else:

- mount paths -> a temp dir (a Secret volume -> its files; the checkpoint volume -> a folder holding
  the tiny checkpoint under the name the pod expects);
- ports -> free loopback ports (the same port everywhere it appears: args, the router's targets);
- OMNI_DEVICE/OMNI_DTYPE/OMNI_THREADS -> cpu/float32/1, and --host 127.0.0.1 (the gpu overlay's
  values need a GPU);
- DNS: the router resolves the stages' Service names to 127.0.0.1 (tests/k8s/dns_shim.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.tools.launcher import free_port

from .manifests import Rendered, argv_of, container_env, entry_point, main_container, pod_spec

USAGE_EKU = {"server auth": "serverAuth", "client auth": "clientAuth"}


# ---- certificates, the way cert-manager's CA Issuer fills the Secrets ----

def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(directory: Path, name: str, common_name: str) -> None:
    """A self-signed ECDSA P-256 CA (`name`.pem, `name`.key), as the omni-ca Certificate asks."""
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2",
            "-subj", f"/CN={common_name}", "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign",
            "-keyout", f"{name}.key", "-out", f"{name}.pem", cwd=directory)


def issue(directory: Path, ca: str, certificate: dict, tag: str) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) for a cert-manager Certificate's spec, signed by `ca`."""
    spec = certificate["spec"]
    name = f"{certificate['metadata']['name']}-{tag}"
    assert spec["privateKey"] == {"algorithm": "ECDSA", "size": 256, "rotationPolicy": "Always"}, name
    ekus = [USAGE_EKU[u] for u in spec["usages"] if u in USAGE_EKU]
    lines = ["basicConstraints=CA:FALSE", "keyUsage=critical,digitalSignature,keyEncipherment",
             f"extendedKeyUsage={','.join(ekus)}"]
    if spec.get("dnsNames"):
        lines.append("subjectAltName=" + ",".join(f"DNS:{n}" for n in spec["dnsNames"]))
    (directory / f"{name}.ext").write_text("\n".join(lines) + "\n")
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-subj", f"/CN={spec['commonName']}", "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=directory)
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
            "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=directory)
    return (directory / f"{name}.pem").read_bytes(), (directory / f"{name}.key").read_bytes()


def write_secret_volume(root: Path, files: dict[str, bytes]) -> None:
    """Write (or replace) a Secret volume the way the kubelet does: the files in a fresh timestamped
    folder, `..data` pointing at it, swapped in one rename, and each key a symlink through `..data`."""
    root.mkdir(parents=True, exist_ok=True)
    version = root / f"..{time.strftime('%Y_%m_%d_%H_%M_%S')}.{time.monotonic_ns()}"
    version.mkdir()
    for key, data in files.items():
        (version / key).write_bytes(data)
        (version / key).chmod(0o440)
    tmp = root / "..data_tmp"
    if tmp.is_symlink():
        tmp.unlink()
    tmp.symlink_to(version.name)
    os.replace(tmp, root / "..data")  # the atomic swap
    for key in files:
        link = root / key
        if not link.is_symlink():
            link.symlink_to(f"..data/{key}")


# ---- the pods as processes ----

@dataclass
class PodProcess:
    component: str
    argv: list[str]
    env: dict[str, str]
    ports: dict[str, int]  # container port name -> the loopback port it got
    readiness_service: str
    log: Path
    probe_port: int = 0  # the readiness probe's port, rewritten
    port_map: dict[int, int] = field(default_factory=dict)  # container port -> loopback port
    popen: subprocess.Popen | None = None


@dataclass
class LoopbackCluster:
    """The pipeline Deployments of one rendered overlay, one replica each, as local processes."""

    objects: Rendered
    root: Path  # where the mounts go
    checkpoint: Path  # the tiny checkpoint
    pods: dict[str, PodProcess] = field(default_factory=dict)

    def secret_dir(self, secret_name: str) -> Path:
        return self.root / "secrets" / secret_name

    def _mounts(self, workload: dict, container: dict, env: dict[str, str]) -> dict[str, Path]:
        volumes = {v["name"]: v for v in pod_spec(workload).get("volumes", [])}
        mounts = {}
        for mount in container.get("volumeMounts", []):
            assert "subPath" not in mount, f"{container['name']}: a subPath mount never sees Secret updates"
            volume = volumes[mount["name"]]
            if "secret" in volume:
                mounts[mount["mountPath"]] = self.secret_dir(volume["secret"]["secretName"])
            elif mount["name"] == "checkpoint":
                folder = self.root / "volumes" / workload["metadata"]["name"] / "checkpoint"
                folder.mkdir(parents=True, exist_ok=True)
                expected = env["OMNI_CHECKPOINT"]
                assert expected.startswith(mount["mountPath"] + "/")
                link = folder / expected[len(mount["mountPath"]) + 1:]
                if not link.exists():
                    link.symlink_to(self.checkpoint)
                mounts[mount["mountPath"]] = folder
        return mounts

    def prepare(self, component: str) -> PodProcess:
        workload = self.objects.deployment(component)
        container = main_container(workload)
        env = container_env(self.objects, container)
        mounts = self._mounts(workload, container, env)
        own = {p["containerPort"]: free_port() for p in container["ports"]}
        named = {p["name"]: own[p["containerPort"]] for p in container["ports"]}

        def rewrite(value: str) -> str:
            for mount_path, local in mounts.items():
                if value == mount_path or value.startswith(mount_path + "/"):
                    return str(local) + value[len(mount_path):]
            return value

        argv = []
        for item in argv_of(container):
            flag, eq, value = item.partition("=")
            if eq and value.isdigit() and int(value) in own:
                item = f"{flag}={own[int(value)]}"
            argv.append(rewrite(item))
        env = {k: rewrite(v) for k, v in env.items()}
        env.update(OMNI_DEVICE="cpu", OMNI_DTYPE="float32", OMNI_THREADS="1", OMNI_HOST="127.0.0.1")
        for stage in ("thinker", "talker", "code2wav"):  # the router's dns:///omni-<stage>:<port>
            key = f"OMNI_{stage.upper()}"
            if key in env and stage in self.pods:
                host, _, port = env[key].rpartition(":")
                env[key] = f"{host}:{self.service_port(stage, int(port))}"
        probe = container["readinessProbe"]["grpc"]
        assert probe["port"] in own, f"{component}: readiness probe on a port the container does not declare"
        pod = PodProcess(component, argv, env, named, probe.get("service", ""),
                         self.root / "logs" / f"{component}.log")
        pod.probe_port = own[probe["port"]]
        pod.port_map = own
        self.pods[component] = pod
        return pod

    def service_port(self, component: str, port: int) -> int:
        """The loopback port behind Service omni-<component>'s `port` (its targetPort, by name)."""
        (entry,) = [p for p in self.objects.get("Service", f"omni-{component}")["spec"]["ports"] if p["port"] == port]
        return self.pods[component].ports[entry["targetPort"]]

    def start(self, component: str, timeout_s: float = 180.0) -> PodProcess:
        pod = self.prepare(component)
        module = entry_point(main_container(self.objects.deployment(component))).split(":")[0]
        env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_")} | pod.env
        env["PYTHONUNBUFFERED"] = "1"
        command = [sys.executable, "-m", module, *pod.argv]
        if component == "router":
            env["OMNI_TEST_LOOPBACK_NAMES"] = ",".join(f"omni-{s}" for s in ("thinker", "talker", "code2wav"))
            command = [sys.executable, "-m", "tests.k8s.dns_shim", module, *pod.argv]
        pod.log.parent.mkdir(parents=True, exist_ok=True)
        with open(pod.log, "w") as log:
            pod.popen = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        self.wait_ready(pod, timeout_s)
        return pod

    def wait_ready(self, pod: PodProcess, timeout_s: float) -> None:
        """What the kubelet's readiness probe does: grpc.health.v1 Check, plaintext, on its port."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if pod.popen.poll() is not None:
                raise AssertionError(f"{pod.component} exited with {pod.popen.returncode}:\n{pod.log.read_text()[-3000:]}")
            if probe(pod.probe_port, pod.readiness_service) == "SERVING":
                return
            time.sleep(0.2)
        raise AssertionError(f"{pod.component} not ready within {timeout_s:.0f} s:\n{pod.log.read_text()[-3000:]}")

    def stop(self) -> None:
        order = sorted(self.pods.values(), key=lambda p: p.component != "router")
        for pod in order:
            if pod.popen is not None and pod.popen.poll() is None:
                pod.popen.send_signal(signal.SIGTERM)
        for pod in order:
            if pod.popen is None:
                continue
            try:
                pod.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pod.popen.kill()
                pod.popen.wait()


def probe(port: int, service: str = "", timeout: float = 1.0) -> str:
    """A plaintext grpc.health.v1 Check, like the kubelet's gRPC probe."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            return exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
