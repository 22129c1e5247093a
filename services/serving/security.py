"""TLS on every hop, and bearer-token authentication at the router.

One identity per process: `--tls-cert`/`--tls-key` are the certificate this process serves with
and presents as a client to the next stage; `--tls-ca` is the CA that signs the pipeline's
certificates: with it a server requires and verifies client certificates (mutual TLS) and a
client verifies the server it calls. No flags: plaintext (local development).

Router authentication: callers send `authorization: Bearer <token>` metadata; tokens come from a
file (one per line) or OMNI_AUTH_TOKENS (comma-separated) and are compared in constant time.
Health checks and reflection stay open; everything else without a valid token gets
UNAUTHENTICATED before any work is done.
"""

from __future__ import annotations

import argparse
import hmac
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.runtime.errors import UserError
from services.runtime.settings import env_default

OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


@dataclass(frozen=True)
class TLSConfig:
    cert: bytes | None = None  # PEM certificate chain of this process
    key: bytes | None = None  # PEM private key
    ca: bytes | None = None  # PEM CA bundle that signs peers (enables mutual TLS on the server side)
    server_name: str | None = None  # override the name checked in the server's certificate

    @property
    def enabled(self) -> bool:
        return self.cert is not None or self.ca is not None

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if self.cert is None:
            return None
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=self.ca is not None
        )

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.enabled:
            return None
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def add_tls_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tls-cert", default=env_default("tls_cert", None),
                        help="PEM certificate this process serves with and presents to the next stage")
    parser.add_argument("--tls-key", default=env_default("tls_key", None), help="PEM private key of --tls-cert")
    parser.add_argument("--tls-ca", default=env_default("tls_ca", None),
                        help="PEM CA of the pipeline: require client certificates and verify servers (mTLS)")
    parser.add_argument("--tls-server-name", default=env_default("tls_server_name", None),
                        help="name to expect in the next stage's certificate (default: its host)")


def tls_from_args(args: argparse.Namespace) -> TLSConfig:
    def read(flag: str, path: str | None) -> bytes | None:
        if not path:
            return None
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise UserError(f"{flag} {path}: {exc.strerror}") from None

    cert, key = read("--tls-cert", args.tls_cert), read("--tls-key", args.tls_key)
    if (cert is None) != (key is None):
        raise UserError("--tls-cert and --tls-key go together")
    return TLSConfig(cert=cert, key=key, ca=read("--tls-ca", args.tls_ca), server_name=args.tls_server_name)


def secure_or_insecure_channel(target: str, tls: TLSConfig, options: list, aio: bool = True):
    credentials = tls.channel_credentials()
    module = grpc.aio if aio else grpc
    if credentials is None:
        return module.insecure_channel(target, options=options)
    return module.secure_channel(target, credentials, options=options + tls.channel_options())


def load_tokens(token_file: str | None, env_value: str | None = None) -> tuple[bytes, ...]:
    tokens: list[str] = []
    if token_file:
        try:
            tokens += [line.strip() for line in Path(token_file).read_text().splitlines()]
        except OSError as exc:
            raise UserError(f"--auth-token-file {token_file}: {exc.strerror}") from None
    env_value = os.environ.get("OMNI_AUTH_TOKENS") if env_value is None else env_value
    tokens += [t.strip() for t in (env_value or "").split(",")]
    return tuple(t.encode() for t in tokens if t and not t.startswith("#"))


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED unless `authorization: Bearer <token>` matches a known token."""

    def __init__(self, tokens: tuple[bytes, ...]):
        if not tokens:
            raise UserError("authentication is on but no tokens were given")
        self.tokens = tokens

        async def deny_unary_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")
            yield  # pragma: no cover  (makes this an async generator, as the method streams)

        async def deny_unary_unary(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

        self._deny = {
            "unary_stream": grpc.unary_stream_rpc_method_handler(deny_unary_stream),
            "unary_unary": grpc.unary_unary_rpc_method_handler(deny_unary_unary),
        }

    def _authorized(self, metadata) -> bool:
        presented = b""
        for key, value in metadata or ():
            if key == "authorization":
                text = value.decode() if isinstance(value, bytes) else value
                if text.startswith("Bearer "):
                    presented = text[len("Bearer "):].encode()
        # Compare against every token, in constant time each, whatever matches.
        return any([hmac.compare_digest(presented, token) for token in self.tokens]) and bool(presented)

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(OPEN_METHOD_PREFIXES) or self._authorized(handler_call_details.invocation_metadata):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        kind = "unary_stream" if handler.response_streaming else "unary_unary"
        return self._deny[kind]
