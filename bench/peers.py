"""This engine against llama.cpp on the same weights, on this CPU: batch-1 decode and prompt processing.

    python bench/peers.py --llama-bench PATH/llama-bench          # each dtype pair, two rounds
    python bench/peers.py --ours-only                             # this engine's figures alone
    python bench/peers.py --pairs int8 --rounds 1 --prompt 512    # one pair
    python bench/peers.py --llama-bench B --llama-server S --serve 16   # and served throughput

Both engines load the same GGUF-derived weights: the installed SmolLM2-135M-Instruct GGUF (Q4_1)
dequantized once and written as F32, BF16 and Q8_0 GGUF files (`gguf` package, into
`--out`, reused when present). The pairs: float32 from the F32 file against llama.cpp on it,
bf16 (`--dtype bfloat16`) from the BF16 file, int8 (`--quantization int8`: per-channel int8
requantized from the file's 32-weight Q8_0 blocks) from the Q8_0 file against llama.cpp's Q8_0.

Measured the way `llama-bench` measures (`-p 512 -n 64`: prompt processing is one 512-token
prompt from an empty cache; decode is 64 batch-1 steps from an empty cache, no sampling), with
the same thread count (`--threads`, default all cores), and the two engines alternate within
each round so that both see the same machine. Every figure is printed with the 1-minute load
average read right after it: on a shared machine only figures of similar load compare. Ratios
are ours / llama.cpp (above 1: this engine is faster).

With `--serve N`, each pair is also served: llama-server (`--parallel N`, continuous batching) and
`disagg up` with one `both` worker (`--max-num-seqs N`), one after the other on the same file; one
client sends N different prompts at once (greedy, `ignore_eos`, `--serve-gen` new tokens each) and
the generated tokens per second are compared. Each server is warmed first with N other prompts
(no shared prefix: neither answers the measured ones from its prompt cache).

Decode is also printed over its floor (`/floor`): its time per token over the time a copy of
the weight bytes one step reads takes (read + written, `memory_floor.CopyProbe` sampled just
before each run; below 1 is possible, since decode only reads them). Prompt processing is also
printed as GFLOP/s (the products of a prompt token: the layers'
matmuls and causal attention over the prompt, 2 FLOPs a multiply-accumulate) and as a share of
the float32 FMA peak of the threads used (`simd_throughput.py`'s probe on one core, times the
threads): a float32 pair cannot pass that peak, whatever the engine.

The kernels' line names the CPU and the instruction sets as this process may execute them (CPUID
in the process; AMX only where granted by the kernel and probed), and those the kernels were built
for: `DISAGG_CPU_NATIVE_ARCH=x86-64-v3` measures the AVX2 code paths (no AVX-512, no AMX) on any
newer CPU, and the FMA peak is then that of 256-bit vectors.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from disagg.kernels import cpu_native, native_build
from disagg.worker.cli.flags import Up
from disagg.worker.engine.args import EngineArgs
from disagg.worker.model.forward_batch import ForwardBatch
from disagg.worker.model.loader import load_model
from disagg.worker.model.pretrained import require_default_model
from disagg.worker.model.quantization import decode_weight_bytes

ROOT = Path(__file__).resolve().parent.parent

import memory_floor  # noqa: E402
from machine import cpu_name, kernel_report  # noqa: E402
from simd_throughput import fp32_fma_peak_gflops  # noqa: E402

BLOCK = 16


@dataclass(frozen=True)
class Pair:
    name: str  # this engine's setting
    gguf_type: str  # the file both load (llama.cpp's name of its tensor type)
    dtype: str
    quantization: str


PAIRS = {
    "float32": Pair("float32", "F32", "float32", "none"),
    "bf16": Pair("bf16", "BF16", "bfloat16", "none"),
    "int8": Pair("int8", "Q8_0", "float32", "int8"),
}


# ---- the weights ------------------------------------------------------------------------------
def convert(src: Path, dst: Path, kind: str) -> Path:
    """`src` (any GGUF the `gguf` package dequantizes) rewritten with every 2-D weight as `kind`
    (F32, BF16 or Q8_0); norms and other 1-D tensors stay F32, as llama.cpp's converter writes
    them. Metadata (config, tokenizer, chat template) is copied as it is."""
    import gguf
    from gguf.quants import dequantize, quantize

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst) + ".tmp", arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    qtype = {"F32": gguf.GGMLQuantizationType.F32, "BF16": gguf.GGMLQuantizationType.BF16,
             "Q8_0": gguf.GGMLQuantizationType.Q8_0}[kind]  # fmt: skip
    writer.add_file_type({"F32": gguf.LlamaFileType.ALL_F32, "BF16": gguf.LlamaFileType.MOSTLY_BF16,
                          "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[kind])  # fmt: skip
    for t in reader.tensors:
        values = dequantize(t.data, t.tensor_type).astype(np.float32)  # shape in numpy order
        to = qtype if values.ndim == 2 and values.shape[-1] % 32 == 0 else gguf.GGMLQuantizationType.F32
        data = values if to == gguf.GGMLQuantizationType.F32 else quantize(values, to)
        writer.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=to)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(str(dst) + ".tmp", dst)
    return dst


def weights_for(src: Path, out: Path, kind: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    stem = src.name.removesuffix(".gguf").rsplit(".", 1)[0]
    dst = out / f"{stem}.{kind}.gguf"
    if not dst.exists():
        print(f"writing {dst} from {src.name}", flush=True)
        convert(src, dst, kind)
    return dst


# ---- this engine ------------------------------------------------------------------------------
def _batch(ids: list[int], start: int, logits_last: bool = True) -> ForwardBatch:
    """One sequence's next `len(ids)` tokens from position `start`, blocks laid out in order."""
    n, end = len(ids), start + len(ids)
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.arange(start, end, dtype=torch.int64),
        slot_mapping=torch.arange(start, end, dtype=torch.int64),
        seq_lens=torch.tensor([end], dtype=torch.int32),
        block_tables=torch.arange(math.ceil(end / BLOCK), dtype=torch.int32)[None],
        logits_indices=torch.tensor([n - 1], dtype=torch.int64),
        is_prefill=n > 1 or start == 0,
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32) if (n > 1 or start == 0) else None,
    )


