"""The image recipe (Dockerfile) matches what the manifests assume: a numeric non-root user, every
writable path under /tmp, the protobuf code generated at build time, and the whole package in."""

from __future__ import annotations

import filecmp
import re
import shlex
import shutil
import subprocess
import sys
import tomllib

import pytest

from .manifests import REPO, dockerfile_env, dockerfile_final_stage, pod_spec


def build_stage_runs() -> list[str]:
    text = re.sub(r"\\\n\s*", " ", (REPO / "Dockerfile").read_text())
    return [line.strip()[4:] for line in text.splitlines() if line.strip().startswith("RUN ")]


def test_image_runs_as_the_numeric_non_root_user_the_pods_run_as(overlays):
    (user,) = [line.split()[1] for line in dockerfile_final_stage() if line.upper().startswith("USER ")]
    uid, _, gid = user.partition(":")
    # Numeric, so the kubelet can verify runAsNonRoot without reading /etc/passwd.
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit(), user
    for objects in overlays.values():
        for workload in objects.workloads():
            security = pod_spec(workload)["securityContext"]
            assert (security["runAsUser"], security["runAsGroup"]) == (int(uid), int(gid)), workload["metadata"]


def test_every_path_the_image_writes_is_under_the_tmp_emptydir():
    env = dockerfile_env()
    for key in ("HOME", "XDG_CACHE_HOME", "HF_HOME"):
        assert env[key] == "/tmp" or env[key].startswith("/tmp/"), key
    assert env.get("HF_HUB_OFFLINE") == "1", "checkpoints are local folders: never reach for the Hub"


def test_image_copies_every_package_pyproject_installs():
    with open(REPO / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)
    copied = {line.split()[1].rstrip("/") for line in build_stage_runs_and_copies() if line.startswith("COPY ")}
    for pattern in project["tool"]["setuptools"]["packages"]["find"]["include"]:
        package = pattern.rstrip("*")
        if package == "omni":
            continue  # generated in the image by protoc
        assert package in copied, f"Dockerfile does not COPY {package}/"
    assert project["project"]["readme"] in copied, "setuptools reads the readme while building the package"
    ignored = {line.strip().lstrip("/") for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert not (copied & ignored), f".dockerignore drops what the Dockerfile copies: {copied & ignored}"


def build_stage_runs_and_copies() -> list[str]:
    text = re.sub(r"\\\n\s*", " ", (REPO / "Dockerfile").read_text())
    return [line.strip() for line in text.splitlines() if line.strip().startswith(("RUN ", "COPY "))]


def test_image_generates_the_same_protobuf_code_as_make_proto(tmp_path):
    """Runs the Dockerfile's protoc step on a copy of protos/ and compares with ./omni/v1."""
    generated_here = REPO / "omni" / "v1"
    if not (generated_here / "stages_pb2.py").exists():
        pytest.fail("omni/v1 is missing: run `make proto` (the Makefile's setup does)")
    (step,) = [run for run in build_stage_runs() if "grpc_tools.protoc" in run]
    shutil.copytree(REPO / "protos", tmp_path / "protos")
    for command in step.split("&&"):
        words = shlex.split(command)
        words = [sys.executable if w == "python" else w for w in words]
        # The shell would expand the glob; do it here.
        expanded = []
        for w in words:
            expanded += sorted(str(p.relative_to(tmp_path)) for p in tmp_path.glob(w)) if "*" in w else [w]
        subprocess.run(expanded, cwd=tmp_path, check=True, timeout=60)
    built = tmp_path / "omni" / "v1"
    names = sorted(p.name for p in built.iterdir() if p.suffix in (".py", ".pyi"))
    assert names == sorted(p.name for p in generated_here.iterdir() if p.suffix in (".py", ".pyi"))
    assert (tmp_path / "omni" / "__init__.py").exists()
    mismatch = filecmp.cmpfiles(built, generated_here, names, shallow=False)[1]
    assert not mismatch, f"the image's protobuf code differs from make proto's: {mismatch}"
