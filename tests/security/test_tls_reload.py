"""Certificate files that rotate under a running process (security.TLSFiles, channels.RotatingChannels):
a consistent new set is taken at the next use, a half-written one is not, and a client channel is
replaced without cutting the calls on the old one. The whole path over real processes, during a
stream, is tests/k8s/test_mtls.py's rotation test."""

from __future__ import annotations

import asyncio
import os
import subprocess
from dataclasses import replace

import pytest

from services.base.errors import UserError
from services.serving.channels import RotatingChannels
from services.serving.security import TLSFiles
from tests.needs import need_command


@pytest.fixture(scope="module", autouse=True)
def openssl_command() -> str:
    return need_command("openssl", "the tests make their certificates with it")


def make_pair(directory, name: str) -> tuple[bytes, bytes]:
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                    "-days", "1", "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.pem"],
                   cwd=directory, check=True, capture_output=True)
    return (directory / f"{name}.pem").read_bytes(), (directory / f"{name}.key").read_bytes()


def swap(folder, cert: bytes, key: bytes, ca: bytes, version: str) -> None:
    """The kubelet's way: a new folder, then one rename of the `..data` link."""
    (folder / version).mkdir()
    for name, data in (("tls.crt", cert), ("tls.key", key), ("ca.crt", ca)):
        (folder / version / name).write_bytes(data)
    (folder / "..tmp").symlink_to(version)
    os.replace(folder / "..tmp", folder / "..data")
    for name in ("tls.crt", "tls.key", "ca.crt"):
        if not (folder / name).is_symlink():
            (folder / name).symlink_to(f"..data/{name}")


@pytest.fixture
def pairs(tmp_path):
    return {name: make_pair(tmp_path, name) for name in ("one", "two")}


def test_a_swapped_secret_volume_is_taken_at_the_next_use(tmp_path, pairs):
    folder = tmp_path / "tls"
    folder.mkdir()
    cert, key = pairs["one"]
    swap(folder, cert, key, cert, "..v1")
    files = TLSFiles(str(folder / "tls.crt"), str(folder / "tls.key"), str(folder / "ca.crt"))
    generation, material = files.current()
    assert generation == 0 and material.cert == cert
    cert2, key2 = pairs["two"]
    swap(folder, cert2, key2, cert2, "..v2")
    generation, material = files.current()
    assert generation == 1 and (material.cert, material.key, material.ca) == (cert2, key2, cert2)
    assert files.current()[0] == 1  # nothing changed since: same generation


def test_files_caught_half_written_are_not_taken_until_they_match(tmp_path, pairs):
    cert, key = pairs["one"]
    cert2, key2 = pairs["two"]
    for name, data in (("tls.crt", cert), ("tls.key", key), ("ca.crt", cert)):
        (tmp_path / name).write_bytes(data)
    files = TLSFiles(str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"), str(tmp_path / "ca.crt"))
    files.recheck_s = 0  # compare the bytes at every use: in-place writes can keep the same mtime
    (tmp_path / "tls.crt").write_bytes(cert2)  # copied in place, one file at a time: key not yet
    generation, material = files.current()
    assert generation == 0 and material.cert == cert  # the previous pair stays in use
    (tmp_path / "tls.key").write_bytes(key2)
    generation, material = files.current()
    assert generation == 1 and (material.cert, material.key) == (cert2, key2)


def test_a_client_channel_is_replaced_after_a_rotation_and_the_old_one_closed_only_after_its_calls(tmp_path, pairs):
    folder = tmp_path / "tls"
    folder.mkdir()
    cert, key = pairs["one"]
    swap(folder, cert, key, cert, "..v1")
    files = TLSFiles(str(folder / "tls.crt"), str(folder / "tls.key"), str(folder / "ca.crt"))
    _, material = files.current()
    tls = replace(material, files=files)

    async def run() -> None:
        channels = RotatingChannels(tls, [])
        first = channels.get("127.0.0.1:9")
        assert channels.get("127.0.0.1:9") is first
        cert2, key2 = pairs["two"]
        swap(folder, cert2, key2, cert2, "..v2")
        second = channels.get("127.0.0.1:9")
        assert second is not first
        (retiring,) = channels._retiring  # first.close(grace=...): waits for its calls, then closes
        await asyncio.wait_for(retiring, 5)  # no calls on it: closes at once
        await channels.close()

    asyncio.run(run())


def test_a_key_that_does_not_match_its_certificate_fails_at_start_up(tmp_path, pairs):
    (tmp_path / "one.pem").write_bytes(pairs["one"][0])
    (tmp_path / "two.key").write_bytes(pairs["two"][1])
    with pytest.raises(UserError, match="TLS files"):
        TLSFiles(str(tmp_path / "one.pem"), str(tmp_path / "two.key"), None)
