"""Step 5: prefill and decode as two worker processes on one GPU, behind the router.

The decode worker sends every prompt of 16 or more uncached tokens to the prefill worker
(`--prefill-placement threshold`), whose KV lands GPU to GPU: over NIXL (UCX, CUDA IPC between
processes on one device) when NIXL is installed, else over the gRPC transport. The streamed
answers must equal the same engine's colocated greedy output; the KV sender's bytes over its send
time is set against a device-to-device copy.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import models
import torch
from common import ROOT, Context, StepResult, measure_ceilings

sys.path.insert(0, str(ROOT / "tests"))


def transport() -> str:
    try:
        import nixl._api  # noqa: F401
    except ImportError:
        return "grpc"
    return "nixl"


def raw_nixl(ctx: Context, r: StepResult) -> None:
    """NIXL alone between two processes' GPU buffers: the transfer's ceiling, and the UCX
    transport it took (from UCX's protocol report)."""
    n = 256 << 20
    work = Path(tempfile.mkdtemp(prefix="disagg-gpu-nixl-"))
    script = str(Path(__file__).resolve().parent / "nixl_pair.py")
    env = {**os.environ, "UCX_PROTO_INFO": "y"}
    try:
        target = subprocess.Popen([sys.executable, script, "target", str(work), str(n)], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        done = subprocess.run([sys.executable, script, "initiator", str(work), str(n)], env=env,
                              capture_output=True, text=True, timeout=90)  # fmt: skip
        target.wait(30)
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        if done.returncode or not lines:
            r.check("raw NIXL GPU-to-GPU write", False, (done.stderr or done.stdout)[-600:])
            return
        res = json.loads(lines[-1])
        lanes = sorted(
            set(re.findall(r"(cuda_ipc|cuda_copy|tcp|rc_mlx5|cma|posix|sysv)/", done.stdout + done.stderr))
        )
        r.check(
            "raw NIXL GPU-to-GPU write delivered the bytes", res["equal"], f"{n >> 20} MiB, UCX lanes {lanes}"
        )
        copy = measure_ceilings(ctx)["copy_bytes_per_s"] / 2
        rate = res["bytes"] / res["seconds"]
        r.figure(
            "raw NIXL write, 256 MiB VRAM to VRAM",
            rate / 1e9,
            "GB/s",
            f"{rate / copy:.2f}x a device copy; lanes {lanes}",
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(ctx: Context) -> StepResult:
    r = StepResult()
    kind = transport()
    r.note(f"KV transport: {kind}")
    if kind == "nixl" and ctx.device.startswith("cuda"):
        raw_nixl(ctx, r)
    if ctx.full:
        pd_matches(ctx, r, kind, "small", [40, 300, 1000, 2000])
        # a prefill the host enqueues faster than the device runs it: each layer's sends must
        # wait for its K/V, not just for the host to have queued it
        pd_matches(ctx, r, kind, "llama3-8b-4l", [2000, 3000])
    else:
        pd_matches(ctx, r, kind, "tiny-trained", [20, 40])
    return r


def pd_matches(ctx: Context, r: StepResult, kind: str, model: str, lengths: list[int]) -> None:
    from worker.cluster import Cluster, complete, threshold_placement

    from disagg.worker import LLM, SamplingParams
    from disagg.worker.engine.args import EngineArgs
    from disagg.worker.model.config import ModelConfig

    path = models.ensure(model, ctx.work)
    dtype = "bfloat16" if ctx.full else "float32"
    g = torch.Generator().manual_seed(3)
    vocab = ModelConfig.from_pretrained(path).vocab_size
    prompts = [torch.randint(10, vocab, (n,), generator=g).tolist() for n in lengths]
    new = 24
    llm = LLM(str(path), dtype=dtype, device=ctx.device)
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    colocated = [o.outputs[0].text for o in (llm.generate([p], params)[0] for p in prompts)]
    del llm
    if ctx.device.startswith("cuda"):
        torch.cuda.empty_cache()
    tmp = Path(tempfile.mkdtemp(prefix="disagg-gpu-pd-"))
    worker_args = EngineArgs.cli_args(dtype=dtype, device=ctx.device)
    cluster = Cluster(
        path, tmp, redis_url=None, prefill=1, decode=1, kv_transfer=kind, worker_args=worker_args,
        role_args={"decode": threshold_placement(16)},
    )  # fmt: skip
    try:
        cluster.start()
        same = 0
        for prompt, want in zip(prompts, colocated, strict=True):
            body = {"model": cluster.model_name, "prompt": prompt, "max_tokens": new, "temperature": 0,
                    "ignore_eos": True}  # fmt: skip
            resp = complete(cluster.url, body)
            ok = resp.status_code == 200
            got = resp.json()["choices"][0]["text"] if ok else f"HTTP {resp.status_code}: {resp.text[:200]}"
            same += got == want
            if got != want:
                r.note(f"{model}, {len(prompt)}-token prompt: P/D {got[:60]!r} vs colocated {want[:60]!r}")
        r.check(f"{model}: P/D output = colocated ({kind})", same == len(prompts),
                f"{same}/{len(prompts)} prompts identical")  # fmt: skip
        remote = cluster.metric("decode-0", "disagg_remote_prefill_commits_total")
        r.check(f"{model}: every prompt prefilled on the prefill worker", remote >= len(prompts),
                f"{remote:.0f} remote prefills")  # fmt: skip
        sent = cluster.metric("prefill-0", "disagg_kv_transfer_bytes_total", direction="send")
        seconds = cluster.metric("prefill-0", "disagg_kv_transfer_seconds_sum")
        r.check(f"{model}: KV bytes moved", sent > 0, f"{sent / 2**20:.1f} MiB sent")
        if sent and seconds:
            copy = measure_ceilings(ctx)["copy_bytes_per_s"] / 2  # bytes moved (not read + written)
            rate = sent / seconds
            sends = cluster.metric("prefill-0", "disagg_kv_transfer_seconds_count")
            r.figure(f"{model}: KV send rate ({kind})", rate / 1e9, "GB/s",
                     f"{sent / 2**20:.1f} MiB in {sends:.0f} sends over {seconds * 1e3:.1f} ms, posting to completion seen")  # fmt: skip
            r.figure(
                f"{model}: KV send rate / device copy", rate / copy, "x", f"copy moves {copy / 1e9:.0f} GB/s"
            )
    except Exception:
        for p in cluster.procs():
            if p.log.exists():
                r.note(f"{p.name} log tail:\n{p.tail(15)}")
        raise
    finally:
        cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)
