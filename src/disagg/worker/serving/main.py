"""A worker process: engine-loop thread + gRPC server + /metrics and /health, until SIGTERM."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import signal
from dataclasses import dataclass, field

import grpc
from aiohttp import web

from disagg.proto import worker_pb2_grpc as pb_grpc
from disagg.worker.engine.args import EngineArgs
from disagg.worker.serving.args import ServingArgs
from disagg.worker.serving.auth import INSECURE, REFUSED, InternalAuth
from disagg.worker.serving.core import WorkerCore
from disagg.worker.serving.engine_loop import EngineLoop
from disagg.worker.serving.metrics import CONTENT_TYPE, ServingMetrics
from disagg.worker.serving.process_args import WorkerProcessArgs
from disagg.worker.serving.servicer import ServingOptions, WorkerService
from disagg.worker.serving.state_link import StateLink
from disagg.worker.serving.stubs import GRPC_OPTIONS
from disagg.worker.serving.warm_up import warm_up

log = logging.getLogger("disagg.worker")


@dataclass
class WorkerConfig:
    """What one worker process serves and how it joins its deployment; `engine` holds every
    engine setting (`EngineArgs`), resolved before the process starts, `serving` every serving
    setting (`ServingArgs`); the process's own fields default as its flags do (`WorkerProcessArgs`)."""

    engine: EngineArgs
    role: str
    worker_id: str
    model_name: str
    host: str = WorkerProcessArgs.host
    advertise_host: str = WorkerProcessArgs.advertise_host
    port: int = WorkerProcessArgs.port
    metrics_port: int = WorkerProcessArgs.metrics_port
    redis_url: str | None = WorkerProcessArgs.redis_url
    deployment: str = WorkerProcessArgs.deployment
    serving: ServingArgs = field(default_factory=ServingArgs)
    auth: InternalAuth = INSECURE
    redis_password: str | None = None

    @property
    def model(self) -> str:
        return self.engine.model


def _build_engine(cfg: WorkerConfig):
    from disagg.worker.engine.llm_engine import LLMEngine
    from disagg.worker.model.tp_join import authkey_from_token

    # ranks on other hosts join with a key derived from the internal credential (none: refused)
    token = cfg.auth.token
    return LLMEngine(cfg.engine, rank_authkey=authkey_from_token(token) if token else None)


def kv_storage(engine) -> dict:
    """How the engine's cache stores K/V, as `KVLayout.from_tensor` takes it."""
    model = engine.model
    if model.kv_cache_dtype == "auto":
        return {}
    dtype = str(model.dtype).removeprefix("torch.")
    geometry = (dtype, engine.block_size, model.num_kv_heads, model.head_dim)
    return {"kv_cache_dtype": model.kv_cache_dtype, "quantized_geometry": geometry}


def _build_transport(cfg: WorkerConfig, engine, address: str):
    # a colocated worker has one too: it pulls a prefix another worker holds (and serves such pulls)
    from disagg.worker.kv_transfer import KVLayout, create_transport

    layout = KVLayout.from_tensor(
        engine.kv_cache,
        cfg.model_name,
        engine.args.tensor_parallel_size,
        engine.config.num_key_value_heads,
        weight_quantization=engine.model.quantization,
        **kv_storage(engine),
    )
    options = {}
    if cfg.serving.kv_transfer == "nixl":
        from disagg.worker.kv_transfer.nixl_transport import restrict_ucx_to

        # UCX would otherwise listen on every interface, whatever --host says
        restrict_ucx_to(cfg.host)
    if cfg.serving.kv_transfer == "grpc":
        options = {"advertise_address": address, "connect": cfg.auth.channel, "wrap_stub": cfg.auth.wrap}
    transport = create_transport(cfg.serving.kv_transfer, engine.kv_cache, layout, cfg.worker_id, **options)
    if engine.ranks is None:
        return transport
    from disagg.worker.kv_transfer.sharded import ShardedTransport

    try:  # every other rank gets its own transport over its part of the cache
        return ShardedTransport(transport, engine.ranks, cfg.serving.kv_transfer, cfg.worker_id, cfg.host)
    except BaseException:
        transport.close()
        raise


def _kv_state(cfg: WorkerConfig, address: str, metrics_url: str):
    if not cfg.redis_url:
        return None, None
    from disagg.worker.kv_state import KVState, WorkerInfo

    info = WorkerInfo(
        id=cfg.worker_id, role=cfg.role, address=address, metrics_url=metrics_url, model=cfg.model_name
    )
    return KVState(cfg.redis_url, cfg.deployment, cfg.worker_id, password=cfg.redis_password), info


def quarantine_seconds(cfg: WorkerConfig) -> float:
    return cfg.serving.quarantine_seconds()


