"""OpenAI endpoints this server does not serve (embeddings, images, audio, files, ...): a 404 in
OpenAI's error shape that names the endpoint, instead of a bare "Not Found"."""

from __future__ import annotations

from aiohttp import web

from disagg.worker.router.errors import APIError

SERVED = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models")


async def unsupported_endpoint(request: web.Request) -> web.Response:
    if request.path.rstrip("/") in SERVED:  # a served endpoint asked with another method
        raise APIError(405, f"{request.method} is not allowed on {request.path}", code="method_not_allowed")
    raise APIError(
        404,
        f"{request.method} {request.path} is not supported by this server; it serves " + ", ".join(SERVED),
        code="unsupported_endpoint",
    )
