"""Mutual TLS on every hop (k8s/components/mtls, used by the gpu overlay): the manifests' side
(certificates, the names each caller checks, probes, NetworkPolicies) and the pod specs run on
loopback with certificates made here, a request through every hop, a client without a certificate
refused, and a certificate rotation under a running stack (tests/k8s/pods.py says what is rewritten).
"""

from __future__ import annotations

import itertools
import os
import socket
import ssl

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from omni.v1 import common_pb2, omni_pb2_grpc
from services.serving.replicas import ReplicaSource
from services.serving.security import TLSConfig, secure_or_insecure_channel
from services.serving.stage_stubs import stage_stub
from services.tools.client import build_request, collect, connect
from tests.needs import need_command

from .manifests import (
    COMPONENTS,
    K8S,
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
    render,
)
from .pods import LoopbackCluster, issue, make_ca, probe, write_secret_volume

MTLS = "overlays/gpu"  # the overlay that ships the component
PLAINTEXT = ("base", "overlays/dev-cpu")
# The stage each stage calls, at the pod IP the router's route names (the router itself dials
# every stage: its dns:/// targets).
NEXT_STAGE = {"thinker": "talker", "talker": "code2wav"}
# Codec frames the rotation test's stream asks for: the talker and code2wav must still be working on
# it while the certificates rotate (measured: 400 frames take the tiny talker about 7 s on 2 busy
# cores, the rotation and its checks about 0.5 s; but 400 once ended upstream before the checks did
# with a CPU hog beside the suite). Flow control does not hold the stages back: the hops buffer a
# short stream whole (200 frames, 1.5 MB, finished upstream while the client read nothing), so
# only the length keeps it in flight.
LONG_STREAM_FRAMES = 1000


def parsed(objects, component: str):
    container = main_container(objects.deployment(component))
    return parse_with_service(entry_point(container), argv_of(container), container_env(objects, container)).args


def mounted(workload: dict, path: str) -> tuple[str, str]:
    """(Secret name, key) that a file path in the container comes from."""
    container = main_container(workload)
    volumes = {v["name"]: v for v in pod_spec(workload)["volumes"]}
    for mount in container.get("volumeMounts", []):
        if path.startswith(mount["mountPath"].rstrip("/") + "/"):
            volume = volumes[mount["name"]]
            assert "secret" in volume, f"{path}: mounted from {volume}, not a Secret"
            assert "subPath" not in mount and mount.get("readOnly"), mount
            return volume["secret"]["secretName"], path[len(mount["mountPath"].rstrip("/")) + 1:]
    raise AssertionError(f"{workload['metadata']['name']}: nothing is mounted at {path}")


def certificate_for(objects, component: str) -> dict:
    """The Certificate whose Secret the component's pod mounts for --tls-cert."""
    workload = objects.deployment(component)
    secret, key = mounted(workload, parsed(objects, component).tls_cert)
    assert key == "tls.crt"
    (certificate,) = [c for c in objects.of_kind("Certificate") if c["spec"]["secretName"] == secret]
    return certificate


def test_the_gpu_overlay_runs_every_component_with_mutual_tls_from_its_own_secret(rendered):
    objects = rendered[MTLS]
    for component in COMPONENTS:
        args = parsed(objects, component)
        workload = objects.deployment(component)
        files = {flag: mounted(workload, getattr(args, flag)) for flag in ("tls_cert", "tls_key", "tls_ca")}
        # cert-manager's Secret keys: this service's certificate and key, and the CA that signs every peer.
        assert {flag: key for flag, (_, key) in files.items()} == {
            "tls_cert": "tls.crt", "tls_key": "tls.key", "tls_ca": "ca.crt"}, component
        assert len({secret for secret, _ in files.values()}) == 1, component
        assert certificate_for(objects, component)["metadata"]["name"] == f"omni-{component}"


@pytest.mark.parametrize("kustomization", PLAINTEXT)
def test_dev_cpu_and_the_base_stay_plaintext(rendered, kustomization):
    objects = rendered[kustomization]
    assert not objects.of_kind("Certificate") and not objects.of_kind("Issuer")
    for component in COMPONENTS:
        args = parsed(objects, component)
        assert not (args.tls_cert or args.tls_key or args.tls_ca), component


