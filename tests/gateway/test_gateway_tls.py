"""The gateway's mutual TLS to the router follows certificate rotation without a restart.

A stack on loopback where every process, the gateway included, reads one Secret-like folder
(tls.crt, tls.key, ca.crt behind a `..data` link, as the kubelet mounts a Secret). The folder is
swapped to certificates of a new CA (one rename, the kubelet's way), then the router is restarted,
so no connection from before the rotation survives. Only the new CA is trusted anywhere now: a
gateway that had read its files once would present the old certificate (and distrust the router's
new one) on its reconnect and fail with 503 while /live stays green. It must answer as before,
with the same process."""

from __future__ import annotations

import os
import shutil
import subprocess
from argparse import Namespace

import openai
import pytest

from services.serving.security import tls_from_args
from services.tools.launcher import Stack, StackOptions
from tests.threads import torch_threads

pytestmark = [pytest.mark.slow,  # a stack of its own: about a minute to start on 2 cores
              pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")]


def openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(directory, name: str) -> dict[str, bytes]:
    """A CA and one leaf it signs for 127.0.0.1 (every process here serves and dials that)."""
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes")
    openssl("req", "-x509", *ec, "-days", "1", "-subj", f"/CN={name}-ca", "-keyout", f"{name}-ca.key",
            "-out", f"{name}-ca.pem", cwd=directory)
    openssl("req", *ec, "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=directory)
    (directory / f"{name}.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                           "extendedKeyUsage=serverAuth,clientAuth\n")
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{name}-ca.pem", "-CAkey", f"{name}-ca.key",
            "-CAcreateserial", "-days", "1", "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=directory)
    return {"tls.crt": (directory / f"{name}.pem").read_bytes(), "tls.key": (directory / f"{name}.key").read_bytes(),
            "ca.crt": (directory / f"{name}-ca.pem").read_bytes()}


def swap(folder, files: dict[str, bytes], version: str) -> None:
    """The kubelet's way: a new folder, then one rename of the `..data` link."""
    (folder / version).mkdir()
    for name, data in files.items():
        (folder / version / name).write_bytes(data)
    (folder / "..tmp").symlink_to(version)
    os.replace(folder / "..tmp", folder / "..data")
    for name in files:
        if not (folder / name).is_symlink():
            (folder / name).symlink_to(f"..data/{name}")


def test_rotated_certificates_are_used_for_the_reconnect_without_a_restart(tiny_checkpoint, tmp_path):
    pki, folder = tmp_path / "pki", tmp_path / "tls"
    pki.mkdir()
    folder.mkdir()
    swap(folder, make_pki(pki, "one"), "..v1")
    flags = ("--tls-cert", str(folder / "tls.crt"), "--tls-key", str(folder / "tls.key"),
             "--tls-ca", str(folder / "ca.crt"))
    launcher_tls = tls_from_args(Namespace(tls_cert=flags[1], tls_key=flags[3], tls_ca=flags[5],
                                           tls_server_name=None))  # its health checks rotate too
    options = StackOptions(checkpoint=str(tiny_checkpoint), port=0, threads=torch_threads(1), log_prefix=False,
                           thinker_args=("--default-max-new-tokens", "4"),
                           talker_args=("--default-max-new-tokens", "8"),
                           http_port=0, extra_args=flags, tls=launcher_tls)
    with Stack(options) as stack:
        client = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0, timeout=120)

        def ask() -> int:
            return client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=2).usage.completion_tokens

        assert ask() == 2
        gateway_pid = stack.processes["gateway"].popen.pid
        swap(folder, make_pki(pki, "two"), "..v2")
        stack.kill("router")
        stack.processes["router"].popen.wait(timeout=30)
        stack.restart("router")  # on its port, with the new files: every old connection is gone
        assert ask() == 2
        assert stack.processes["gateway"].popen.pid == gateway_pid and stack.processes["gateway"].popen.poll() is None
        output = "".join(stack.processes["gateway"].output)
        assert "certificate files changed: loaded generation 1" in output, output[-2000:]