class Ours:
    def __init__(self, path: Path, pair: Pair, threads: int, prompt: int, gen: int):
        torch.set_num_threads(threads)
        self.model, config = load_model(path, dtype=pair.dtype, quantization_setting=pair.quantization)
        self.config = config
        self.prompt, self.gen = prompt, gen
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(10, config.vocab_size, (prompt,), generator=g).tolist()
        self.cache = self.model.allocate_kv_cache(math.ceil((prompt + gen) / BLOCK) + 1, BLOCK)

    @torch.inference_mode()
    def prompt_tps(self) -> float:
        start = time.perf_counter()
        self.model.forward(_batch(self.ids, 0), self.cache)
        return self.prompt / (time.perf_counter() - start)

    @torch.inference_mode()
    def decode_tps(self) -> float:
        """`gen` batch-1 steps from an empty cache (the first token a one-token prompt, as llama-bench's
        tg counts every token it evaluates)."""
        token = self.ids[0]
        start = time.perf_counter()
        for pos in range(self.gen):
            logits = self.model.forward(_batch([token], pos), self.cache)
            token = int(logits[-1].argmax())
        return self.gen / (time.perf_counter() - start)


def ours_figures(
    ours: Ours, reps: int, probe: memory_floor.CopyProbe
) -> tuple[float, float, float, float, float]:
    """Median prompt tokens/s, the load after it, median decode tokens/s, the load after it, and
    the median of decode's time per token over the copy floor of the weights it reads (their
    bytes read + written at the bandwidth `probe` samples just before each decode run)."""
    ours.prompt_tps(), ours.decode_tps()  # warm: kernels built, weights paged in
    pp = statistics.median(ours.prompt_tps() for _ in range(reps))
    pp_load = load()
    weight_bytes = decode_weight_bytes(ours.model.weights)
    tgs, over_floor = [], []
    for _ in range(reps):
        floor = weight_bytes * probe.seconds_per_byte()
        tgs.append(ours.decode_tps())
        over_floor.append(1 / tgs[-1] / floor)
    return pp, pp_load, statistics.median(tgs), load(), statistics.median(over_floor)


