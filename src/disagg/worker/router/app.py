"""The router's aiohttp application: the OpenAI endpoints in front of the worker pool.

`Router` makes the parts each request goes through once, hands them to the endpoint families
(`generate_endpoints.py`, `model_endpoints.py`, `tokenize_endpoints.py`, `status_endpoints.py`)
and routes their paths; what a generation request goes through is `generate_endpoints.py`'s.
Every POST route takes a JSON body only as `application/json` (`client_checks.check_json_body`),
and browsers' cross-origin calls are what `--allowed-origins` allows (`cors.py`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from disagg.worker.router.admission import Admission
from disagg.worker.router.args import RouterArgs
from disagg.worker.router.client_checks import check_json_body
from disagg.worker.router.cors import CorsPolicy
from disagg.worker.router.errors import APIError
from disagg.worker.router.generate_endpoints import ARRIVAL, ECHO_HEADERS, GenerateEndpoints
from disagg.worker.router.model_endpoints import ModelEndpoints
from disagg.worker.router.placement import Placement
from disagg.worker.router.prompt_tokens import PromptTokenizer
from disagg.worker.router.status_endpoints import StatusEndpoints
from disagg.worker.router.tokenize_endpoints import TokenizeEndpoints
from disagg.worker.router.unsupported import fallback
from disagg.worker.router.workers import WorkerPool
from disagg.worker.serving.auth import INSECURE, InternalAuth
from disagg.worker.serving.metrics import ServingMetrics


class Router:
    def __init__(
        self,
        args: RouterArgs,
        tokenizer,
        pool: WorkerPool,
        *,
        model_name: str,
        api_keys: frozenset[str] = frozenset(),
        prefix_lookup: Callable[[list[int]], dict[str, int]] | None = None,
        metrics: ServingMetrics | None = None,
        internal_auth: InternalAuth = INSECURE,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`args.max_model_len` is the model's context, resolved (the flag's None is not)."""
        if args.max_model_len is None:
            raise ValueError("the router needs max_model_len: the model's context, resolved before")
        self.args = args
        self.cors = CorsPolicy(args.allowed_origins)
        self.model_name = model_name
        self.api_keys = api_keys
        self.clock = clock  # every latency the router reports (tests inject theirs)
        self.pool = pool
        self.metrics = metrics or ServingMetrics("router", model_name)
        self.prompts = PromptTokenizer(tokenizer)
        self.admission = Admission(args.max_queue)
        self.placement = Placement(args, pool, prefix_lookup, self.metrics)
        self.generate = GenerateEndpoints(
            args, model_name, api_keys, self.prompts, self.admission, self.placement, self.metrics, clock
        )
        self.models = ModelEndpoints(model_name, api_keys, pool)
        self.tokenization = TokenizeEndpoints(args, model_name, api_keys, self.prompts)
        self.status = StatusEndpoints(model_name, pool, self.metrics, internal_auth)

    def app(self) -> web.Application:
        # bodies are decoded by read_body under max_body_bytes, not by aiohttp (router/body.py)
        app = web.Application(
            middlewares=[self._arrival_middleware, self._errors_middleware],
            client_max_size=self.args.max_body_bytes,
            handler_args={"auto_decompress": False},
        )
        served = {
            "/v1/completions": ("POST", self.generate.completions),
            "/v1/chat/completions": ("POST", self.generate.chat_completions),
            "/v1/responses": ("POST", self.generate.responses),
            "/v1/models": ("GET", self.models.models),
            "/v1/models/{model_id}": ("GET", self.models.model),
            "/health": ("GET", self.status.health),
            "/ping": ("GET", self.status.health),  # vLLM's (SageMaker's) name for the same readiness
            "/invocations": ("POST", self.generate.invocations),
            "/version": ("GET", self.status.version),
            "/tokenize": ("POST", self.tokenization.tokenize),
            "/detokenize": ("POST", self.tokenization.detokenize),
            "/internal/workers": ("GET", self.status.internal_workers),
            "/openapi.json": ("GET", self.status.openapi),
            "/metrics": ("GET", self.status.metrics_page),
        }
        methods = {path: [m, *(["HEAD"] if m == "GET" else [])] for path, (m, _) in served.items()}
        catch_all = fallback(methods)
        for path, (method, handler) in served.items():
            if method == "POST":  # every POST body here is JSON
                handler = _json_body(handler)
            preflight = self.cors.preflight(methods[path], catch_all)
            # clients and proxies add a trailing slash: the same route, not a 405 or a redirect
            path = path.replace("{model_id}", "{model_id:.+}")  # model ids hold slashes (org/model)
            for p in (path, path + "/") if not path.endswith("}") else (path,):
                app.router.add_route(method, p, handler)
                if method == "GET":
                    app.router.add_route("HEAD", p, handler)
                app.router.add_route("OPTIONS", p, preflight)
        app.router.add_route("*", "/v1/{endpoint:.*}", catch_all)  # after every served route
        for path in methods:
            if not path.startswith("/v1/"):  # another method on a served path outside /v1: 405 too
                app.router.add_route("*", path, catch_all)
                app.router.add_route("*", path + "/", catch_all)
        app.on_response_prepare.append(self._echo_headers)
        app.on_response_prepare.append(self.cors.on_prepare)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    @staticmethod
    async def _echo_headers(request: web.Request, response: web.StreamResponse) -> None:
        response.headers.update(request.get(ECHO_HEADERS) or {})

    async def _on_startup(self, _app) -> None:
        await self.pool.start()

    async def _on_cleanup(self, _app) -> None:
        await self.pool.stop()
        self.prompts.close()

    @web.middleware
    async def _arrival_middleware(self, request: web.Request, handler):
        request[ARRIVAL] = self.clock()  # the outermost middleware: before anything reads the body
        return await handler(request)

    @web.middleware
    async def _errors_middleware(self, request: web.Request, handler):
        try:
            return await handler(request)
        except APIError as e:
            self.metrics.rejected(e.status)
            return web.json_response(e.body(), status=e.status, headers=e.headers())
        except web.HTTPException as e:
            if e.status >= 400:
                err = APIError(e.status, e.reason or "error")
                return web.json_response(err.body(), status=e.status)
            raise


def _json_body(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    async def json_only(request: web.Request) -> web.StreamResponse:
        check_json_body(request)  # before the body is read: a 415 costs nothing
        return await handler(request)

    return json_only
