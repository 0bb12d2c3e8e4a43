"""Requests no served route takes: a 405 naming the method, with `Allow`, when the path is served
with other methods; a 404 in OpenAI's error shape naming the endpoint otherwise (embeddings,
images, audio, files, ...), instead of a bare "Not Found"."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

from aiohttp import web

from disagg.worker.router.errors import APIError


def _pattern(template: str) -> re.Pattern:
    # a template's `{name}` takes the rest of the path (model ids hold slashes: org/model)
    return re.compile(re.sub(r"\\\{\w+\\\}", ".+", re.escape(template)) + "/?")


def fallback(served: dict[str, list[str]]) -> Callable[[web.Request], Awaitable[web.Response]]:
    """The handler behind every served route: `served` maps each path template to its methods."""
    patterns = [(_pattern(path), methods) for path, methods in served.items()]
    endpoints = ", ".join(p for p in served if p.startswith("/v1/"))

    async def unsupported_endpoint(request: web.Request) -> web.Response:
        for pattern, methods in patterns:
            if pattern.fullmatch(request.path):
                raise APIError(405, f"{request.method} is not allowed on {request.path}; use {', '.join(methods)}",
                               code="method_not_allowed", headers={"Allow": ", ".join(methods)})  # fmt: skip
        raise APIError(
            404,
            f"{request.method} {request.path} is not supported by this server; it serves {endpoints}",
            code="unsupported_endpoint",
        )

    return unsupported_endpoint