def prompt_token_flops(config, prompt: int) -> float:
    """FLOPs of one token of a `prompt`-token prompt processed at once: every layer's matmuls, and
    attention's two products over its causal context (the prompt's mean: (prompt + 1) / 2)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    matmul = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * inter
    attention = 2 * heads * head_dim * (prompt + 1) / 2
    return 2.0 * config.num_hidden_layers * (matmul + attention)


# ---- llama.cpp --------------------------------------------------------------------------------
def llama_bench(
    binary: Path, path: Path, threads: int, prompt: int, gen: int, reps: int
) -> tuple[float, float]:
    """llama-bench's mean tokens/s for pp`prompt` and tg`gen` (CPU only, `reps` repetitions)."""
    cmd = [str(binary), "-m", str(path), "-t", str(threads), "-p", str(prompt), "-n", str(gen),
           "-r", str(reps), "-ngl", "0", "-o", "json"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rows = json.loads(out)
    pp = next(r["avg_ts"] for r in rows if r["n_prompt"] == prompt and r["n_gen"] == 0)
    tg = next(r["avg_ts"] for r in rows if r["n_gen"] == gen and r["n_prompt"] == 0)
    return pp, tg


def load() -> float:
    return os.getloadavg()[0]


# ---- served throughput ------------------------------------------------------------------------
def serve_prompts(streams: int) -> list[str]:
    """`streams` different prompts (distinct texts: no shared prefix for either engine to reuse)."""
    words = (ROOT / "bench" / "data" / "perplexity.txt").read_text().split()
    n = min(60, len(words) // streams)
    if n < 8:
        raise ValueError(f"{streams} streams: the text has too few words for distinct prompts")
    return [" ".join(words[i * n : (i + 1) * n]) for i in range(streams)]


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not ready after {timeout:.0f} s")


def _stop(proc: subprocess.Popen) -> None:
    import signal

    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def served_tps(base: str, model: str, prompts: list[str], gen: int) -> float:
    """Generated tokens per second with every prompt sent at once (one client, greedy,
    `ignore_eos`, `gen` new tokens each), counted from the responses' usage."""
    import asyncio

    import httpx

    async def run() -> float:
        async with httpx.AsyncClient(timeout=600) as client:

            async def one(prompt: str) -> int:
                body = {
                    "model": model,
                    "prompt": prompt,
                    "max_tokens": gen,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                r = await client.post(f"{base}/v1/completions", json=body)
                if r.status_code != 200:
                    raise RuntimeError(f"{base}: {r.status_code} {r.text[:300]}")
                return int(r.json()["usage"]["completion_tokens"])

            start = time.perf_counter()
            tokens = await asyncio.gather(*(one(p) for p in prompts))
            return sum(tokens) / (time.perf_counter() - start)

    return asyncio.run(run())


def serve_pair(args, pair: Pair, path: Path, server: Path) -> tuple[float, float, float, float]:
    """(ours tok/s, load, llama.cpp tok/s, load) served with `args.serve` concurrent streams."""
    prompts = serve_prompts(args.serve)
    # the warm-up runs every stream once on prompts that share no prefix with the measured ones:
    # neither engine may answer the measured prompts from its prompt cache
    warm = [f"Warm-up {i}. {p}" for i, p in enumerate(prompts)]
    ctx = args.serve * (256 + args.serve_gen)
    log_dir = args.out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    cmd = [str(server), "-m", str(path), "-t", str(args.threads), "--parallel", str(args.serve), "-c", str(ctx),
           "--cont-batching", "--port", str(args.port + 1), "--no-webui"]  # fmt: skip
    with open(log_dir / "llama-server.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_ready(f"http://127.0.0.1:{args.port + 1}/health", proc, 300)
        served_tps(f"http://127.0.0.1:{args.port + 1}", "x", warm, 4)
        theirs = served_tps(f"http://127.0.0.1:{args.port + 1}", "x", prompts, args.serve_gen)
        theirs_load = load()
    finally:
        _stop(proc)
    disagg = Path(sys.executable).with_name("disagg")
    engine = EngineArgs.cli_args(dtype=pair.dtype, quantization=pair.quantization, threads=args.threads,
                                 max_num_seqs=args.serve)  # fmt: skip
    cmd = [str(disagg), "up", Up.MODEL, str(path), Up.PREFILL, "0", Up.DECODE, "0", Up.BOTH, "1", *engine,
           Up.PORT, str(args.port), Up.RUN_DIR, str(args.out / "run")]  # fmt: skip
    with open(log_dir / "disagg-up.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_ready(f"http://127.0.0.1:{args.port}/health", proc, 600)
        name = path.name.removesuffix(".gguf")
        served_tps(f"http://127.0.0.1:{args.port}", name, warm, 4)
        ours = served_tps(f"http://127.0.0.1:{args.port}", name, prompts, args.serve_gen)
        ours_load = load()
    finally:
        _stop(proc)
    return ours, ours_load, theirs, theirs_load


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-bench", type=Path, help="llama.cpp's llama-bench binary")
    p.add_argument("--ours-only", action="store_true", help="this engine's figures, no llama.cpp")
    p.add_argument("--model", type=Path, help="source GGUF (default: the installed SmolLM2)")
    p.add_argument(
        "--out", type=Path, default=ROOT / ".models" / "peers", help="where the converted files go"
    )
    p.add_argument("--pairs", nargs="+", default=list(PAIRS), choices=list(PAIRS))
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--reps", type=int, default=3, help="repetitions per figure (median; llama-bench: mean)")
    p.add_argument("--rounds", type=int, default=2, help="the whole table this many times")
    p.add_argument(
        "--llama-server", type=Path, help="llama.cpp's llama-server: with --serve, served throughput"
    )
    p.add_argument(
        "--serve", type=int, default=0, help="concurrent streams for served throughput (0: not measured)"
    )
    p.add_argument("--serve-gen", type=int, default=64, help="new tokens per served stream")
    p.add_argument(
        "--port", type=int, default=8790, help="disagg up's router port (llama-server: the next one)"
    )
    args = p.parse_args(argv)
    if not args.ours_only and args.llama_bench is None:
        p.error("--llama-bench PATH (or --ours-only)")
    if args.serve and args.llama_server is None:
        p.error("--serve needs --llama-server PATH")
    src = args.model or require_default_model()
    files = {name: weights_for(src, args.out, PAIRS[name].gguf_type) for name in args.pairs}
    print(f"cpu: {cpu_name()}, {os.cpu_count()} cores, {args.threads} threads")
    print(f"kernels: {kernel_report()}")
    peak, probe = fp32_fma_peak_gflops(
        args.threads, cpu_native.gemm_vector_floats() if native_build.available() else 0
    )
    print(f"float32 FMA peak of {args.threads} threads: {peak:.0f} GFLOP/s ({probe}, one core x {args.threads}; "
          f"load {load():.2f})")  # fmt: skip
    print(
        f"pp{args.prompt}: one {args.prompt}-token prompt; tg{args.gen}: {args.gen} batch-1 decode steps; tok/s; "
        "pp GFLOP/s and its share of that peak"
    )

    probe = memory_floor.CopyProbe()

    def compute(tps: float, flops: float) -> str:
        return f"{tps * flops / 1e9:>9.0f}{100 * tps * flops / 1e9 / peak:>6.0f}%"

    for rnd in range(1, args.rounds + 1):
        print(f"\nround {rnd}")
        head = (
            f"{'pair':<14}{'engine':<10}{'pp tok/s':>10}{'load':>7}{'GFLOP/s':>9}{'peak':>7}{'tg tok/s':>10}"
            f"{'load':>7}{'/floor':>7}"
        )
        print(head + ("" if args.ours_only else f"{'pp ratio':>10}{'tg ratio':>10}"))
        for name in args.pairs:
            pair, path = PAIRS[name], files[name]
            ours = Ours(path, pair, args.threads, args.prompt, args.gen)
            pp, pp_load, tg, tg_load, over_floor = ours_figures(ours, args.reps, probe)
            flops = prompt_token_flops(ours.config, args.prompt)
            del ours
            label = f"{name}/{pair.gguf_type}"
            print(
                f"{label:<14}{'disagg':<10}{pp:>10.1f}{pp_load:>7.2f}{compute(pp, flops)}{tg:>10.1f}{tg_load:>7.2f}"
                f"{over_floor:>6.2f}x",
                flush=True,
            )
            if args.ours_only:
                continue
            # llama-bench runs pp then tg in one process: one load figure after both
            lpp, ltg = llama_bench(args.llama_bench, path, args.threads, args.prompt, args.gen, args.reps)
            after = load()
            print(
                f"{'':<14}{'llama.cpp':<10}{lpp:>10.1f}{after:>7.2f}{compute(lpp, flops)}{ltg:>10.1f}{after:>7.2f}"
                f"{'':>7}{pp / lpp:>10.2f}{tg / ltg:>10.2f}",
                flush=True,
            )
            if args.serve:
                ours_s, ours_l, theirs_s, theirs_l = serve_pair(args, pair, path, args.llama_server)
                print(
                    f"{'':<14}served, {args.serve} streams x {args.serve_gen} tokens: disagg {ours_s:.1f} tok/s "
                    f"(load {ours_l:.2f}), llama.cpp {theirs_s:.1f} tok/s (load {theirs_l:.2f}), "
                    f"ratio {ours_s / theirs_s:.2f}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
