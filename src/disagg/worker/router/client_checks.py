"""What the OpenAI endpoints check of a client before anything else: that a JSON body says it is
JSON, its API key (`--api-key`; none given: every client is served) and the model its request
names."""

from __future__ import annotations

from aiohttp import web

from disagg.worker.router.errors import APIError


def check_json_body(request: web.Request) -> None:
    """A body read as JSON must come as `Content-Type: application/json` (parameters such as
    `charset` allowed), else a 415. A web page may make its visitor's browser POST a `text/plain`
    body (or one with no type) to any address, this router on localhost included, without asking it
    first (no CORS preflight); a JSON type needs that preflight, which --allowed-origins decides."""
    given = request.headers.get("Content-Type")
    if given is None or request.content_type != "application/json":
        what = f"Content-Type {given!r}" if given is not None else "a request without a Content-Type"
        raise APIError(
            415,
            f"{what} is not supported: send the JSON body with the header 'Content-Type: application/json'",
            code="unsupported_media_type",
        )


def check_api_key(request: web.Request, keys: frozenset[str]) -> None:
    if not keys:
        return
    auth = request.headers.get("Authorization", "")
    token = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
    if token not in keys:
        msg = (
            "Incorrect API key provided." if token else "Missing API key: send 'Authorization: Bearer <key>'."
        )
        raise APIError(401, msg, code="invalid_api_key")


def unknown_model(name: str) -> APIError:
    return APIError(404, f"The model '{name}' does not exist.", param="model", code="model_not_found")


def check_model(requested: str | None, served: str) -> None:
    """A request that may leave the model out (vLLM's /tokenize) names the served one or none."""
    if requested is not None and requested != served:
        raise unknown_model(requested)
