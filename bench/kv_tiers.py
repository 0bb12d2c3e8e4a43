"""Multi-turn chat whose KV working set is several times a worker's cache: the KV tiers on and off.

Every conversation opens with one shared system prompt and grows by a user message and the
model's answer per turn; turn t's prompt is the system prompt and the whole history so far. The
conversations take turns in waves of `--batch` concurrent requests, so by the time a conversation
comes back its history has long been evicted from a cache sized `1 / --working-set` of the
workload's distinct tokens. Tiers off, the history is recomputed; on, it comes back from the host
tier (`--host-pools` caches' worth) or the disk tier below it.

One and two workers (engines in this process, each with the same cache; a turn goes to the
worker holding the longest prefix of its prompt, in its cache or tiers, as the router's prefix
index does; each worker's share of a wave runs alone, as on its own machine). Printed per layout:
TTFT p50/p99 (from the wave's start to a request's first token), prompt tokens computed, tokens
restored from the tiers, and ratios against tiers off; and TTFT p50 by turn in a PNG beside the
table.

    python bench/kv_tiers.py                      # the small preset, 32 conversations x 8 turns
    python bench/kv_tiers.py --conversations 8 --turns 4 --system-tokens 256   # a quick look
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from bench_model import ensure_model, log  # noqa: E402
from machine import cpu_name  # noqa: E402

from disagg.worker.engine.args import EngineArgs  # noqa: E402
from disagg.worker.engine.llm_engine import LLMEngine  # noqa: E402
from disagg.worker.engine.sampling_params import SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Turn:
    conversation: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ttft: float


@dataclass
class Layout:
    name: str
    turns: list[Turn] = field(default_factory=list)
    restored_tokens: int = 0

    @property
    def computed(self) -> int:
        return sum(t.prompt_tokens - t.cached_tokens for t in self.turns)

    def ttft(self, p: float) -> float:
        xs = sorted(t.ttft for t in self.turns)
        k = (len(xs) - 1) * p / 100
        lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)

    def ttft_by_turn(self) -> dict[int, float]:
        by: dict[int, list[float]] = {}
        for t in self.turns:
            by.setdefault(t.turn, []).append(t.ttft)
        return {k: statistics.median(v) for k, v in sorted(by.items())}


def random_tokens(g: torch.Generator, n: int, vocab: int) -> list[int]:
    return torch.randint(10, vocab, (n,), generator=g).tolist()


def run_layout(
    args, model: Path, workers: int, tiers: bool, vocab: int, pool_blocks: int, block_bytes: int
) -> Layout:
    name = f"{workers} worker{'s' if workers > 1 else ''}, tiers {'on' if tiers else 'off'}"
    tmp = tempfile.TemporaryDirectory(prefix="kv-tiers-bench-")
    settings = dict(block_size=args.block_size, num_gpu_blocks=pool_blocks, max_num_batched_tokens=2048,
                    load_tokenizer=False, dtype=args.dtype)  # fmt: skip
    engines = []
    for w in range(workers):
        extra = {}
        if tiers:
            extra = dict(kv_host_cache_memory=int(args.host_pools * pool_blocks * block_bytes),
                         kv_disk_cache_dir=f"{tmp.name}/w{w}", kv_disk_cache_size=args.disk_gib << 30)  # fmt: skip
        engines.append(LLMEngine(model, **settings, **extra))
    g = torch.Generator().manual_seed(args.seed)
    system = random_tokens(g, args.system_tokens, vocab)
    users = [
        [random_tokens(g, args.user_tokens, vocab) for _ in range(args.turns)]
        for _ in range(args.conversations)
    ]
    history: list[list[int]] = [list(system) for _ in range(args.conversations)]
    params = SamplingParams(temperature=0.0, max_tokens=args.answer_tokens, min_tokens=args.answer_tokens)
    out = Layout(name)
    for turn in range(args.turns):
        for start in range(0, args.conversations, args.batch):
            wave = range(start, min(start + args.batch, args.conversations))
            shares: list[list[int]] = [[] for _ in engines]
            for c in wave:
                history[c] += users[c][turn]
                held = [e.cached_prefix_tokens(history[c]) for e in engines]
                best = max(range(workers), key=lambda w: (held[w], -len(shares[w])))
                shares[best].append(c)
            for engine, share in zip(engines, shares, strict=True):
                if share:
                    out.turns += serve_wave(engine, share, turn, history, params)
        log(f"  {name}: turn {turn + 1}/{args.turns} done")
    for e in engines:
        out.restored_tokens += e.scheduler.tier_hit_tokens
        e.close()
    tmp.cleanup()
    return out


def serve_wave(
    engine: LLMEngine, share: list[int], turn: int, history: list[list[int]], params
) -> list[Turn]:
    """One worker's requests of a wave, all admitted at once; each conversation's history grows by
    the answer."""
    started = time.perf_counter()
    for c in share:
        engine.add_request(f"c{c}-t{turn}", history[c], params)
    first: dict[str, float] = {}
    cached: dict[str, int] = {}
    answers: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id not in first:
                first[o.request_id] = time.perf_counter() - started
                cached[o.request_id] = o.num_cached_tokens
            if o.finished:
                answers[o.request_id] = o.outputs[0].token_ids
    turns = []
    for c in share:
        rid = f"c{c}-t{turn}"
        turns.append(Turn(c, turn + 1, len(history[c]), cached[rid], first[rid]))
        history[c] += answers[rid]
    return turns


def plot(path: Path, layouts: list[Layout]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for lay in layouts:
        by = lay.ttft_by_turn()
        ax.plot(list(by), [1000 * v for v in by.values()], marker="o", label=lay.name)
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT p50 (ms)")
    ax.set_title("multi-turn chat, KV working set larger than the cache", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", type=Path, default=ROOT / ".models" / "small", help="model dir (made if missing)"
    )
    p.add_argument("--preset", default="small", help="preset to make when --model is missing")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=1024, help="the shared system prompt")
    p.add_argument("--user-tokens", type=int, default=64, help="each user message")
    p.add_argument("--answer-tokens", type=int, default=32, help="each answer (greedy, exactly this long)")
    p.add_argument("--batch", type=int, default=4, help="concurrent requests per wave")
    p.add_argument(
        "--working-set", type=float, default=4.0, help="the workload's distinct tokens / the cache"
    )
    p.add_argument("--host-pools", type=float, default=2.0, help="the host tier, in caches' worth")
    p.add_argument("--disk-gib", type=int, default=8, help="the disk tier (a temporary directory)")
    p.add_argument("--block-size", type=int, default=EngineArgs.block_size)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", type=Path, default=ROOT / ".run" / "kv_tiers.png")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = ensure_model(args.model, args.preset)

    probe = LLMEngine(
        model, num_gpu_blocks=4, block_size=args.block_size, load_tokenizer=False, dtype=args.dtype
    )
    vocab, block_bytes = probe.config.vocab_size, probe.model.kv_cache_block_bytes(args.block_size)
    probe.close()
    distinct = args.system_tokens + args.conversations * args.turns * (args.user_tokens + args.answer_tokens)
    pool_blocks = int(distinct / args.working_set) // args.block_size
    longest = args.system_tokens + args.turns * (args.user_tokens + args.answer_tokens)
    need = args.system_tokens // args.block_size + args.batch * -(
        -(longest - args.system_tokens) // args.block_size
    )
    if pool_blocks < need:
        sys.exit(
            f"a cache of {pool_blocks} blocks cannot hold a wave ({need}); lower --batch or --working-set"
        )
    log(f"{args.conversations} conversations x {args.turns} turns: {distinct} distinct tokens; cache "
        f"{pool_blocks} blocks ({pool_blocks * args.block_size} tokens, {pool_blocks * block_bytes / 2**20:.0f} MiB), "
        f"host tier {args.host_pools:g}x that")  # fmt: skip

    layouts = []
    for workers in (1, 2):
        for tiers in (False, True):
            layouts.append(run_layout(args, model, workers, tiers, vocab, pool_blocks, block_bytes))

    print(f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; " + cpu_name())
    print(f"model {model.name} ({args.dtype}), {args.threads} threads; {args.conversations} conversations x "
          f"{args.turns} turns, system {args.system_tokens} + {args.user_tokens} user + {args.answer_tokens} "
          f"answer tokens per turn, waves of {args.batch}; cache {pool_blocks} blocks of {args.block_size} "
          f"= 1/{args.working_set:g} of the working set")  # fmt: skip
    print(f"{'layout':<24}{'TTFT p50 ms':>12}{'TTFT p99 ms':>12}{'computed tok':>14}{'restored tok':>14}"
          f"{'p50 vs off':>11}{'computed vs off':>16}")  # fmt: skip
    for lay in layouts:
        off = next(x for x in layouts if x.name == lay.name.replace("tiers on", "tiers off"))
        print(f"{lay.name:<24}{1000 * lay.ttft(50):>12.1f}{1000 * lay.ttft(99):>12.1f}{lay.computed:>14}"
              f"{lay.restored_tokens:>14}{lay.ttft(50) / off.ttft(50):>10.2f}x{lay.computed / off.computed:>15.2f}x")  # fmt: skip
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    plot(args.plot, layouts)
    print(f"TTFT p50 by turn: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
