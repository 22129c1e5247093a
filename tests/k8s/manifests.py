"""Reading the rendered Kubernetes manifests: kustomize rendering, objects by kind, each container's
effective configuration (args + envFrom + env), the services' own argument parsers, and
NetworkPolicy semantics. Plain functions; the fixtures live in conftest.py."""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shutil
import subprocess
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
OVERLAYS = ("dev-cpu", "gpu")
# Every kustomization a user can build: the overlays, and the base they share.
KUSTOMIZATIONS = ("base",) + tuple(f"overlays/{name}" for name in OVERLAYS)
STAGES = ("thinker", "talker", "code2wav")
COMPONENTS = STAGES + ("router", "sessions")
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet")
# kubectl 1.27 is the first with kustomize v5 (`labels`, `patches` with label selectors).
MIN_KUBECTL = (1, 27)


# ---- rendering ----

def find_kubectl() -> str:
    """The kubectl to render with: $KUBECTL, else the one on PATH; fails with a clear message."""
    kubectl = os.environ.get("KUBECTL") or shutil.which("kubectl")
    if not kubectl:
        raise RuntimeError(
            "kubectl not found: the k8s manifest tests render every overlay with `kubectl kustomize` "
            "(kubectl >= 1.27, kustomize v5). Install kubectl or set KUBECTL=/path/to/kubectl. "
            "Debian's kubernetes-client package (kubectl 1.20, kustomize v2) is too old.")
    try:
        out = subprocess.run([kubectl, "version", "--client", "-o", "yaml"], capture_output=True, text=True,
                             timeout=60)
    except OSError as exc:
        raise RuntimeError(f"kubectl {kubectl!r} cannot run: {exc}") from None
    info = yaml.safe_load(out.stdout or "{}") or {}
    client = info.get("clientVersion", {})
    version = (int(re.sub(r"\D.*", "", client.get("major", "0")) or 0),
               int(re.sub(r"\D.*", "", client.get("minor", "0")) or 0))
    if out.returncode != 0 or version < MIN_KUBECTL:
        raise RuntimeError(f"{kubectl}: kubectl {'.'.join(map(str, version))} found, the k8s manifest tests need "
                           f">= {'.'.join(map(str, MIN_KUBECTL))} (kustomize v5): {out.stderr.strip()}")
    return kubectl


def render(kubectl: str, kustomization: str) -> list[dict]:
    out = subprocess.run([kubectl, "kustomize", str(K8S / kustomization)], capture_output=True, text=True,
                         timeout=120)
    if out.returncode != 0:
        raise AssertionError(f"kubectl kustomize k8s/{kustomization} failed:\n{out.stderr}")
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@dataclass
class Rendered:
    """One kustomization's output."""

    name: str
    objects: list[dict]

    def of_kind(self, kind: str) -> list[dict]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict:
        found = [o for o in self.of_kind(kind) if o["metadata"]["name"] == name]
        assert len(found) == 1, f"{self.name}: expected one {kind}/{name}, found {len(found)}"
        return found[0]

    def workloads(self) -> list[dict]:
        return [o for o in self.objects if o["kind"] in WORKLOAD_KINDS]

    def deployment(self, component: str) -> dict:
        return self.get("Deployment", f"omni-{component}")

    def config_map(self, name: str) -> dict:
        return self.get("ConfigMap", name)


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def main_container(workload: dict) -> dict:
    containers = pod_spec(workload)["containers"]
    assert len(containers) == 1, f"{workload['metadata']['name']}: expected one container"
    return containers[0]


def container_port(container: dict, name: str) -> int:
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    assert name in ports, f"container {container['name']} has no port named {name}: {ports}"
    return ports[name]


# ---- a container's effective configuration ----

def container_env(rendered: Rendered, container: dict) -> dict[str, str]:
    """The variables Kubernetes gives the container: envFrom in order (later wins), then env."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        assert "configMapRef" in source, f"{container['name']}: only configMapRef envFrom is expected: {source}"
        data = rendered.config_map(source["configMapRef"]["name"]).get("data", {})
        env.update({source.get("prefix", "") + k: str(v) for k, v in data.items()})
    for var in container.get("env", []):
        assert "value" in var, f"{container['name']}: env {var['name']} needs a literal value for these checks"
        env[var["name"]] = str(var["value"])
    return env


def console_scripts() -> dict[str, str]:
    """pyproject's [project.scripts]: console script name -> 'module:function'."""
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["scripts"]


