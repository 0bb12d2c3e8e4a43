"""`disagg up`: the whole deployment on this machine — Redis, prefill and decode workers, router.

Children are started with a parent-death signal, so they never outlive this process, and are
stopped with SIGTERM (then SIGKILL) on Ctrl-C or SIGTERM, and only then. A child that dies is
started again as Kubernetes restarts a pod: with a crash-loop backoff and at most a few restarts
per window (`restart_policy.py`), never giving up on it and never stopping its siblings. Their
output goes to `.run/<name>.log`.

The deployment's secrets are generated here: the internal credential of worker traffic and the
Redis password, each in a 0600 file under `<run-dir>/secrets/` and handed to the children through
their environment (Redis reads its password from its 0600 config file), never on a command line.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from disagg.worker.cli.flags import Up
from disagg.worker.cli.ports import free_port
from disagg.worker.cli.restart_policy import RestartPolicy
from disagg.worker.engine.args import EngineArgs
from disagg.worker.engine.settings import given
from disagg.worker.model import pretrained
from disagg.worker.model.gguf_checkpoint import served_name
from disagg.worker.router.args import RouterArgs, RouterProcessArgs
from disagg.worker.serving.args import ServingArgs
from disagg.worker.serving.auth import PEER_IDENTITIES
from disagg.worker.serving.process_args import WorkerProcessArgs


def redis_command(port: int, data_dir: Path | None = None, config: Path | None = None) -> list[str]:
    """A throwaway loopback Redis: no snapshots, no append-only file (KV state is rebuilt, not restored).
    With `config` (see `write_redis_config`) everything, the password included, comes from that file."""
    if config is not None:
        return ["redis-server", str(config)]
    cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    return cmd if data_dir is None else [*cmd, "--dir", str(data_dir)]


def write_private(path: Path, text: str) -> Path:
    """Write `text` to a file only its owner can read (created 0600, never briefly wider)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def write_redis_config(path: Path, port: int, password: str, data_dir: Path | None = None) -> Path:
    """A 0600 redis.conf: loopback, protected mode, a password (the file keeps it out of `ps`)."""
    lines = [
        f"port {port}", "bind 127.0.0.1", "protected-mode yes", f'requirepass "{password}"',
        'save ""', "appendonly no", *([f'dir "{data_dir}"'] if data_dir is not None else []),
    ]  # fmt: skip
    return write_private(path, "\n".join(lines) + "\n")


def new_secret() -> str:
    return secrets.token_urlsafe(32)  # URL- and redis.conf-safe characters only


_PR_SET_PDEATHSIG = 1
DEPLOYMENT = "local"  # the Redis key namespace of the workers and the router

# A factual question: the pretrained default's answer can be checked by eye.
DEMO_MESSAGE = "What is the capital of France?"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        Up.MODEL, help=f"model directory or GGUF file (default: {pretrained.NAME}, `{pretrained.INSTALL}`)"
    )
    p.add_argument(Up.PREFILL, type=int, default=1, help="number of prefill workers")
    p.add_argument(Up.DECODE, type=int, default=1, help="number of decode workers")
    p.add_argument(Up.BOTH, type=int, default=0, help="number of colocated workers (role both)")
    p.add_argument(Up.PORT, type=int, default=RouterProcessArgs.port, help="router port")
    p.add_argument(
        Up.PREFILL_TP,
        type=int,
        default=None,
        help="tensor-parallel ranks of each prefill worker (default: --tensor-parallel-size)",
    )
    p.add_argument(Up.DECODE_TP, type=int, default=None,
                   help="tensor-parallel ranks of each decode worker (default: --tensor-parallel-size); "
                        "it may differ from --prefill-tp: each rank receives its own KV heads")  # fmt: skip
    p.add_argument(Up.RUN_DIR, default=".run", help="where logs go")
    p.add_argument(Up.DEMO, action="store_true",
                   help="stream one chat completion once ready, then exit; its prompt goes through a prefill "
                        "worker to show that path (--prefill-placement threshold --disagg-threshold 1) "
                        "unless either flag is given")  # fmt: skip
    p.add_argument(Up.TIMEOUT, type=float, default=180.0, help="seconds to wait for everything to be ready")
    p.add_argument(Up.WORKER_ARG, action="append", default=[], help="extra argument for every worker")
    p.add_argument(Up.PEER_IDENTITY, choices=PEER_IDENTITIES, default=PEER_IDENTITIES[0],
                   help="token: the deployment's credential alone; certificate: each child its own certificate "
                        "from a CA made for this run (mutual TLS), and each worker acts only for itself")  # fmt: skip
    # every worker gets these; --threads defaults to cores / workers here
    EngineArgs.add_cli_args(p, model=False)
    ServingArgs.add_cli_args(p)
    # the router gets these; its block size and context are the workers' (--block-size, --max-model-len)
    RouterArgs.add_cli_args(p, skip=("block_size", "max_model_len"))