def test_certificates_come_from_the_pipeline_ca_and_are_renewed_by_cert_manager(rendered):
    objects = rendered[MTLS]
    issuers = {i["metadata"]["name"]: i["spec"] for i in objects.of_kind("Issuer")}
    certificates = {c["metadata"]["name"]: c["spec"] for c in objects.of_kind("Certificate")}
    ca = certificates.pop("omni-ca")
    assert ca["isCA"] and "selfSigned" in issuers[ca["issuerRef"]["name"]]
    # Renewed with the same key, so certificates signed before a renewal still verify.
    assert ca["privateKey"]["rotationPolicy"] == "Never"
    (ca_issuer,) = [name for name, spec in issuers.items() if spec.get("ca", {}).get("secretName") == ca["secretName"]]
    assert set(certificates) == {f"omni-{c}" for c in COMPONENTS + ("gateway", "client")}
    for name, spec in certificates.items():
        assert spec["issuerRef"] == {"name": ca_issuer, "kind": "Issuer", "group": "cert-manager.io"}, name
        assert "client auth" in spec["usages"], name  # every one is presented to a server
        if name != "omni-client":
            assert "server auth" in spec["usages"], name
        assert spec["duration"] and spec["renewBefore"] and spec["privateKey"]["rotationPolicy"] == "Always", name


def test_every_certificate_carries_the_names_its_callers_check(rendered):
    objects = rendered[MTLS]
    namespace = objects.deployment("router")["metadata"]["namespace"]
    names = {c: set(certificate_for(objects, c)["spec"]["dnsNames"]) for c in COMPONENTS}
    router = parsed(objects, "router")
    for stage in STAGES:
        # The router dials each replica at its pod IP and checks the name it found it under.
        source = ReplicaSource.parse(getattr(router, stage), f"--{stage}")
        checked = router.tls_server_name or source.dns_host
        assert source.dns_host == f"omni-{stage}" == objects.get("Service", f"omni-{stage}")["metadata"]["name"]
        assert checked in names[stage], f"router -> {stage}: checks {checked!r}, certificate has {names[stage]}"
    for caller, callee in NEXT_STAGE.items():
        # The route names a pod IP (the router resolved the callee's headless Service), which no
        # certificate can list: the caller must check the Service name instead.
        checked = parsed(objects, caller).tls_server_name
        assert checked == f"omni-{callee}" and checked in names[callee], f"{caller} -> {callee}: {checked!r}"
    assert parsed(objects, "code2wav").tls_server_name is None  # calls nobody
    for component in COMPONENTS:
        service = f"omni-{component}"
        # Short name (same namespace, the gateway), and the Service's full names (other namespaces).
        assert {service, f"{service}.{namespace}.svc", f"{service}.{namespace}.svc.cluster.local"} <= names[component]
    gateway = objects.get("Certificate", "omni-gateway")["spec"]
    assert "omni-gateway" in gateway["dnsNames"] and "client auth" in gateway["usages"]  # gateway -> router


def test_probes_use_the_plaintext_health_port_and_the_work_port_requires_client_certificates(rendered):
    objects = rendered[MTLS]
    for component in COMPONENTS:
        args = parsed(objects, component)
        container = main_container(objects.deployment(component))
        health = container_port(container, "health")
        assert args.health_port == health != args.port, component
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[kind]["grpc"]["port"] == health, f"{component} {kind}"
        assert args.tls_ca, f"{component}: without a CA the work port would not ask for client certificates"
    for service in ("omni-router", "omni-sessions"):
        assert "appProtocol" not in objects.get("Service", service)["spec"]["ports"][0], service  # not h2c any more