def entry_point(container: dict) -> str:
    command = container.get("command", [])
    scripts = console_scripts()
    assert command and command[0] in scripts, (
        f"container {container['name']}: command {command} must start with one of the project's console "
        f"scripts {sorted(scripts)}")
    return scripts[command[0]]


def argv_of(container: dict) -> list[str]:
    return list(container.get("command", [])[1:]) + list(container.get("args", []))


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace):
        self.parser, self.namespace = parser, namespace


class _RecordingEnviron(dict):
    """os.environ stand-in that records every name read through it."""

    def __init__(self, values: dict[str, str]):
        super().__init__(values)
        self.read: set[str] = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)


@dataclass
class ParsedConfig:
    """What a service's own argparse made of a container's argv and environment."""

    parser: argparse.ArgumentParser
    args: argparse.Namespace
    env_read: set[str] = field(default_factory=set)  # variable names the service looked up


def parse_with_service(entry: str, argv: list[str], env: dict[str, str]) -> ParsedConfig:
    """Build the service's real parser (inside its main()) under `env` and parse `argv`, stopping
    right after parsing: nothing loads, nothing binds. argparse errors surface as AssertionError."""
    module_name, function = entry.split(":")
    main = getattr(importlib.import_module(module_name), function)
    real_parse_args = argparse.ArgumentParser.parse_args
    environ = _RecordingEnviron({k: v for k, v in os.environ.items() if not k.startswith("OMNI_")} | env)

    def capture(self, args=None, namespace=None):
        raise _Parsed(self, real_parse_args(self, args, namespace))

    try:
        with mock.patch.object(os, "environ", environ), \
                mock.patch.object(argparse.ArgumentParser, "parse_args", capture):
            main(argv)
    except _Parsed as parsed:
        check_choices(parsed.parser, parsed.namespace)
        return ParsedConfig(parsed.parser, parsed.namespace, environ.read)
    except SystemExit as exc:
        raise AssertionError(f"{entry} rejected {argv} (with {sorted(env)}): exit {exc.code}") from None
    except (TypeError, ValueError) as exc:  # an OMNI_* value its flag's type cannot take
        raise AssertionError(f"{entry}: bad value in {sorted(env)}: {exc}") from None
    raise AssertionError(f"{entry}: main() returned without parsing its arguments")


def check_choices(parser: argparse.ArgumentParser, namespace: argparse.Namespace) -> None:
    """argparse checks `choices` on the command line only; a default (from OMNI_*) skips it."""
    for action in parser._actions:
        if action.choices is not None and action.dest in vars(namespace):
            value = getattr(namespace, action.dest)
            assert value is None or value in action.choices, (
                f"{parser.prog} {'/'.join(action.option_strings)}={value!r}: not one of {list(action.choices)}")


def flag_value(argv: list[str], flag: str) -> str | None:
    for i, item in enumerate(argv):
        if item == flag and i + 1 < len(argv):
            return argv[i + 1]
        if item.startswith(flag + "="):
            return item.split("=", 1)[1]
    return None


def with_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """argv with `flag` set to `value` (replaced where present, appended otherwise)."""
    out, i, found = [], 0, False
    while i < len(argv):
        if argv[i] == flag:
            out += [flag, value]
            i += 2
            found = True
            continue
        if argv[i].startswith(flag + "="):
            out.append(f"{flag}={value}")
            found = True
        else:
            out.append(argv[i])
        i += 1
    return out if found else out + [f"{flag}={value}"]


# ---- resources ----

_SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "m": 1e-3}


def quantity(value) -> float:
    """A Kubernetes resource quantity as a number (cores, bytes, devices)."""
    text = str(value)
    for suffix in sorted(_SUFFIX, key=len, reverse=True):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * _SUFFIX[suffix]
    return float(text)


# ---- NetworkPolicy ----