def serving_args(args) -> ServingArgs:
    """The workers' serving settings. --demo sends its prompt through a prefill worker to show that
    path (placement threshold, from the first uncached token) unless the placement flags are given."""
    try:
        serving = ServingArgs.from_cli_args(args)
    except ValueError as exc:
        raise SystemExit(f"disagg up: {exc}") from None
    if args.demo and not given(args) & {"prefill_placement", "disagg_threshold"}:
        serving = dataclasses.replace(serving, prefill_placement="threshold", disagg_threshold=1)
    return serving


def router_args(args) -> RouterArgs:
    try:
        return RouterArgs.from_cli_args(args)
    except ValueError as exc:
        raise SystemExit(f"disagg up: {exc}") from None


def worker_engine_args(engine: EngineArgs, role: str, name: str) -> EngineArgs:
    """One worker's engine settings: no draft model on a prefill worker, and each worker its own
    subdirectory of the KV disk tier (a directory belongs to one engine)."""
    out = engine.without_speculation() if role == "prefill" else engine
    if engine.kv_disk_cache_dir:
        out = dataclasses.replace(out, kv_disk_cache_dir=str(Path(engine.kv_disk_cache_dir) / name))
    return out


def role_ranks(args, tensor_parallel_size: int) -> dict[str, int]:
    """Tensor-parallel ranks per role: --prefill-tp / --decode-tp, else --tensor-parallel-size."""
    ranks = {"prefill": args.prefill_tp, "decode": args.decode_tp, "both": None}
    for role, flag in (("prefill", Up.PREFILL_TP), ("decode", Up.DECODE_TP)):
        if ranks[role] is not None and ranks[role] < 1:
            raise SystemExit(f"disagg up: {flag} must be >= 1, got {ranks[role]}")
    ranks = {role: n or tensor_parallel_size for role, n in ranks.items()}
    if args.kv_transfer != "nixl":
        for role, flag in (("prefill", Up.PREFILL_TP), ("decode", Up.DECODE_TP)):
            if ranks[role] > 1 and getattr(args, role) > 0:
                raise SystemExit(
                    f"disagg up: {flag} {ranks[role]} needs --kv-transfer nixl (got --kv-transfer "
                    f"{args.kv_transfer}): KV moves between tensor-parallel workers over NIXL only"
                )
    return ranks


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the parent dies (no orphans, even on SIGKILL)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class Child:
    name: str
    cmd: list[str]
    log_path: Path
    health_url: str | None = None
    proc: subprocess.Popen | None = None
    ready: bool = False
    env: dict = field(default_factory=dict)
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    restart_at: float | None = None  # dead, to be started again at this time

    def start(self) -> None:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
            env={**os.environ, **self.env},
        )
        log.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check_ready(self) -> bool:
        if self.ready or self.health_url is None:
            return self.ready
        try:
            with urllib.request.urlopen(self.health_url, timeout=1) as r:
                self.ready = r.status == 200
        except (urllib.error.URLError, OSError):
            self.ready = False
        return self.ready

    def tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


