"""Pulling a prefix another worker holds against recomputing it, at several prefix lengths.

Three workers of one deployment, one torch thread each (pinned to their own cores where there
are enough): `holder` (colocated) has computed a conversation's history of L tokens; `puller` (a
decode worker that sends every prompt to its prefill target) gets the history plus a 16-token new
turn with `holder` as its target, which computes the 16 tokens and writes all L+16 tokens' KV
into the puller's cache over NIXL; the same puller computes another history of the same length
itself (no target). Printed per L: the puller's TTFT both ways (median of `--trials`, each on a
fresh history, so no cache helps the recompute), their ratio, and what a colocated worker's
placement decided when offered the holder for the same prompt (the priced choice, measured rates
and transfer cost). The break-even is the shortest L from which the pull is faster; the placement
should pull from there on.

    python bench/prefix_pull.py --lengths 32,128,512,1024,2048
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch
from bench_model import ensure_model, log  # noqa: E402
from machine import cpu_name  # noqa: E402

from disagg.proto import worker_pb2 as pb  # noqa: E402
from disagg.proto import worker_pb2_grpc as pb_grpc  # noqa: E402
from disagg.worker.cli.ports import free_port  # noqa: E402
from disagg.worker.engine.args import EngineArgs  # noqa: E402
from disagg.worker.serving.args import ServingArgs  # noqa: E402
from disagg.worker.serving.auth import InternalAuth  # noqa: E402
from disagg.worker.serving.process_args import WorkerProcessArgs  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SUFFIX = 16


class Worker:
    def __init__(
        self, name: str, role: str, model: Path, run_dir: Path, token: str, core: int | None, extra=()
    ):
        self.name, self.port, self.mport = name, free_port(), free_port()
        process = WorkerProcessArgs.cli_args(role=role, worker_id=name, host="127.0.0.1", port=self.port,
                                             metrics_port=self.mport, deployment="pull-bench")  # fmt: skip
        cmd = [sys.executable, "-m", "disagg.worker.cli", "worker", *process,
               *EngineArgs.cli_args(model=str(model), threads=1), *extra]  # fmt: skip
        if core is not None and shutil.which("taskset"):
            cmd = ["taskset", "-c", str(core), *cmd]
        self.log = open(run_dir / f"{name}.log", "w")  # noqa: SIM115 (closed in stop)
        env = {**os.environ, "DISAGG_INTERNAL_TOKEN": token, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.address = f"127.0.0.1:{self.port}"
        self.stub = InternalAuth(token).wrap(pb_grpc.WorkerStub(InternalAuth(None).channel(self.address)))

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"{self.name} exited; see its log {self.log.name}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.mport}/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        sys.exit(f"{self.name} not ready after {timeout:.0f} s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def generate(w: Worker, prompt: list[int], target: pb.PrefillTarget | None = None) -> tuple[float, bool]:
    """(seconds to the first token, whether the prompt was prefilled elsewhere)."""
    req = pb.GenerateRequest(request_id=secrets.token_hex(6), prompt_token_ids=prompt,
                             params=pb.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                             prefill_targets=[target] if target is not None else [])  # fmt: skip
    started = time.perf_counter()
    stream = w.stub.Generate(req, timeout=120)
    first = next(stream)
    ttft = time.perf_counter() - started
    rest = list(stream)
    for m in (first, *rest):
        if m.error.code:
            sys.exit(f"{w.name}: {m.error.code}: {m.error.message}")
    return ttft, first.served_by.disaggregated


def target(holder: Worker, held: int) -> pb.PrefillTarget:
    load = holder.stub.Load(pb.LoadRequest(), timeout=5)
    return pb.PrefillTarget(worker_id=holder.name, address=holder.address, cached_tokens=held,
                            queued_prefill_tokens=load.queued_prefill_tokens,
                            prefill_tokens_per_s=load.prefill_tokens_per_s)  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", type=Path, default=ROOT / ".models" / "small", help="model dir (made if missing)"
    )
    p.add_argument("--preset", default="small")
    p.add_argument("--lengths", default="32,128,512,1024,2048", help="history lengths L (tokens)")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    model = ensure_model(args.model, args.preset)
    lengths = [int(x) for x in args.lengths.split(",")]
    token = secrets.token_urlsafe(24)
    run_dir = Path(tempfile.mkdtemp(prefix="prefix-pull-"))
    cores = os.cpu_count() or 1
    workers = [
        Worker("holder", "both", model, run_dir, token, 0 % cores),
        Worker(
            "puller",
            "decode",
            model,
            run_dir,
            token,
            1 % cores,
            ServingArgs.cli_args(prefill_placement="threshold", disagg_threshold=1),
        ),  # fmt: skip
        Worker("priced", "both", model, run_dir, token, 1 % cores),
    ]
    holder, puller, priced = workers
    try:
        for w in workers:
            w.wait_ready()
        g = torch.Generator().manual_seed(args.seed)
        vocab = 1000

        def tokens(n: int) -> list[int]:
            return torch.randint(10, vocab, (n,), generator=g).tolist()

        # a served prompt each: the transfer cost is measured, and the priced worker's own rate is
        # fresh (an idle worker remeasures itself before trusting a warm-up rate)
        generate(puller, tokens(256), target(holder, 0))
        generate(puller, tokens(256))
        generate(priced, tokens(256))
        rows = []
        for n in lengths:
            pulled, local, choices = [], [], []
            for _ in range(args.trials):
                history = tokens(n)
                generate(holder, history + tokens(1))  # the holder computes and caches it
                ttft, remote = generate(puller, history + tokens(SUFFIX), target(holder, n))
                assert remote, "the puller prefilled locally"
                pulled.append(ttft)
                local.append(generate(puller, tokens(n) + tokens(SUFFIX))[0])
                choices.append(generate(priced, history + tokens(SUFFIX), target(holder, n))[1])
            rows.append((n, statistics.median(pulled), statistics.median(local), sum(choices)))
            log(f"  L={n}: pull {1000 * rows[-1][1]:.1f} ms, recompute {1000 * rows[-1][2]:.1f} ms")
    finally:
        for w in workers:
            w.stop()
    load = os.getloadavg()[0]
    print(
        f"model {model.name}, one thread per worker, {cores} cores ({cpu_name()}), load {load:.1f}; "
        f"{args.trials} trials per length"
    )
    print(
        f"{'held L':>8}{'pull TTFT ms':>14}{'recompute ms':>14}{'pull/recompute':>16}{'placement pulled':>18}"
    )
    for n, pull, rec, chose in rows:
        print(f"{n:>8}{1000 * pull:>14.1f}{1000 * rec:>14.1f}{pull / rec:>15.2f}x{chose:>12}/{args.trials}")
    faster = [n for n, pull, rec, _ in rows if pull < rec]
    print(
        f"break-even: the pull is faster from L = {faster[0]} on" if faster else "the pull was never faster"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