class WorkerProcess:
    def __init__(self, cfg: WorkerConfig):
        self.cfg = cfg
        self.metrics = ServingMetrics(cfg.role, cfg.model_name)
        self.loop = EngineLoop()
        self.server: grpc.aio.Server | None = None
        self.http: web.AppRunner | None = None
        self.service: WorkerService | None = None
        self.state: StateLink | None = None
        self.port = cfg.port
        self.metrics_port = cfg.metrics_port
        self._stop = asyncio.Event()
        self._drain_deadline: float | None = None
        self._handoff_at: float | None = None  # when a drain hands its streams off to the router
        self.exit_code = 0

    @property
    def address(self) -> str:
        return f"{self.cfg.advertise_host}:{self.port}"

    async def _start_grpc(self) -> None:
        # sync handlers (the gRPC KV fallback's servicer) run on this pool
        self.server = grpc.aio.server(
            migration_thread_pool=concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="grpc-sync"),
            options=GRPC_OPTIONS,
            interceptors=self.cfg.auth.interceptors(),
        )
        self.port = self.cfg.auth.add_port(self.server, f"{self.cfg.host}:{self.cfg.port}")
        if self.port == 0:
            raise RuntimeError(f"cannot bind the gRPC port {self.cfg.host}:{self.cfg.port}")

    async def _start_http(self) -> None:
        app = web.Application()

        async def metrics(_r):
            return web.Response(body=self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE})

        async def health(_r):
            s = self.service
            ready = bool(s and s.ready and self.loop.alive and not s.draining)
            # readiness only: the metrics port has no credential, so it names no worker, address or
            # load (the router reads those over authenticated gRPC)
            body = {"ready": ready, "role": self.cfg.role, "draining": bool(s and s.draining)}
            return web.json_response(body, status=200 if ready else 503)

        async def live(_r):
            # Liveness: the server answers and the engine loop, once started, still runs. Loading
            # and draining workers are alive; readiness (/health) is what takes them out of rotation.
            alive = self.service is None or self.loop.alive
            return web.json_response({"alive": alive}, status=200 if alive else 503)

        async def drain(request):
            # Kubernetes' preStop hook (`disagg drain` in the pod): stop admitting and answer once
            # in-flight streams are done, so the SIGTERM that follows finds nothing to cut off.
            # Taking a worker out of rotation is internal: it needs the deployment's credential.
            if not self.cfg.auth.check(request.headers.get("Authorization")):
                REFUSED.labels("drain").inc()
                return web.json_response({"error": "missing or wrong internal credential"}, status=401)
            s = self.service
            if s is None:
                return web.json_response({"drained": True, "streams": 0})
            s.draining = True
            remaining = await self._wait_for_streams(s)
            return web.json_response({"drained": remaining == 0, "streams": remaining})

        app.router.add_get("/metrics", metrics)
        app.router.add_get("/health", health)
        app.router.add_get("/live", live)
        app.router.add_get("/drain", drain)
        self.http = web.AppRunner(app, access_log=None)
        await self.http.setup()
        site = web.TCPSite(self.http, self.cfg.host, self.cfg.metrics_port)
        await site.start()
        self.metrics_port = site._server.sockets[0].getsockname()[1]

    async def run(self) -> int:
        aio = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            aio.add_signal_handler(sig, self._stop.set)
        await self._start_grpc()
        await self._start_http()
        holder: dict = {}

        def init():
            engine = _build_engine(self.cfg)
            transport = _build_transport(self.cfg, engine, self.address)
            holder["engine"], holder["transport"] = engine, transport

        log.info("worker %s (%s) loading %s", self.cfg.worker_id, self.cfg.role, self.cfg.model)
        try:
            await asyncio.wrap_future(self.loop.start(init))
        except Exception:
            log.exception("worker failed to start")
            await self._shutdown_servers()
            return 1
        engine = holder["engine"]
        kv, info = _kv_state(
            self.cfg, self.address, f"http://{self.cfg.advertise_host}:{self.metrics_port}/metrics"
        )
        self.state = StateLink(kv, info)
        core = WorkerCore(
            engine,
            holder["transport"],
            self.cfg.engine.block_size,
            self.metrics,
            on_publish=self.state.publish,
        )
        # aborted transfers' blocks stay held until no late write can come: the prefill worker
        # gives up within the prefill timeout, or its lease is reclaimed
        core.receiver.quarantine_seconds = quarantine_seconds(self.cfg)
        await asyncio.wrap_future(
            self.loop.call(warm_up, engine, self.cfg.engine.block_size, core.prefill_rate)
        )
        self.loop.engine = engine
        self.loop.step_fn = core.step
        self.loop.on_fatal = lambda e: self._engine_failed(core, e, aio)
        self.loop.has_work = core.has_work
        self.loop.on_iteration = core.refresh_load
        if engine.ranks is not None:
            self.loop.add_poller(lambda: self._watch_ranks(core, engine.ranks, aio))
        self.loop.add_poller(core.sender.poll)
        self.loop.add_poller(core.receiver.poll)
        await asyncio.wrap_future(self.loop.call(core.refresh_load))
        opts = ServingOptions(
            worker_id=self.cfg.worker_id,
            role=self.cfg.role,
            model_name=self.cfg.model_name,
            address=self.address,
            args=self.cfg.serving,
            quantization=engine.model.quantization,
            dtype=str(engine.model.dtype).removeprefix("torch."),
        )
        from disagg.worker.model.quantization import decode_weight_bytes

        self.metrics.weights(engine.model.quantization, opts.dtype, decode_weight_bytes(engine.model.weights))
        block_size = self.cfg.engine.block_size
        kv_dtype = engine.model.kv_cache_dtype  # int8 / fp8: the scales count in the bytes
        if kv_dtype == "auto":
            kv_dtype = str(engine.kv_cache.dtype).removeprefix("torch.")
        self.metrics.kv_cache(kv_dtype, engine.model.kv_cache_block_bytes(block_size) // block_size)
        self.service = WorkerService(
            opts, self.loop, core, self.state, self.metrics, engine.max_model_len, auth=self.cfg.auth
        )
        pb_grpc.add_WorkerServicer_to_server(self.service, self.server)
        if holder["transport"] is not None and hasattr(holder["transport"], "servicer"):
            from disagg.proto import kv_transfer_pb2_grpc

            servicer = holder["transport"].servicer(self.service.identity.refusal)
            kv_transfer_pb2_grpc.add_KVTransferServicer_to_server(servicer, self.server)
        await self.server.start()
        await self.state.register()
        self.state.start(
            lambda: dict(core.load),
            lambda rid: self.loop.call(core.on_loop_reclaim, rid),
            lambda hashes: asyncio.wrap_future(self.loop.call(core.on_loop_evicted, hashes)),
        )
        self.service.ready = True
        print(
            f"worker {self.cfg.worker_id} ready: role={self.cfg.role} grpc={self.address} "
            f"metrics=http://{self.cfg.advertise_host}:{self.metrics_port}/metrics "
            f"blocks={engine.num_total_blocks} kv={self.cfg.serving.kv_transfer if holder['transport'] else 'none'}",
            flush=True,
        )
        await self._stop.wait()
        await self.drain()
        return self.exit_code

    def _engine_failed(self, core, error: BaseException, aio) -> None:
        """On the engine thread, after the step kept failing: answer every request, then exit
        (non-zero, so a supervisor restarts the worker)."""
        core.on_loop_fail_all(error)
        self.exit_code = 1
        aio.call_soon_threadsafe(self._stop.set)

    def _watch_ranks(self, core, ranks, aio) -> bool:
        """A tensor-parallel rank that exited fails every request now, even when no step runs
        (a decode worker waiting for KV, a prefill worker sending it), and the worker exits."""
        if self.exit_code == 0:
            try:
                ranks.check_alive()
            except Exception as exc:
                if not self._stop.is_set():
                    log.error("%s; failing its requests and stopping", exc)
                    self._engine_failed(core, exc, aio)
        return False

    async def drain(self) -> None:
        """Stop admitting, let in-flight requests finish (bounded), deregister, stop."""
        s = self.service
        log.info("draining worker %s", self.cfg.worker_id)
        s.draining = True
        await self._wait_for_streams(s)
        await self.state.deregister()
        await self.state.stop()
        await s.close()
        await self._shutdown_servers()
        transport = s.core.transport
        if transport is not None and self.loop.alive:
            await asyncio.wrap_future(self.loop.call(transport.close))
        self.loop.stop()
        s.core.engine.close()  # the other tensor-parallel ranks, if any
        log.info("worker %s stopped", self.cfg.worker_id)

    async def _wait_for_streams(self, s) -> int:
        """Wait for in-flight streams to finish; returns how many remain.

        One deadline, drain_timeout after draining first began, bounds the preStop /drain and the
        SIGTERM drain together, so both fit in the pod's termination grace period.
        """
        clock = asyncio.get_running_loop().time
        if self._drain_deadline is None:
            self._drain_deadline = clock() + self.cfg.serving.drain_timeout
            self._handoff_at = clock() + self.cfg.serving.drain_handoff
        deadline = self._drain_deadline
        # after a hand-off, the new workers' pulls of the streams' K/V are awaited too (bounded)
        while (s.streams > 0 or s.pulls_expected()) and clock() < deadline:
            if self._handoff_at is not None and clock() >= self._handoff_at and self._handoff_at < deadline:
                self._handoff_at = None
                log.info("draining: handing %d streams off to the router", s.hand_off())
            await asyncio.sleep(0.05)
        return s.streams

    async def _shutdown_servers(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=1.0)
        if self.http is not None:
            await self.http.cleanup()
