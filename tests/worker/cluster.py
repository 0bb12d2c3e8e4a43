"""Real worker and router processes on loopback for the serving and router tests."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx

from disagg.proto import worker_pb2 as pb
from disagg.proto import worker_pb2_grpc as pb_grpc
from disagg.worker.cli.ports import free_port
from disagg.worker.engine.args import EngineArgs
from disagg.worker.serving.args import ServingArgs
from disagg.worker.serving.process_args import WorkerProcessArgs

from .redis_check import assert_no_transfer_records

STARTUP_TIMEOUT = 120.0


def child_pids(pid: int) -> list[int]:
    """Child processes of `pid`, whichever of its threads started them (a worker starts its
    tensor-parallel ranks from its engine thread; /proc/PID/task/PID/children lists only the
    main thread's)."""
    return [
        int(c)
        for task in Path(f"/proc/{pid}/task").iterdir()
        for c in (task / "children").read_text().split()
    ]


def threshold_placement(threshold: int) -> list[str]:
    """Worker flags that send every prompt with `threshold` or more uncached tokens to a prefill
    worker (the tests that must see the prefill-worker path)."""
    return ServingArgs.cli_args(prefill_placement="threshold", disagg_threshold=threshold)


def greedy_body(model: str, prompt, max_tokens: int) -> dict:
    """A /v1/completions body whose output is a fixed number of greedy tokens (what the serving
    tests compare with the engine's own greedy output)."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def complete(url: str, body: dict) -> httpx.Response:
    """POST /v1/completions to the router at `url`."""
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


@dataclass
class Proc:
    name: str
    cmd: list[str]
    log: Path
    health: str
    grpc_address: str | None = None
    popen: subprocess.Popen | None = None
    env: dict | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.popen = subprocess.Popen(
                self.cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, **(self.env or {})},
            )  # fmt: skip

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.health, timeout=1) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def kill(self) -> None:
        if self.alive():
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(10)

    def stop(self) -> None:
        if self.alive():
            self.popen.terminate()
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


class Cluster:
    def __init__(
        self,
        model_dir: Path,
        tmp: Path,
        *,
        redis_url: str | None,
        prefill: int = 1,
        decode: int = 1,
        both: int = 0,
        kv_transfer: str = "nixl",
        worker_args: tuple[str, ...] = (),
        role_args: dict[str, tuple[str, ...]] | None = None,
        router_args: tuple[str, ...] = (),
        deployment: str = "test",
        env: dict[str, str] | None = None,
    ):
        """The deployment's internal credential (and `env`) reaches every process through its
        environment, as a Secret would: never on a command line."""
        self.token = secrets.token_urlsafe(24)
        self.env = {"DISAGG_INTERNAL_TOKEN": self.token, **(env or {})}
        self.model_dir = model_dir
        self.tmp = tmp
        self.redis_url = redis_url
        self.deployment = deployment
        self.workers: dict[str, Proc] = {}
        py = [sys.executable, "-m", "disagg.worker.cli"]
        for role, count in (("prefill", prefill), ("decode", decode), ("both", both)):
            for i in range(count):
                name = f"{role}-{i}"
                port, mport = free_port(), free_port()
                process = WorkerProcessArgs.cli_args(
                    role=role, worker_id=name, host="127.0.0.1", port=port, metrics_port=mport,
                    deployment=deployment, **({"redis_url": redis_url} if redis_url else {}),
                )  # fmt: skip
                cmd = py + [
                    "worker", *process, *ServingArgs.cli_args(kv_transfer=kv_transfer),
                    *EngineArgs.cli_args(model=str(model_dir), threads=1, num_gpu_blocks=512, max_num_seqs=64),
                    *worker_args, *(role_args or {}).get(role, ()),
                ]  # fmt: skip
                self.workers[name] = Proc(
                    name, cmd, tmp / f"{name}.log", f"http://127.0.0.1:{mport}/health", f"127.0.0.1:{port}",
                    env=self.env,
                )  # fmt: skip
        rport = free_port()
        self.url = f"http://127.0.0.1:{rport}"
        addrs = ",".join(w.grpc_address for w in self.workers.values())
        cmd = py + [
            "router", "--host", "127.0.0.1", "--port", str(rport), "--model", str(model_dir),
            "--workers", addrs, "--deployment", deployment, *(["--redis-url", redis_url] if redis_url else []),
            *router_args,
        ]  # fmt: skip
        self.router = Proc("router", cmd, tmp / "router.log", f"{self.url}/health", env=self.env)
        self.model_name = model_dir.name
        self._channels: dict[str, grpc.Channel] = {}

    def procs(self) -> list[Proc]:
        return [*self.workers.values(), self.router]

    def start(self) -> Cluster:
        env_threads = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            for p in self.procs():
                p.start()
        finally:
            if env_threads is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = env_threads
        self.wait_ready(list(self.workers))
        return self

    def wait_ready(self, names: list[str], timeout: float = STARTUP_TIMEOUT) -> None:
        """Wait for workers `names` to be healthy and the router to see every worker of them."""
        deadline = time.monotonic() + timeout
        pending = [self.workers[n] for n in names] + [self.router]
        while pending:
            for p in list(pending):
                if not p.alive():
                    raise RuntimeError(f"{p.name} exited:\n{p.tail()}")
                if p.healthy():
                    pending.remove(p)
            if time.monotonic() > deadline:
                raise RuntimeError("not ready: " + ", ".join(f"{p.name}:\n{p.tail()}" for p in pending))
            time.sleep(0.1)
        want = {n for n in names}
        while time.monotonic() < deadline:
            seen = self.router_sees()
            if want <= seen:
                return
            time.sleep(0.1)
        raise RuntimeError(f"the router does not see {want - self.router_sees()}")

    @property
    def internal_headers(self) -> dict[str, str]:
        """What an internal caller (the operator's tooling, a preStop hook) sends."""
        return {"Authorization": f"Bearer {self.token}"}

    def router_sees(self) -> set[str]:
        request = urllib.request.Request(f"{self.url}/internal/workers", headers=self.internal_headers)
        try:
            with urllib.request.urlopen(request, timeout=1) as r:
                body = json.load(r)
        except (urllib.error.URLError, OSError):
            return set()
        return {w["id"] for w in body["workers"] if w["ready"]}

    def stub(self, name: str, token: str | None = "") -> pb_grpc.WorkerStub:
        """A stub of worker `name` whose calls carry the deployment's credential (`token`: another
        one, or None for none)."""
        from disagg.worker.serving.auth import InternalAuth, TLSFiles

        env = self.router.env or self.env  # the router's certificate, where each process has its own
        tls_dir = env.get("DISAGG_GRPC_TLS_DIR")
        tls = TLSFiles.load(tls_dir, env.get("DISAGG_GRPC_TLS_SERVER_NAME")) if tls_dir else None
        addr = self.workers[name].grpc_address
        if addr not in self._channels:
            self._channels[addr] = InternalAuth(None, tls).channel(addr)
        token = self.token if token == "" else token
        return InternalAuth(token).wrap(pb_grpc.WorkerStub(self._channels[addr]))

    def load(self, name: str) -> pb.LoadResponse:
        return self.stub(name).Load(pb.LoadRequest(), timeout=5)

    def live_workers(self) -> list[str]:
        return [n for n, p in self.workers.items() if p.alive()]

    def wait_idle(self, timeout: float = 20.0) -> dict[str, pb.LoadResponse]:
        """Poll until every live worker holds no blocks and tracks no request; return the loads."""
        deadline = time.monotonic() + timeout
        while True:
            loads = {n: self.load(n) for n in self.live_workers()}
            busy = {
                n: ld for n, ld in loads.items()
                if ld.used_blocks or ld.reserved_blocks or ld.pinned_blocks or ld.inflight_requests or ld.running or ld.waiting
            }  # fmt: skip
            if not busy or time.monotonic() > deadline:
                return loads
            time.sleep(0.1)

    def assert_released(
        self, redis_url: str, idle_timeout: float = 20.0, records_timeout: float = 10.0
    ) -> None:
        """Every live worker back to an empty cache and no request, and no transfer record left in Redis."""
        for name, load in self.wait_idle(timeout=idle_timeout).items():
            assert load.used_blocks == 0, f"{name} still holds blocks: {load}"
            assert load.reserved_blocks == 0 and load.pinned_blocks == 0, f"{name}: {load}"
            assert load.inflight_requests == 0 and load.running == 0 and load.waiting == 0, f"{name}: {load}"
            assert load.free_blocks == load.total_blocks, f"{name}: {load}"
        password = self.env.get("DISAGG_REDIS_PASSWORD")
        assert_no_transfer_records(redis_url, self.deployment, timeout=records_timeout, password=password)

    def metric(self, name: str, metric: str, **labels: str) -> float:
        """Sum of a metric's samples (those with `labels`, any others) on a worker's or the
        router's /metrics page."""
        total = 0.0
        for line in self.metrics_page(name).splitlines():
            if line.startswith(metric) and not line.startswith("#"):
                key = line.split(" ", 1)[0].split("{", 1)[0]
                if key == metric and all(f'{k}="{v}"' in line for k, v in labels.items()):
                    total += float(line.rsplit(" ", 1)[1])
        return total

    def metrics_page(self, name: str) -> str:
        """A worker's or the router's /metrics page."""
        url = self.router.health if name == "router" else self.workers[name].health
        with urllib.request.urlopen(url.replace("/health", "/metrics"), timeout=5) as r:
            return r.read().decode()

    def assert_prefilled_on(self, r: httpx.Response, worker: str) -> None:
        """The router's response `r` was prefilled on `worker`. Otherwise the failure says where
        each worker counted its placements and what every process logged last."""
        got = r.headers.get("X-Disagg-Prefill-Worker")
        if got == worker:
            return
        report = [f"prefilled on {got!r}, not {worker!r}"]
        for name, proc in [*self.workers.items(), ("router", self.router)]:
            if name != "router" and proc.alive():
                counts = [
                    line for line in self.metrics_page(name).splitlines()
                    if line.startswith("disagg_disaggregation_decisions_total{")
                ]  # fmt: skip
                report.append(f"{name} placements: {counts}")
            report.append(f"{name} log:\n{proc.tail(10)}")
        raise AssertionError("\n".join(report))

    def stop(self) -> None:
        for ch in self._channels.values():
            ch.close()
        for p in [self.router, *self.workers.values()]:
            p.stop()