def test_network_policies_open_the_health_port_to_no_pod_and_work_ports_to_their_callers_only(rendered):
    """A NetworkPolicy selects pods, namespaces and IP blocks; the kubelet's probes come from the
    node itself, which NetworkPolicy always lets through (it cannot block a pod's own node). So the
    health port is listed in no rule: no pod anywhere reaches it, the kubelet still does."""
    objects = rendered[MTLS]
    namespace = objects.deployment("router")["metadata"]["namespace"]
    policies = objects.of_kind("NetworkPolicy")
    peers = {c: Peer(namespace, (("kubernetes.io/metadata.name", namespace),),
                     tuple(sorted(objects.deployment(c)["spec"]["template"]["metadata"]["labels"].items())))
             for c in COMPONENTS}
    peers["client"] = Peer("apps", (("kubernetes.io/metadata.name", "apps"),), (("app", "client"),))
    peers["gateway"] = Peer(namespace, (("kubernetes.io/metadata.name", namespace),),
                            (("app.kubernetes.io/component", "gateway"), ("app.kubernetes.io/name", "omni-gateway")))
    callers = {"router": set(peers), "sessions": set(peers), "thinker": {"router"}, "talker": {"thinker", "router"},
               "code2wav": {"talker", "router"}}
    wrong = []
    for source, target in itertools.product(peers, COMPONENTS):
        workload = objects.deployment(target)
        container = main_container(workload)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        labels = workload["spec"]["template"]["metadata"]["labels"]
        for name, expected in (("grpc", source in callers[target]), ("health", False)):
            got = ingress_allowed(policies, namespace, labels, ports, peers[source], ports[name])
            if got != expected:
                wrong.append(f"{source} -> {target}:{name} {'allowed' if got else 'denied'}")
    assert not wrong, "\n".join(wrong)


# ---- the pod specs, running ----

def client_tls(cluster: LoopbackCluster, secret: str = "omni-client-tls", server_name: str = "omni-router") -> TLSConfig:
    folder = cluster.secret_dir(secret)
    return TLSConfig(cert=(folder / "tls.crt").read_bytes(), key=(folder / "tls.key").read_bytes(),
                     ca=(folder / "ca.crt").read_bytes(), server_name=server_name)


class PKI:
    """The certificates cert-manager would put in each Certificate's Secret, and their rotation."""

    def __init__(self, objects, directory):
        self.objects, self.directory = objects, directory
        self.certificates = [c for c in objects.of_kind("Certificate") if not c["spec"].get("isCA")]
        self.cas: dict[str, bytes] = {}
        self.leaves: dict[tuple[str, str], tuple[bytes, bytes]] = {}  # (certificate, ca) -> cert, key

    def new_ca(self, name: str) -> None:
        make_ca(self.directory, name, f"omni-serve-ca {name}")
        self.cas[name] = (self.directory / f"{name}.pem").read_bytes()

    def issue_all(self, ca: str) -> None:
        for certificate in self.certificates:
            self.leaves[certificate["metadata"]["name"], ca] = issue(self.directory, ca, certificate, ca)

    def write(self, cluster: LoopbackCluster, leaf_ca: str, trusted: tuple[str, ...]) -> None:
        """Every Secret volume: the leaves signed by `leaf_ca`, ca.crt = the `trusted` CAs."""
        for certificate in self.certificates:
            cert, key = self.leaves[certificate["metadata"]["name"], leaf_ca]
            write_secret_volume(cluster.secret_dir(certificate["spec"]["secretName"]),
                                {"tls.crt": cert, "tls.key": key, "ca.crt": b"".join(self.cas[c] for c in trusted)})


@pytest.fixture(scope="module")
def running(rendered, tiny_checkpoint, tmp_path_factory):
    need_command("openssl", "the test issues the cluster's certificates with it")
    objects = rendered[MTLS]
    root = tmp_path_factory.mktemp("mtls-pods")
    (root / "pki").mkdir()
    pki = PKI(objects, root / "pki")
    pki.new_ca("ca1")
    pki.issue_all("ca1")
    cluster = LoopbackCluster(objects, root, tiny_checkpoint)
    pki.write(cluster, "ca1", ("ca1",))
    try:
        for component in ("code2wav", "talker", "thinker", "router", "sessions"):  # sessions: ready at once
            cluster.start(component)
        yield cluster, pki
    finally:
        cluster.stop()


def work_port(cluster: LoopbackCluster, component: str) -> str:
    return f"127.0.0.1:{cluster.pods[component].ports['grpc']}"


