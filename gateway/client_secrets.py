"""`POST /v1/realtime/client_secrets`: short-lived client secrets, as OpenAI's, so that a browser or
a phone app opens `/v1/realtime` with a secret the server handed it instead of the server's token
(docs/sessions.md, "Client secrets").

The body is OpenAI's (`expires_after: {anchor: "created_at", seconds: 10-7200}`, default 600 s;
`session`: a realtime session's settings, checked as a `session.update` is), the answer too
(`value` "ek_...", `expires_at`, `session`). Minting takes the server's own token, as every route.
A secret opens `/v1/realtime` (any number of sessions) until it expires, its session settings
applied at connect; it is no API key: every other route refuses it (gateway/asgi.py's `BearerAuth`
checks the server's tokens alone), minting included.

NOTE: a secret is not kept anywhere: it is its own content (when it expires, the session) signed
with HMAC-SHA256 under a key derived from the server's token, so any gateway replica with the same
tokens takes a secret another minted, and a restart keeps them. Several tokens (a rotation): the
first signs, each verifies. With no tokens the server is open and a secret is not a credential
(anyone may connect); it still carries its settings, signed with an empty key.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import hmac
import json
import secrets
import time
import zlib
from dataclasses import dataclass

from fastapi import APIRouter, Request

from gateway.errors import bad_request
from gateway.realtime_events import ClientEventError, session_update

PATH = "/v1/realtime/client_secrets"
PREFIX = "ek_"
SUBPROTOCOL_KEY = "openai-insecure-api-key."  # a browser's key, in the WebSocket's subprotocols
MIN_S, MAX_S, DEFAULT_S = 10, 7200, 600  # OpenAI's bounds and default of expires_after.seconds
# A secret travels in the WebSocket handshake's Authorization header, which servers bound (8 KiB a
# line in `websockets`): a session too large for it is refused at minting (set the rest with session.update).
MAX_SECRET_CHARS = 6000
_CONTEXT = b"omni-serve realtime client secret v1"
routes = APIRouter()


@dataclass(frozen=True)
class ClientSecret:
    expires_at: int  # seconds since the epoch
    session: dict  # the realtime session's settings it opens with (a session.update's `session`)


@functools.cache
def signing_keys(tokens: tuple[bytes, ...]) -> tuple[bytes, ...]:
    """One key per server token (the first signs), never the token itself."""
    return tuple(hmac.new(token, _CONTEXT, hashlib.sha256).digest() for token in tokens) or (b"",)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def mint(secret: ClientSecret, keys: tuple[bytes, ...]) -> str:
    """ek_<payload>.<HMAC of the payload>; the payload (zlib'd JSON) holds a nonce, so no two are alike."""
    body = json.dumps({"exp": secret.expires_at, "session": secret.session, "nonce": secrets.token_hex(8)},
                      separators=(",", ":")).encode()
    payload = _b64(zlib.compress(body))
    return f"{PREFIX}{payload}.{_b64(hmac.new(keys[0], payload.encode(), hashlib.sha256).digest())}"


def verify(value: str, keys: tuple[bytes, ...], now: float | None = None) -> ClientSecret | None:
    """The secret `value` stands for, when one of `keys` signed it and it has not expired; else None."""
    if not value.startswith(PREFIX) or value.count(".") != 1 or len(value) > MAX_SECRET_CHARS:
        return None
    payload, mac = value[len(PREFIX):].split(".")
    try:
        presented = _unb64(mac)
    except (binascii.Error, ValueError):
        return None
    if not any([hmac.compare_digest(hmac.new(key, payload.encode(), hashlib.sha256).digest(), presented)
                for key in keys]):
        return None
    body = json.loads(zlib.decompress(_unb64(payload)))  # signed by us: well formed
    if (time.time() if now is None else now) >= body["exp"]:
        return None
    return ClientSecret(body["exp"], body["session"])


def presented(headers: dict[bytes, bytes]) -> str | None:
    """The client secret a WebSocket handshake's headers present, or None: `Authorization: Bearer
    ek_...`, or (a browser, which cannot set that header) the subprotocol `openai-insecure-api-key.ek_...`
    as OpenAI's browser clients send it, beside `realtime`."""
    header = headers.get(b"authorization", b"").decode("latin-1")
    if header.startswith("Bearer " + PREFIX):
        return header[len("Bearer "):]
    for protocol in headers.get(b"sec-websocket-protocol", b"").decode("latin-1").split(","):
        if protocol.strip().startswith(SUBPROTOCOL_KEY + PREFIX):
            return protocol.strip()[len(SUBPROTOCOL_KEY):]
    return None


def expiry(expires_after, now: int) -> int:
    """`expires_after` -> the expiry time; a 400 naming the field."""
    if expires_after is None:
        return now + DEFAULT_S
    if not isinstance(expires_after, dict):
        raise bad_request("expires_after", "expires_after must be an object")
    for name in expires_after:
        if name not in ("anchor", "seconds"):
            raise bad_request(f"expires_after.{name}", f"Unknown parameter: 'expires_after.{name}'", "unknown_parameter")
    if expires_after.get("anchor", "created_at") != "created_at":
        raise bad_request("expires_after.anchor", "expires_after.anchor must be 'created_at'")
    seconds = expires_after.get("seconds", DEFAULT_S)
    if not isinstance(seconds, int) or isinstance(seconds, bool) or not MIN_S <= seconds <= MAX_S:
        raise bad_request("expires_after.seconds", f"expires_after.seconds must be an integer in [{MIN_S}, {MAX_S}]")
    return now + seconds


@routes.post(PATH)
async def create_client_secret(http: Request) -> dict:
    gateway = http.app.state.gateway
    try:
        body = await http.json()
    except ValueError:
        raise bad_request(None, "the body is not valid JSON", "invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(None, "the body must be a JSON object")
    for name in body:
        if name not in ("expires_after", "session"):
            raise bad_request(name, f"Unknown parameter: '{name}'", "unknown_parameter")
    created = int(time.time())
    expires_at = expiry(body.get("expires_after"), created)
    session = body.get("session") or {}
    try:
        session_update(session, gateway.config)  # what the session would refuse, refused now
    except ClientEventError as exc:
        raise bad_request(exc.param, exc.message, exc.code) from None
    value = mint(ClientSecret(expires_at, session), signing_keys(gateway.config.auth_tokens))
    if len(value) > MAX_SECRET_CHARS:
        raise bad_request("session", f"the session's settings make a secret over {MAX_SECRET_CHARS} characters (it "
                                     "travels in a header): set the rest with session.update once connected")
    shown = {"type": "realtime", "object": "realtime.session", "model": gateway.config.model, **session}
    return {"value": value, "expires_at": expires_at, "session": shown}