class Deployment:
    def __init__(self, args, clock=time.monotonic):
        self.args = args
        self.clock = clock  # restart timing (tests inject theirs)
        self.run_dir = Path(args.run_dir)
        self.children: list[Child] = []

    def model_dir(self) -> Path:
        if self.args.model:
            path = Path(self.args.model)
            if not path.exists():
                raise SystemExit(f"disagg up: --model {path}: no such file or directory")
            return path
        try:
            path = pretrained.require_default_model()
        except FileNotFoundError as exc:
            raise SystemExit(f"disagg up: {exc}") from None
        print(f"serving {pretrained.NAME} ({path.stat().st_size / 2**20:.0f} MiB GGUF, {path})", flush=True)
        return path

    def certificates(self, workers: list[str], secrets_dir: Path) -> dict[str, dict[str, str]]:
        """Each child's TLS environment with --peer-identity certificate (none with token)."""
        if self.args.peer_identity != "certificate":
            return {}
        from disagg.worker.cli import local_certificates

        dirs = local_certificates.issue(secrets_dir / "tls", [*workers, "router"])
        tls = {name: {"DISAGG_GRPC_TLS_DIR": str(d.resolve()),
                      "DISAGG_GRPC_TLS_SERVER_NAME": local_certificates.SERVER_NAME} for name, d in dirs.items()}  # fmt: skip
        for name in workers:
            tls[name]["DISAGG_PEER_IDENTITY"] = "certificate"
        return tls

    def plan(self) -> None:
        a = self.args
        if a.prefill < 0 or a.decode < 0 or a.both < 0:
            raise SystemExit("disagg up: --prefill, --decode and --both must be >= 0")
        if a.decode + a.both == 0:
            raise SystemExit("disagg up: at least one --decode or --both worker is needed")
        if shutil.which("redis-server") is None:
            raise SystemExit(
                "disagg up: redis-server not found. Install Debian's package: sudo apt-get install redis-server"
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        model = self.model_dir()
        self.model = model
        redis_port = free_port()
        self.redis_url = f"redis://127.0.0.1:{redis_port}/0"
        secrets_dir = self.run_dir / "secrets"
        token_file = write_private(secrets_dir / "internal-token", new_secret())
        password_file = write_private(secrets_dir / "redis-password", new_secret())
        self.internal_token = token_file.read_text()
        config = write_redis_config(secrets_dir / "redis.conf", redis_port, password_file.read_text())
        redis = Child("redis", redis_command(redis_port, config=config), self.run_dir / "redis.log")
        self.children.append(redis)
        # file paths, not values, in the environment: the values stay in the 0600 files
        secret_env = {"DISAGG_INTERNAL_TOKEN_FILE": str(token_file.resolve()),
                      "DISAGG_REDIS_PASSWORD_FILE": str(password_file.resolve())}  # fmt: skip
        counts = (("prefill", a.prefill), ("decode", a.decode), ("both", a.both))
        workers = [(role, f"{role}-{i}") for role, count in counts for i in range(count)]
        identities = self.certificates([name for _, name in workers], secrets_dir)
        serving, router = serving_args(a), router_args(a)
        engine = EngineArgs.from_cli_args(a, model=str(model))
        ranks = role_ranks(a, engine.tensor_parallel_size)
        if engine.threads is None:  # per rank: every rank of every worker shares this machine
            total = sum(ranks[role] * count for role, count in counts)
            engine.threads = max(1, (os.cpu_count() or 1) // total)
        py = [sys.executable, "-m", "disagg.worker.cli"]
        for role, name in workers:
            port, mport = free_port(), free_port()
            # every process setting named, so that none comes from a DISAGG_* variable up inherited
            process = WorkerProcessArgs.cli_args(
                role=role, worker_id=name, host="127.0.0.1", port=port, metrics_port=mport,
                redis_url=self.redis_url, deployment=DEPLOYMENT,
            )  # fmt: skip
            cmd = py + [
                "worker", *process, *EngineArgs.cli_args(model=str(model)), *serving.to_cli_args(),
                *worker_engine_args(engine, role, name).to_cli_args(),
                *EngineArgs.cli_args(tensor_parallel_size=ranks[role]), *a.worker_arg,
            ]  # fmt: skip
            self.children.append(
                Child(
                    name,
                    cmd,
                    self.run_dir / f"{name}.log",
                    f"http://127.0.0.1:{mport}/health",
                    env={**secret_env, **identities.get(name, {})},
                )  # fmt: skip
            )
        self.router_url = f"http://127.0.0.1:{a.port}"
        cmd = py + [
            "router",
            *RouterProcessArgs.cli_args(host="127.0.0.1", port=a.port, model=str(model), redis_url=self.redis_url,
                                        deployment=DEPLOYMENT),
            *dataclasses.replace(router, block_size=engine.block_size, max_model_len=engine.max_model_len).to_cli_args(),
        ]  # fmt: skip
        self.children.append(
            Child(
                "router",
                cmd,
                self.run_dir / "router.log",
                f"{self.router_url}/health",
                env={**secret_env, **identities.get("router", {})},
            )  # fmt: skip
        )

    def start(self) -> None:
        started = time.monotonic()
        redis = self.children[0]
        self.launch(redis, first=True)
        _wait_port(int(self.redis_url.rsplit(":", 1)[1].split("/")[0]), 10)
        redis.ready = True
        for c in self.children[1:]:
            self.launch(c, first=True)
        print(
            f"started redis, {len(self.children) - 2} workers and the router; logs in {self.run_dir}/",
            flush=True,
        )
        deadline = started + self.args.timeout
        reported: set[str] = set()
        while True:
            for c in self.children:
                if not c.alive():
                    raise RuntimeError(
                        f"{c.name} exited (code {c.proc.returncode}); last log lines:\n{c.tail()}"
                    )
                if c.name not in reported and c.check_ready():
                    reported.add(c.name)
                    print(f"  {c.name:<12} ready after {time.monotonic() - started:5.1f}s", flush=True)
            if all(c.ready for c in self.children) and self._router_sees_all():
                return
            if time.monotonic() > deadline:
                waiting = ", ".join(c.name for c in self.children if not c.ready)
                raise RuntimeError(f"not ready after {self.args.timeout:.0f}s: {waiting}")
            time.sleep(0.1)

    def _router_sees_all(self) -> bool:
        """The router routes only to workers it has polled: wait until it knows every one."""
        names = {c.name for c in self.children if c.name not in ("redis", "router")}
        request = urllib.request.Request(
            f"{self.router_url}/internal/workers", headers={"Authorization": f"Bearer {self.internal_token}"}
        )
        try:
            with urllib.request.urlopen(request, timeout=1) as r:
                body = json.load(r)
        except (urllib.error.URLError, OSError, ValueError):
            return False
        return names <= {w["id"] for w in body.get("workers", []) if w.get("ready")}

    def launch(self, c: Child, first: bool = False) -> None:
        c.start()
        c.restart_at = None
        c.policy.started(self.clock(), restart=not first)

    def restart_dead(self) -> None:
        """Start again every child that exited (as a pod would be restarted), each when its
        crash-loop backoff allows; the others keep running whatever happens to this one."""
        now = self.clock()
        for c in self.children:
            if c.proc is None or c.alive():
                continue
            if c.restart_at is None:
                c.restart_at = c.policy.died(now)
                c.ready = False
                wait = c.restart_at - now
                print(f"disagg up: {c.name} exited (code {c.proc.returncode}); restarting "
                      f"{f'in {wait:.0f}s' if wait > 0 else 'now'} (death {c.policy.failures} in a row); "
                      f"last log lines:\n{c.tail()}", file=sys.stderr, flush=True)  # fmt: skip
            if now >= c.restart_at:
                self.launch(c)

    def stop(self) -> None:
        for c in reversed(self.children):  # router first, Redis last
            if c.alive():
                c.proc.terminate()
        deadline = time.monotonic() + 15
        for c in reversed(self.children):
            if c.proc is None:
                continue
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()


def _wait_port(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port} after {timeout:.0f}s")


def demo(base_url: str, model: str) -> None:
    """Stream one chat completion and show who served it and how fast."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": DEMO_MESSAGE}],
        "max_tokens": 48,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(
        f"{base_url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    print(f"\n$ POST {base_url}/v1/chat/completions (stream)\n", flush=True)
    t0 = time.monotonic()
    first = None
    usage = None
    with urllib.request.urlopen(req, timeout=120) as resp:
        decode = resp.headers.get("X-Disagg-Decode-Worker", "?")
        prefill = resp.headers.get("X-Disagg-Prefill-Worker") or "(prefilled on the decode worker)"
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                text = choice.get("delta", {}).get("content") or ""
                if text and first is None:
                    first = time.monotonic()
                sys.stdout.write(text)
                sys.stdout.flush()
    end = time.monotonic()
    n = usage["completion_tokens"] if usage else 0
    ttft = (first or end) - t0
    rate = (n - 1) / (end - first) if first and n > 1 and end > first else 0.0
    print("\n")
    print(f"prefill worker: {prefill}")
    print(f"decode worker:  {decode}")
    if usage:
        print(f"prompt tokens:  {usage['prompt_tokens']}   completion tokens: {n}")
    print(f"TTFT: {ttft * 1000:.0f} ms   decode: {rate:.1f} tokens/s", flush=True)


def run(args) -> int:
    dep = Deployment(args)
    dep.plan()

    def on_signal(signum, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        try:
            dep.start()
        except RuntimeError as e:
            print(f"disagg up: {e}", file=sys.stderr)
            return 1
        model_name = served_name(dep.model)
        print(f"\nready: OpenAI-compatible endpoint {dep.router_url}/v1 (model {model_name!r})", flush=True)
        if args.demo:
            demo(dep.router_url, model_name)
            return 0
        print(
            f"try:\n  curl -N {dep.router_url}/v1/chat/completions -H 'Content-Type: application/json' -d "
            f'\'{{"model": "{model_name}", "stream": true, "messages": [{{"role": "user", "content": "Hello"}}]}}\'\n'
            "Ctrl-C stops everything.",
            flush=True,
        )
        while True:  # until Ctrl-C or SIGTERM: a child's deaths never stop the deployment
            dep.restart_dead()
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("\nstopping ...", flush=True)
        return 0
    finally:
        dep.stop()