@pytest.mark.slow  # the pod specs' 5 processes on loopback (`running`): ~50 s of make test's 2 cores
def test_a_request_goes_through_the_pod_specs_with_mutual_tls_on_every_hop(running):
    cluster, _ = running
    channel, stub = connect(work_port(cluster, "router"), client_tls(cluster))
    with channel:
        result = collect(stub, build_request("hello", max_new_tokens=4, talker_max_new_tokens=6), timeout=120)
    assert len(result.thinker_token_ids) == 4 and result.audio_chunks
    for component in COMPONENTS:
        # Every probe of the pod spec passes, in plaintext; the work port wants TLS and a client
        # certificate.
        pod = cluster.pods[component]
        container = main_container(cluster.objects.deployment(component))
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            spec = container[kind]["grpc"]
            assert probe(pod.port_map[spec["port"]], spec.get("service", "")) == "SERVING", f"{component} {kind}"
        assert probe(pod.ports["grpc"]) == "UNAVAILABLE", component


@pytest.mark.slow  # the pods, as above
@pytest.mark.parametrize("client", ["plaintext", "tls-without-certificate", "certificate-of-another-ca"])
def test_a_client_without_a_pipeline_certificate_is_refused_by_every_component(running, client, tmp_path):
    cluster, pki = running
    cert = key = None
    if client == "certificate-of-another-ca":
        make_ca(tmp_path, "rogue", "rogue")
        cert, key = issue(tmp_path, "rogue", pki.objects.get("Certificate", "omni-client"), "rogue")
    for component in COMPONENTS:
        good = client_tls(cluster, server_name=f"omni-{component}")
        tls = TLSConfig() if client == "plaintext" else TLSConfig(cert=cert, key=key, ca=good.ca,
                                                                  server_name=good.server_name)
        channel = secure_or_insecure_channel(work_port(cluster, component), tls, [], aio=False)
        with channel, pytest.raises(grpc.RpcError) as info:
            if component == "router":
                collect(omni_pb2_grpc.OmniStub(channel), build_request("hi", max_new_tokens=2), timeout=10)
            elif component == "sessions":
                omni_pb2_grpc.SessionsStub(channel).GetLoad(common_pb2.LoadRequest(), timeout=10)
            else:
                stage_stub(component, channel).GetLoad(common_pb2.LoadRequest(), timeout=10)
        assert info.value.code() is grpc.StatusCode.UNAVAILABLE, component


def served_certificate(address: str, tls: TLSConfig) -> bytes:
    """The DER certificate a server presents to a fresh TLS handshake by this client (verified)."""
    context = ssl.create_default_context(cadata=tls.ca.decode())
    context.set_alpn_protocols(["h2"])
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as raw, \
            context.wrap_socket(raw, server_hostname=tls.server_name) as wrapped:
        return wrapped.getpeercert(binary_form=True)


def stage_in_flight(cluster: LoopbackCluster) -> dict[str, int]:
    """Streams open in each stage (GetLoad), asked with the client certificate in the files now."""
    loads = {}
    for stage in STAGES:
        tls = client_tls(cluster, server_name=f"omni-{stage}")
        with secure_or_insecure_channel(work_port(cluster, stage), tls, [], aio=False) as channel:
            loads[stage] = stage_stub(stage, channel).GetLoad(common_pb2.LoadRequest(), timeout=10).in_flight
    return loads


