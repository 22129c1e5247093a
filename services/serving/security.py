"""TLS on every hop, and bearer-token authentication at the router.

One identity per process: `--tls-cert`/`--tls-key` are the certificate this process serves with
and presents as a client to the next stage; `--tls-ca` is the CA that signs the pipeline's
certificates: with it a server requires and verifies client certificates (mutual TLS) and a
client verifies the server it calls. No flags: plaintext (local development).

Rotation without a restart: when the identity comes from files (the flags), every process watches
them (a stat per new connection or channel use, nothing in the background). A server built with
`server_credentials()` uses `grpc.dynamic_ssl_server_credentials`, whose fetcher gRPC calls before
every TLS handshake: new connections get the new certificate, established ones (and the streams on
them) are untouched, since TLS checks certificates at the handshake only. Clients (ChannelPool, the
router's replica channels) compare `TLSConfig.latest()`'s generation with their channel's and open
a new channel when it moved; the old one is closed with a grace period, after its calls finish.
New files are taken only once they are consistent (the key matches the certificate, the CA parses,
and the bytes did not change while being checked); until then the previous material stays in use.
That covers Kubernetes' Secret volumes, which swap every file at once (a `..data` symlink).

Router authentication: callers send `authorization: Bearer <token>` metadata; tokens come from a
file (one per line) or OMNI_AUTH_TOKENS (comma-separated) and are compared in constant time.
Health checks and reflection stay open; everything else without a valid token gets
UNAUTHENTICATED before any work is done.
"""

from __future__ import annotations

import argparse
import hmac
import logging
import os
import ssl
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc

from services.base.env import env_default
from services.base.errors import UserError

OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
log = logging.getLogger("tls")