@dataclass(frozen=True)
class Peer:
    """A pod that opens a connection: its namespace's labels and its own labels."""

    namespace: str
    namespace_labels: tuple[tuple[str, str], ...]
    labels: tuple[tuple[str, str], ...]


def _matches(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, f"only matchLabels selectors are evaluated here: {selector}"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def ingress_allowed(policies: list[dict], policy_namespace: str, target_labels: dict, target_ports: dict[str, int],
                    source: Peer, port: int) -> bool:
    """Whether `source` may open TCP `port` on a pod with `target_labels` in `policy_namespace`."""
    selecting = [p for p in policies
                 if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                 and _matches(p["spec"].get("podSelector", {}), target_labels)]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            if _rule_ports_match(rule, target_ports, port) and _rule_peers_match(rule, policy_namespace, source):
                return True
    return False


def _rule_ports_match(rule: dict, target_ports: dict[str, int], port: int) -> bool:
    if "ports" not in rule:
        return True
    for entry in rule["ports"]:
        assert entry.get("protocol", "TCP") == "TCP"
        value = entry.get("port")
        if value is None or (target_ports.get(value) if isinstance(value, str) else value) == port:
            return True
    return False


def _rule_peers_match(rule: dict, policy_namespace: str, source: Peer) -> bool:
    if "from" not in rule:
        return True
    for peer in rule["from"]:
        assert "ipBlock" not in peer, "ipBlock peers are not evaluated here"
        ns_ok = (_matches(peer["namespaceSelector"], dict(source.namespace_labels)) if "namespaceSelector" in peer
                 else source.namespace == policy_namespace)
        pod_ok = _matches(peer["podSelector"], dict(source.labels)) if "podSelector" in peer else True
        if ns_ok and pod_ok:
            return True
    return False


# ---- custom resources (cert-manager) ----

SCHEMAS = Path(__file__).resolve().parent / "schemas"
# apiVersion, kind -> the vendored openAPIV3Schema (tests/k8s/schemas/README.md: source, version).
CUSTOM_SCHEMAS = {
    ("cert-manager.io/v1", "Certificate"): SCHEMAS / "certificate.cert-manager.io_v1.yaml",
    ("cert-manager.io/v1", "Issuer"): SCHEMAS / "issuer.cert-manager.io_v1.yaml",
}


def _strict(schema: dict) -> dict:
    """The schema as `kubectl apply --validate=strict` applies it: a field it does not list is an
    error (unless x-kubernetes-preserve-unknown-fields), and x-kubernetes-* keys mean nothing to
    jsonschema."""
    out = {k: v for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    if "properties" in out:
        out["properties"] = {k: _strict(v) for k, v in out["properties"].items()}
        if "additionalProperties" not in out and not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = _strict(out["additionalProperties"])
    if "items" in out:
        out["items"] = _strict(out["items"])
    return out


def custom_resource_errors(obj: dict) -> list[str] | None:
    """Strict validation of a custom resource against its vendored schema: the errors (empty when
    valid), or None when no schema is vendored for its kind."""
    import jsonschema

    path = CUSTOM_SCHEMAS.get((obj.get("apiVersion"), obj.get("kind")))
    if path is None:
        return None
    schema = _strict(yaml.safe_load(path.read_text()))
    validator = jsonschema.Draft7Validator(schema)
    errors = [f"{'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}" for e in validator.iter_errors(obj)]
    metadata = obj.get("metadata", {})
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", metadata.get("name", "")):
        errors.append(f"metadata.name {metadata.get('name')!r} is not a DNS label")
    return errors


# ---- the image ----

def dockerfile_final_stage() -> list[str]:
    """Instructions of the Dockerfile's last stage, continuation lines joined."""
    text = (REPO / "Dockerfile").read_text()
    joined = re.sub(r"\\\n\s*", " ", text)
    lines = [line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    last_from = max(i for i, line in enumerate(lines) if line.upper().startswith("FROM "))
    return lines[last_from:]


def dockerfile_env() -> dict[str, str]:
    """ENV of the final image (one KEY=value per ENV line), PATH left out."""
    env = {}
    for line in dockerfile_final_stage():
        if line.upper().startswith("ENV "):
            for item in line[4:].split():
                key, _, value = item.partition("=")
                if key != "PATH":
                    env[key] = value
    return env