@pytest.mark.slow  # the pods, as above
def test_rotated_certificates_are_taken_without_a_restart_and_a_stream_in_flight_completes(running):
    """A stream starts, its client stops reading at the first audio chunk, and every Secret rotates
    (files swapped the way the kubelet does) to a new CA in the three steps a CA change takes
    (trust both CAs; new leaves; trust only the new CA). Then the servers present the new
    certificates and refuse the old ones, a new request goes through every hop (only the new CA is
    trusted anywhere now, so every hop handshook with the new certificates), and the paused stream,
    on connections made before the rotation, completes. No process restarts."""
    cluster, pki = running
    pids = {c: p.popen.pid for c, p in cluster.pods.items()}
    old_client = client_tls(cluster)
    old_stage_client = {s: client_tls(cluster, server_name=f"omni-{s}") for s in (*STAGES, "sessions")}
    old_leaves = {c: ssl.PEM_cert_to_DER_cert(pki.leaves[f"omni-{c}", "ca1"][0].decode()) for c in COMPONENTS}
    channel, stub = connect(work_port(cluster, "router"), old_client)
    call = stub.Generate(build_request("hello", max_new_tokens=6, talker_max_new_tokens=LONG_STREAM_FRAMES),
                         timeout=300)
    events = iter(call)
    seen = []
    while not any(e.WhichOneof("event") == "audio" for e in seen):
        seen.append(next(events))
    in_flight_before = stage_in_flight(cluster)

    pki.new_ca("ca2")
    pki.issue_all("ca2")
    pki.write(cluster, "ca1", ("ca1", "ca2"))
    pki.write(cluster, "ca2", ("ca1", "ca2"))
    pki.write(cluster, "ca2", ("ca2",))

    new_client = client_tls(cluster)
    for component in COMPONENTS:
        tls = client_tls(cluster, server_name=f"omni-{component}")
        served = served_certificate(work_port(cluster, component), tls)
        assert served == ssl.PEM_cert_to_DER_cert(pki.leaves[f"omni-{component}", "ca2"][0].decode()), component
        assert served != old_leaves[component]
        old = old_client if component == "router" else old_stage_client[component]
        assert health_over_tls(work_port(cluster, component), old) == "UNAVAILABLE", component
    in_flight_during = stage_in_flight(cluster)
    second_channel, second_stub = connect(work_port(cluster, "router"), new_client)
    with second_channel:
        second = collect(second_stub, build_request("again", max_new_tokens=4, talker_max_new_tokens=6),
                         timeout=120)
    assert len(second.thinker_token_ids) == 4 and second.audio_chunks

    seen += list(events)
    channel.close()
    assert call.code() is grpc.StatusCode.OK
    kinds = [e.WhichOneof("event") for e in seen]
    assert kinds[-1] == "final" and kinds.count("audio") >= 2, kinds
    assert {c: p.popen.pid for c, p in cluster.pods.items()} == pids
    assert all(p.popen.poll() is None for p in cluster.pods.values())
    # The stream was still being worked on while the files rotated: the talker was generating its
    # frames and code2wav decoding them (the thinker, done with its few text tokens, only relays
    # the audio back to the router by then, on its connections from before the rotation).
    for when, loads in (("before", in_flight_before), ("during", in_flight_during)):
        assert loads["talker"] >= 1 and loads["code2wav"] >= 1, (
            f"{when} the rotation {loads}: the stream was done upstream; raise LONG_STREAM_FRAMES")


def health_over_tls(address: str, tls: TLSConfig) -> str:
    with secure_or_insecure_channel(address, tls, [], aio=False) as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        except grpc.RpcError as exc:
            return exc.code().name
    return "SERVING"


def test_the_component_mounts_the_gateway_certificate_and_points_its_router_calls_at_it(kubectl, tmp_path):
    """The gateway (k8s/base/gateway.yaml) gets Secret omni-gateway-tls at /etc/omni/tls like every
    other pod, and its OMNI_TLS_* name those files, so its calls to the router use mutual TLS."""
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(K8S / "base", tmp_path)],
        "components": [os.path.relpath(K8S / "components" / "mtls", tmp_path)]}))
    objects = {(o["kind"], o["metadata"]["name"]): o for o in render(kubectl, str(tmp_path))}
    gateway = objects["Deployment", "omni-gateway"]
    secret, key = mounted(gateway, "/etc/omni/tls/tls.crt")
    assert secret == objects["Certificate", "omni-gateway"]["spec"]["secretName"] and key == "tls.crt"
    config_name = gateway["spec"]["template"]["spec"]["containers"][0]["envFrom"][0]["configMapRef"]["name"]
    config = next(o for (kind, name), o in objects.items() if kind == "ConfigMap" and name == config_name)
    assert {k: config["data"][k] for k in ("OMNI_TLS_CERT", "OMNI_TLS_KEY", "OMNI_TLS_CA")} == {
        "OMNI_TLS_CERT": "/etc/omni/tls/tls.crt", "OMNI_TLS_KEY": "/etc/omni/tls/tls.key",
        "OMNI_TLS_CA": "/etc/omni/tls/ca.crt"}
    assert mounted(objects["Deployment", "omni-router"], "/etc/omni/tls/ca.crt") == ("omni-router-tls", "ca.crt")
