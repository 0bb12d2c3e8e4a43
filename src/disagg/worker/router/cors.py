"""Which web pages may call the router from a browser (CORS, `--allowed-origins`).

By default none: a preflight (`OPTIONS` with `Origin` and `Access-Control-Request-Method`) is a 403
and no response carries an Access-Control-* header, so a browser lets no other site's script send
the router a JSON request or read its answer (a JSON body needs the preflight: client_checks.py).
Origins named (or `*`) get their preflights answered with the path's methods and the headers a
client sends, and `Access-Control-Allow-Origin` on every response to them, errors included.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from disagg.worker.router.args import parse_origins
from disagg.worker.router.errors import APIError

ALLOWED_HEADERS = "Authorization, Content-Type, X-Request-Id"
EXPOSED_HEADERS = "X-Request-Id"  # the id to quote when reporting a request
MAX_AGE_SECONDS = 600  # how long a browser may reuse a preflight's answer


class CorsPolicy:
    def __init__(self, allowed_origins: str):
        self.origins = parse_origins(allowed_origins)
        self.any = "*" in self.origins

    def allows(self, origin: str | None) -> bool:
        return origin is not None and (self.any or origin.lower() in self.origins)

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        """Every response (an app's on_response_prepare): who may read it."""
        if self.origins and not self.any:
            response.headers.add("Vary", "Origin")  # the answer depends on who asks (caches)
        origin = request.headers.get("Origin")
        if self.allows(origin):
            response.headers["Access-Control-Allow-Origin"] = "*" if self.any else origin
            response.headers["Access-Control-Expose-Headers"] = EXPOSED_HEADERS

    def preflight(
        self, methods: list[str], otherwise: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        """The OPTIONS handler of a path served with `methods`; an OPTIONS that is no preflight
        goes to `otherwise` (the 405 of a method the path does not take)."""

        async def cors_preflight(request: web.Request) -> web.StreamResponse:
            origin = request.headers.get("Origin")
            if origin is None or "Access-Control-Request-Method" not in request.headers:
                return await otherwise(request)
            if not self.allows(origin):
                raise APIError(
                    403,
                    f"cross-origin requests from {origin} are not allowed; the router's "
                    "--allowed-origins names the web origins it serves",
                    code="origin_not_allowed",
                )
            return web.Response(
                status=204,
                headers={
                    "Access-Control-Allow-Methods": ", ".join(methods),
                    "Access-Control-Allow-Headers": ALLOWED_HEADERS,
                    "Access-Control-Max-Age": str(MAX_AGE_SECONDS),
                },
            )

        return cors_preflight
