"""`GET /v1/realtime`: the OpenAI Realtime API over a WebSocket, as a translation of the sessions
service's `Sessions/Session` stream (docs/sessions.md). The session itself (turn detection, the
conversation, barge-in) lives in the sessions service (sessions/); this file moves events both ways.

The session's call opens before the WebSocket is accepted, so a refusal is an HTTP status in the
handshake (429 with Retry-After over capacity, 401, 503), not a socket that opens and drops. Then
two tasks: the client's events to the session (each translated, or answered with an `error` event),
and the session's events to the client. A client that takes no bytes for `--send-timeout-s` is
cut off and its session cancelled, which frees its response in every stage. A client whose handshake
asks for the beta protocol (`OpenAI-Beta: realtime=v1`) has its events translated both ways at this
edge (gateway/realtime_beta.py); everything between speaks the GA protocol.
"""

from __future__ import annotations

import asyncio
import json
import logging

import grpc
from fastapi import APIRouter, WebSocket, WebSocketDisconnect

from gateway.client_secrets import ClientSecret, presented, signing_keys, verify
from gateway.config import GatewayConfig
from gateway.errors import APIError, from_rpc
from gateway.process import Gateway
from gateway.realtime_beta import GA, Beta, asked
from gateway.realtime_events import (
    ClientEventError,
    Translator,
    api_error_event,
    client_event,
    event_id,
    openai_param,
    requested_formats,
    session_update,
)
from omni.v1 import omni_pb2
from services.base.stages import SPEECH_SAMPLE_RATE
from services.serving.replicas import Replica
from services.serving.streams import read

log = logging.getLogger("gateway")
routes = APIRouter()
CLOSE_NORMAL, CLOSE_GOING_AWAY, CLOSE_POLICY, CLOSE_ERROR = 1000, 1001, 1008, 1011
# How the socket closes when the sessions service closed the session (else CLOSE_NORMAL): a slow
# reader broke the protocol's terms; a session at its maximum length goes away, as OpenAI's does.
CLOSE_CODES = {omni_pb2.CLOSE_REASON_SLOW_READER: CLOSE_POLICY, omni_pb2.CLOSE_REASON_MAX_DURATION: CLOSE_GOING_AWAY}


PATH = "/v1/realtime"


def secret_ok(config: GatewayConfig):
    """BearerAuth's test of a client secret: one that is valid, on /v1/realtime alone."""
    keys = signing_keys(config.auth_tokens)

    def ok(scope) -> bool:
        value = presented(dict(scope["headers"])) if scope["path"] == PATH else None
        return value is not None and verify(value, keys) is not None

    return ok


@routes.websocket(PATH)
async def realtime(ws: WebSocket) -> None:
    gateway: Gateway = ws.app.state.gateway
    auth = ws.headers.get("authorization")
    secret = None
    if (value := presented(dict(ws.scope["headers"]))) is not None:
        secret = verify(value, signing_keys(gateway.config.auth_tokens))
        if secret is None:  # expired or not ours (checked here too when the server has no tokens)
            await ws.send_denial_response(APIError(401, "the client secret is expired or invalid", "invalid_request_error",
                                                   None, "invalid_api_key").response())
            return
        # The session and the router take the server's own token (a secret is the gateway's alone).
        auth = gateway.own_auth()
    picked = gateway.pick_sessions()
    if picked is None:
        gateway.metrics.requests.labels("realtime", "503").inc()
        await ws.send_denial_response(APIError(503, "no sessions service replica is ready", "server_error").response())
        return
    replica, stub = picked
    replica.in_flight += 1  # counted until the session ends: the next one goes elsewhere before the next poll
    try:
        await run_session(ws, gateway, replica, stub, auth, secret)
    finally:
        replica.in_flight -= 1