@dataclass(frozen=True)
class TLSConfig:
    cert: bytes | None = None  # PEM certificate chain of this process
    key: bytes | None = None  # PEM private key
    ca: bytes | None = None  # PEM CA bundle that signs peers (enables mutual TLS on the server side)
    server_name: str | None = None  # override the name checked in the server's certificate
    # The files the material came from (flags): watched for rotation. None: fixed bytes (tests).
    files: TLSFiles | None = field(default=None, compare=False, repr=False)

    @property
    def enabled(self) -> bool:
        return self.cert is not None or self.ca is not None

    def latest(self) -> tuple[int, TLSConfig]:
        """(generation, material now): the generation moves each time the files change."""
        if self.files is None:
            return 0, self
        generation, material = self.files.current()
        return generation, replace(material, server_name=self.server_name)

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if self.cert is None:
            return None
        require_client_auth = self.ca is not None
        if self.files is None:
            return grpc.ssl_server_credentials(
                [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=require_client_auth)
        served, material = self.latest()
        served = [served]

        def fetch() -> grpc.ServerCertificateConfiguration | None:
            # Called by gRPC before every TLS handshake; None keeps the current certificate.
            try:
                generation, material = self.latest()
                if generation == served[0]:
                    return None
                served[0] = generation
                log.info("serving the rotated certificate (generation %d)", generation)
                return _certificate_configuration(material)
            except Exception:  # never break the handshake over a reload
                log.exception("certificate reload failed; keeping the current one")
                return None

        return grpc.dynamic_ssl_server_credentials(_certificate_configuration(material), fetch,
                                                   require_client_authentication=require_client_auth)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.enabled:
            return None
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def _certificate_configuration(tls: TLSConfig) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration([(tls.key, tls.cert)], root_certificates=tls.ca)


class TLSFiles:
    """One process's certificate, key and CA files, re-read when they change (see the module doc)."""

    def __init__(self, cert: str | None, key: str | None, ca: str | None):
        self.paths = {"--tls-cert": cert, "--tls-key": key, "--tls-ca": ca}
        self._lock = threading.Lock()  # the server's fetcher runs on gRPC's threads
        self.generation = 0
        # A stat per use finds a swapped file at once (a Secret volume: new inode); the bytes are
        # also compared at most every recheck_s, for a file rewritten in place within one tick of
        # the filesystem's clock at the same size.
        self.recheck_s = 1.0
        self._seen = self._stat()
        self._compared = time.monotonic()
        material = self._read()
        _check(self.paths, material)
        self._material = material
        self._rejected: object = None  # the last set of files refused, to warn once about it

    def _stat(self) -> tuple:
        stamp = []
        for path in self.paths.values():
            if not path:
                stamp.append(None)
                continue
            try:
                st = os.stat(path)  # follows symlinks
                stamp.append((st.st_ino, st.st_dev, st.st_mtime_ns, st.st_ctime_ns, st.st_size))
            except OSError:
                stamp.append("missing")
        return tuple(stamp)

    def _read(self) -> TLSConfig:
        def read(flag: str) -> bytes | None:
            path = self.paths[flag]
            if not path:
                return None
            try:
                return Path(path).read_bytes()
            except OSError as exc:
                raise UserError(f"{flag} {path}: {exc.strerror}") from None

        return TLSConfig(cert=read("--tls-cert"), key=read("--tls-key"), ca=read("--tls-ca"))

    def current(self) -> tuple[int, TLSConfig]:
        """(generation, material): the files' contents once they are consistent, else the previous."""
        stamp, now = self._stat(), time.monotonic()
        if stamp == self._seen and now - self._compared < self.recheck_s:
            return self.generation, self._material
        with self._lock:
            self._seen, self._compared = stamp, now
            try:
                material = self._read()
                if material == self._material:
                    return self.generation, self._material
                _check(self.paths, material)
                if self._read() != material:
                    raise UserError("the files changed while being read")
            except UserError as exc:  # mid-update or broken: keep using the previous material
                if str(exc) != self._rejected:
                    self._rejected = str(exc)
                    log.warning("certificate files changed but cannot be used (yet): %s; keeping the previous "
                                "ones", exc)
                return self.generation, self._material
            self._material, self._rejected = material, None
            self.generation += 1
            log.info("certificate files changed: loaded generation %d", self.generation)
            return self.generation, self._material


def _check(paths: dict[str, str | None], material: TLSConfig) -> None:
    """The key matches the certificate and the CA parses (ssl reads the same files)."""
    if (material.cert is None) != (material.key is None):
        raise UserError("--tls-cert and --tls-key go together")
    try:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        if material.cert is not None:
            context.load_cert_chain(paths["--tls-cert"], paths["--tls-key"], password="")
        if material.ca is not None:
            context.load_verify_locations(cadata=material.ca.decode("ascii", "replace"))
    except (ssl.SSLError, ValueError, OSError) as exc:
        raise UserError(f"TLS files {', '.join(p for p in paths.values() if p)}: {exc}") from None


def add_tls_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tls-cert", default=env_default("tls_cert", None),
                        help="PEM certificate this process serves with and presents to the next stage")
    parser.add_argument("--tls-key", default=env_default("tls_key", None), help="PEM private key of --tls-cert")
    parser.add_argument("--tls-ca", default=env_default("tls_ca", None),
                        help="PEM CA of the pipeline: require client certificates and verify servers (mTLS)")
    parser.add_argument("--tls-server-name", default=env_default("tls_server_name", None),
                        help="name to expect in the next stage's certificate (default: its host)")


def tls_from_args(args: argparse.Namespace) -> TLSConfig:
    """The TLS flags' files, read now and watched for rotation (TLSFiles)."""
    if bool(args.tls_cert) != bool(args.tls_key):
        raise UserError("--tls-cert and --tls-key go together")
    if not (args.tls_cert or args.tls_ca):
        return TLSConfig(server_name=args.tls_server_name)
    files = TLSFiles(args.tls_cert, args.tls_key, args.tls_ca)
    _, material = files.current()
    return replace(material, server_name=args.tls_server_name, files=files)


def secure_or_insecure_channel(target: str, tls: TLSConfig, options: list, aio: bool = True):
    """A channel with the material `tls` has now (a rotation later needs a new channel)."""
    _, tls = tls.latest()
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
