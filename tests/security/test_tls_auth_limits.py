"""TLS on every hop, bearer tokens at the router, and input limits, over real processes.

Certificates are made inside the test with the openssl command line (a CA, one certificate for
the pipeline's processes and the client, and a rogue CA's certificate that must be refused).
"""

from __future__ import annotations

import io
import subprocess

import grpc
import numpy as np
import pytest

from omni.v1 import common_pb2, stages_pb2_grpc
from services.serving.security import TLSConfig, secure_or_insecure_channel
from services.tools.client import build_request, collect, connect
from services.tools.launcher import free_port, health_status
from tests.needs import need_command
from tests.stacks import stack_of

# slow: a stack of its own with TLS on every hop (~20 s of make test's 2 cores to start); make test-slow
# (CI) runs it.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def openssl_command() -> str:
    return need_command("openssl", "the tests make their certificates with it")

TOKEN = "s3cret-token"


def _openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(directory, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name}",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", cwd=directory)


def make_cert(directory, ca: str, name: str) -> None:
    (directory / f"{name}.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", cwd=directory)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=directory)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    make_ca(d, "ca")
    make_cert(d, "ca", "pipeline")
    make_ca(d, "rogue-ca")
    make_cert(d, "rogue-ca", "rogue")
    return d


def tls_of(certs, name: str, ca: str = "ca") -> TLSConfig:
    return TLSConfig(cert=(certs / f"{name}.pem").read_bytes(), key=(certs / f"{name}.key").read_bytes(),
                     ca=(certs / f"{ca}.pem").read_bytes())


@pytest.fixture(scope="module")
def secure_stack(tiny_checkpoint, certs, tmp_path_factory):
    tokens = tmp_path_factory.mktemp("auth") / "tokens"
    tokens.write_text(f"# callers\n{TOKEN}\n")
    tls_flags = ("--tls-cert", str(certs / "pipeline.pem"), "--tls-key", str(certs / "pipeline.key"),
                 "--tls-ca", str(certs / "ca.pem"))
    health_port = free_port()
    stack = stack_of(
        tiny_checkpoint, extra_args=tls_flags, tls=tls_of(certs, "pipeline"),
        thinker_args=("--max-prompt-tokens", "200", "--max-audio-seconds", "0.5", "--max-image-pixels", "1000",
                      "--max-new-tokens-limit", "64"),
        talker_args=("--health-port", str(health_port)),
        router_args=("--auth-token-file", str(tokens), "--max-message-mb", "1"),
    )
    with stack:
        stack.talker_health_port = health_port
        yield stack


def test_tls_on_every_hop_serves_a_request(secure_stack, certs):
    channel, stub = connect(secure_stack.target, tls_of(certs, "pipeline"))
    with channel:
        result = collect(stub, build_request("hello", max_new_tokens=4, talker_max_new_tokens=6), timeout=60,
                         token=TOKEN)
    assert len(result.thinker_token_ids) == 4 and result.audio_chunks


@pytest.mark.parametrize("client", ["plaintext", "tls-without-certificate", "certificate-of-another-ca"])
def test_a_stage_refuses_a_client_without_a_valid_certificate(secure_stack, certs, client):
    talker = f"127.0.0.1:{secure_stack.port('talker')}"
    tls = {
        "plaintext": TLSConfig(),
        "tls-without-certificate": TLSConfig(ca=(certs / "ca.pem").read_bytes()),
        "certificate-of-another-ca": tls_of(certs, "rogue"),
    }[client]
    channel = secure_or_insecure_channel(talker, tls, [], aio=False)
    with channel, pytest.raises(grpc.RpcError) as info:
        stages_pb2_grpc.TalkerStub(channel).GetLoad(common_pb2.LoadRequest(), timeout=5)
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE
    # ... while a client of the pipeline's CA is served.
    assert health_status(talker, tls=tls_of(certs, "pipeline")) == "SERVING"


@pytest.mark.parametrize("token", [None, "wrong-token", TOKEN + "x"])
def test_the_router_refuses_a_missing_or_wrong_token_and_health_stays_open(secure_stack, certs, token):
    channel, stub = connect(secure_stack.target, tls_of(certs, "pipeline"))
    with channel, pytest.raises(grpc.RpcError) as info:
        collect(stub, build_request("hello", max_new_tokens=4), timeout=30, token=token)
    assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert health_status(secure_stack.target, tls=tls_of(certs, "pipeline")) == "SERVING"


def _wav(seconds: float) -> bytes:
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, np.zeros(int(16000 * seconds), np.float32), 16000, format="WAV")
    return buf.getvalue()


def _png(width: int, height: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height)).save(buf, format="PNG")
    return buf.getvalue()


def test_oversized_inputs_are_refused_naming_the_field_and_serving_goes_on(secure_stack, certs):
    oversized = {
        "messages": build_request("word " * 400),  # > --max-prompt-tokens 200
        "messages[0].content[0].audio": build_request("hi", audio=_wav(1.0)),  # > 0.5 s
        "messages[0].content[0].image": build_request("hi", image=_png(48, 64)),  # > 1000 pixels
        "thinker_sampling.max_new_tokens": build_request("hi", max_new_tokens=65),  # > 64
    }
    channel, stub = connect(secure_stack.target, tls_of(certs, "pipeline"))
    with channel:
        for field, request in oversized.items():
            with pytest.raises(grpc.RpcError) as info:
                collect(stub, request, timeout=30, token=TOKEN)
            assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT, (field, info.value.details())
            assert field in info.value.details()
        # A message over the router's --max-message-mb 1 is refused by gRPC itself.
        with pytest.raises(grpc.RpcError) as info:
            collect(stub, build_request("hi", audio=_wav(60.0)), timeout=30, token=TOKEN)  # ~1.9 MB
        assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        ok = collect(stub, build_request("still serving?", max_new_tokens=3, talker_max_new_tokens=5), timeout=60,
                     token=TOKEN)
    assert len(ok.thinker_token_ids) == 3


def test_a_plaintext_health_port_serves_probes_while_the_service_port_requires_tls(secure_stack):
    # Kubernetes' native gRPC probes speak plaintext only: --health-port serves grpc.health.v1 alone.
    assert health_status(f"127.0.0.1:{secure_stack.talker_health_port}") == "SERVING"
    assert health_status(f"127.0.0.1:{secure_stack.port('talker')}") == "UNREACHABLE"  # TLS only
    channel = grpc.insecure_channel(f"127.0.0.1:{secure_stack.talker_health_port}")
    with channel, pytest.raises(grpc.RpcError) as info:  # nothing but health there
        stages_pb2_grpc.TalkerStub(channel).GetLoad(common_pb2.LoadRequest(), timeout=5)
    assert info.value.code() is grpc.StatusCode.UNIMPLEMENTED