async def run_session(ws: WebSocket, gateway: Gateway, replica: Replica, stub, auth: str | None,
                      secret: ClientSecret | None) -> None:
    config = gateway.config
    call = stub.Session(metadata=(("authorization", auth),) if auth else None)
    translator = Translator(config, config.model)
    dialect = Beta(translator) if asked(ws.headers) else GA()  # OpenAI-Beta: realtime=v1 (gateway/realtime_beta.py)
    try:
        # The session's first event, or its refusal (over capacity: RESOURCE_EXHAUSTED, a 429), read
        # before anything is written: a write racing a refusal failed with grpc's own INTERNAL
        # ("Internal error from Core"), 1 time in 3 here, and the client got a 500.
        created = await read(call)
        # The Realtime API's audio is pcm16 at 24 kHz: the session's input from the start; then a
        # client secret's settings (checked when it was minted), in the same update.
        first = omni_pb2.SessionSettings(input_format=omni_pb2.AudioFormat(
            encoding=omni_pb2.AUDIO_ENCODING_PCM16, sample_rate=SPEECH_SAMPLE_RATE))
        if secret is not None:
            first.MergeFrom(session_update(secret.session, config))
            translator.update_requested(requested_formats({"session": secret.session}))
        await call.write(omni_pb2.SessionRequest(update=first))
        updated = await read(call) if created is not grpc.aio.EOF else created
    except grpc.RpcError as err:
        if err.code() is grpc.StatusCode.UNAVAILABLE:  # gone since the last poll: no new session until it answers
            gateway.sessions.mark_failed(replica.address)
        gateway.metrics.requests.labels("realtime", str(from_rpc(err).status)).inc()
        await ws.send_denial_response(from_rpc(err).response())
        return
    if created is grpc.aio.EOF or updated is grpc.aio.EOF:
        await ws.send_denial_response(APIError(502, "the sessions service ended the session at once",
                                               "server_error").response())
        return
    if updated.WhichOneof("event") == "error":  # the session refused a client secret's settings
        call.cancel()
        error = updated.error
        await ws.send_denial_response(APIError(400, f"the client secret's session: {error.message}",
                                               "invalid_request_error", openai_param(error.field)).response())
        return
    # A browser offers `realtime` beside its key (client_secrets.presented): the one subprotocol chosen.
    await ws.accept(subprotocol="realtime" if "realtime" in ws.scope.get("subprotocols", ()) else None)
    gateway.metrics.requests.labels("realtime", "101").inc()
    gateway.metrics.in_flight.inc()
    send = Sender(ws, config.send_timeout_s, dialect)
    gone = asyncio.Event()  # set when the client left (its reader cancelled the call)
    upstream = asyncio.create_task(client_to_session(ws, call, translator, dialect, send, config, gone))
    try:
        translator.server_events(created)
        await send.events([{**translator.server_events(updated)[0], "type": "session.created"}])
        await session_to_client(call, translator, send)
    except grpc.RpcError as err:
        error = from_rpc(err)
        await send.events([{"type": "error", "event_id": event_id(), "error": error.body()["error"]}])
        await send.close(CLOSE_ERROR, error.message[:120])
    except (SendTimeout, WebSocketDisconnect, RuntimeError):
        pass  # the client went away or stopped reading: the call is cancelled below
    except asyncio.CancelledError:
        # Reading a call cancelled because the client left raises CancelledError: how the call
        # ended, not an order to stop this task (then re-raised).
        task = asyncio.current_task()
        if not gone.is_set() or (task is not None and task.cancelling()):
            raise
    finally:
        call.cancel()  # frees the session, its place and its response in every stage
        upstream.cancel()
        gateway.metrics.in_flight.dec()


class SendTimeout(Exception):
    pass


class Sender:
    """Events to the client in its protocol, each send bounded by the send timeout (a client that stopped reading)."""

    def __init__(self, ws: WebSocket, timeout_s: float, dialect: GA):
        self.ws = ws
        self.dialect = dialect
        self.timeout_s = timeout_s
        self.closed = False
        self.lock = asyncio.Lock()  # both directions answer the client: one frame at a time

    async def events(self, events: list[dict]) -> None:
        for event in self.dialect.outgoing(events):
            event.setdefault("event_id", event_id())
            try:
                async with self.lock:
                    async with asyncio.timeout(self.timeout_s):  # a timer: wait_for made a task for every event
                        await self.ws.send_text(json.dumps(event, separators=(",", ":")))
            except TimeoutError:
                log.warning("realtime client took no event for %.0f s: cutting it off", self.timeout_s)
                raise SendTimeout from None

    async def close(self, code: int, reason: str) -> None:
        if not self.closed:
            self.closed = True
            try:
                await asyncio.wait_for(self.ws.close(code, reason), self.timeout_s)
            except (TimeoutError, RuntimeError, WebSocketDisconnect):
                pass


async def session_to_client(call, translator: Translator, send: Sender) -> None:
    while True:
        event = await read(call)
        if event is grpc.aio.EOF:
            await send.close(CLOSE_NORMAL, "session ended")
            return
        await send.events(translator.server_events(event))
        if event.WhichOneof("event") == "closed":
            await send.close(CLOSE_CODES.get(event.closed.reason, CLOSE_NORMAL), event.closed.message[:120])
            return


async def client_to_session(ws: WebSocket, call, translator: Translator, dialect: GA, send: Sender, config,
                           gone: asyncio.Event) -> None:
    """The client's events, translated, to the session; refused ones answered with `error` at once."""
    try:
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                break
            text = message.get("text")
            if text is None:
                await send.events([api_error_event(ClientEventError(
                    "events are JSON text frames, not binary", None, "invalid_event"))])
                continue
            try:
                event = json.loads(text)
                if not isinstance(event, dict):
                    raise ClientEventError("an event is a JSON object", None, "invalid_event")
            except (ValueError, RecursionError):
                await send.events([api_error_event(ClientEventError("the event is not valid JSON", None, "invalid_json"))])
                continue
            except ClientEventError as exc:
                await send.events([api_error_event(exc)])
                continue
            sent = event
            try:
                event = dialect.incoming(sent)  # as the GA protocol's
                if event.get("type") == "conversation.item.retrieve":  # the gateway keeps the items: no session call
                    await send.events([translator.retrieved(event)])
                    continue
                request = client_event(event, config, translator.last_item, translator.tools, translator.sending_format)
                dialect.amend(sent, request)
            except ClientEventError as exc:
                exc.event_id = sent.get("event_id") if isinstance(sent.get("event_id"), str) else None
                await send.events([api_error_event(exc)])
                continue
            # Before the write: the session answers it after.
            if request.HasField("update"):
                translator.update_requested(requested_formats(event))
            await call.write(request)
    except (WebSocketDisconnect, SendTimeout, RuntimeError, asyncio.InvalidStateError, grpc.aio.AioRpcError):
        pass
    finally:
        gone.set()
        call.cancel()  # the client left: end the session (its response is cancelled in every stage)
