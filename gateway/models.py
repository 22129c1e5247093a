"""`GET /v1/models` and `/v1/models/{id}` (the one model served, its voices), and the probes:
`/live`, `/health` (ready while the router's omni.v1.Omni is SERVING) and Prometheus `/metrics`."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.errors import APIError
from gateway.process import Gateway

OPEN_PATHS = ("/live", "/health")  # probes: no token (they carry no data)
routes = APIRouter()


def model_card(gateway: Gateway) -> dict:
    config = gateway.config
    return {"id": config.model, "object": "model", "created": gateway.created, "owned_by": "omni-serve",
            "voices": list(config.voices), "default_voice": config.default_voice, "modalities": ["text", "audio"]}


@routes.get("/v1/models")
async def list_models(http: Request):
    return {"object": "list", "data": [model_card(http.app.state.gateway)]}


@routes.get("/v1/models/{model_id}")
async def get_model(model_id: str, http: Request):
    model = http.app.state.gateway.config.model
    if model_id != model:
        raise APIError(404, f"model {model_id!r} not found; served: {model}", "invalid_request_error",
                       "model", "model_not_found")
    return model_card(http.app.state.gateway)


@routes.get("/live")
async def live():
    """Liveness: the process answers (it does not follow the router, so a router outage does not
    restart every gateway)."""
    return {"status": "ok"}


@routes.get("/health")
async def health(http: Request):
    gateway: Gateway = http.app.state.gateway
    if await gateway.ready():
        return {"status": "ok"}
    return JSONResponse({"status": "unavailable", "router": gateway.config.router}, status_code=503)


@routes.get("/metrics")
async def prometheus(http: Request):
    return Response(generate_latest(http.app.state.gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)
