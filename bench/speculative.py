"""Speculative decoding: tokens/s and inter-token latency at batch 1, 4 and 16, without
speculation and with each proposer, on the trained tiny model (draft: its trained draft sibling).

    python bench/speculative.py                     # both workloads, batch 1, 4, 16
    python bench/speculative.py --batches 1 --output 64

Workloads (greedy, every request the same number of new tokens):
  * repeat: the prompt is a few corpus sentences said twice and begun a third time, so the
    continuation repeats text already in the context (prompt lookup applies);
  * chat: a question of the corpus as a chat turn, answered freely.
Every configuration runs the same prompts in the same command; ratios are against the run
without speculation, and the machine's load average is printed with the figures.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
# Safe-path mode (PYTHONSAFEPATH=1, which the Makefile sets) keeps this folder off sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_model import ensure_model  # noqa: E402


def prompts(tokenizer, workload: str, n: int, seed: int) -> list[list[int]]:
    from disagg.worker.tools.make_model import training_corpus

    rng = random.Random(seed)
    corpus = training_corpus(0)
    sentences = [s for s in corpus if not s.endswith("?") and len(s) < 120]
    questions = [s for s in corpus if s.endswith("?") and len(s) < 80]
    out = []
    for _ in range(n):
        if workload == "repeat":
            body = " ".join(rng.choice(sentences) for _ in range(3))
            text = f"{body} {body} {body[: len(body) // 3]}"
            out.append(tokenizer.encode(text))
        else:
            chat = [{"role": "user", "content": rng.choice(questions)}]
            out.append(tokenizer.encode(tokenizer.apply_chat_template(chat, add_generation_prompt=True),
                                        add_special_tokens=False))  # fmt: skip
    return out


def run(engine, batch: list[list[int]], output: int) -> dict:
    """All prompts at once; per request the arrival time of every output token."""
    from disagg.worker.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
    times: dict[str, list[float]] = {}
    for i, p in enumerate(batch):
        engine.add_request(f"b{i}", p, params)
        times[f"b{i}"] = []
    start, cpu_start = time.perf_counter(), time.process_time()
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            times[o.request_id] += [now] * len(o.new_token_ids)
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    # inter-token latency: time from a request's first token to its last, per later token
    itl = statistics.mean((t[-1] - t[0]) / (len(t) - 1) for t in times.values())
    first_done = max(t[0] for t in times.values())
    decode_tokens = sum(len(t) - 1 for t in times.values())
    # CPU time of this process per output token: what the machine's other load disturbs least
    cpu_per_token = cpu / sum(len(t) for t in times.values())
    return {
        "tok_s": decode_tokens / (wall - (first_done - start)),
        "itl": itl,
        "wall": wall,
        "cpu": cpu_per_token,
    }


def snapshot(engine) -> tuple[int, int, int]:
    stats = engine.speculator.stats if engine.speculator else None
    return (stats.num_proposed, stats.num_accepted, stats.num_proposals) if stats else (0, 0, 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / ".models" / "tiny-trained")
    ap.add_argument("--draft", type=Path, default=ROOT / ".models" / "tiny-trained-draft")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--workloads", nargs="+", default=["repeat", "chat"], choices=["repeat", "chat"])
    ap.add_argument("--output", type=int, default=96, help="new tokens per request")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3, help="runs per point, in turns; the best is kept")
    ap.add_argument("--proposers", nargs="+", default=["ngram", "draft"], choices=["ngram", "draft"])
    ap.add_argument("--always", action="store_true",
                    help="speculate whatever the measured step costs say (speculative_adaptive off)")  # fmt: skip
    args = ap.parse_args()

    from disagg.worker.engine.llm_engine import LLMEngine

    torch.set_num_threads(args.threads)
    if args.model == ROOT / ".models" / "tiny-trained":
        ensure_model(args.model, "tiny-trained")
    if "draft" in args.proposers and args.draft == ROOT / ".models" / "tiny-trained-draft":
        ensure_model(args.draft, "tiny-trained-draft")
    configs = {
        "none": {},
        "ngram": {"speculative_method": "ngram", "num_speculative_tokens": args.k},
        "draft": {"speculative_method": "draft", "num_speculative_tokens": args.k,
                  "speculative_draft_model": str(args.draft)},
    }  # fmt: skip
    configs = {name: kw for name, kw in configs.items() if name == "none" or name in args.proposers}
    for kw in configs.values():
        if kw:
            kw["speculative_adaptive"] = not args.always
    engines = {name: LLMEngine(args.model, threads=args.threads, **kw) for name, kw in configs.items()}
    tok = engines["none"].tokenizer
    for name, engine in engines.items():
        costs = engine.speculator and engine.speculator.costs
        if costs:
            steps = ", ".join(f"{n}: {1000 * t:.2f}" for n, t in zip(costs.sizes, costs.seconds, strict=True))
            print(f"{name}: measured target step ms by rows: {steps}")
        draft = engine.speculator and engine.speculator.draft_costs
        if draft:
            steps = ", ".join(f"{n}: {1000 * t:.2f}" for n, t in zip(draft.sizes, draft.seconds, strict=True))
            print(f"{name}: measured draft step ms by rows: {steps}")
    print(f"load before: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} (1, 5 min); "
          f"{os.cpu_count()} CPUs, torch threads {args.threads}; k={args.k}, {args.output} new tokens")  # fmt: skip
    print(f"{'workload':8} {'batch':>5} {'config':6} {'tok/s':>8} {'ITL ms':>8} {'tok/s x':>8} {'ITL x':>7}"
          f" {'CPU/tok x':>9} {'accept':>7} {'mean len':>8}")  # fmt: skip
    for workload in args.workloads:
        for b in args.batches:
            batch = prompts(tok, workload, b, seed=b)
            for engine in engines.values():
                run(engine, batch[:1], 8)  # warm up
            before = {name: snapshot(e) for name, e in engines.items()}
            # the configurations take turns, so a burst of load elsewhere hits them alike
            results: dict[str, list[dict]] = {name: [] for name in engines}
            for _ in range(args.repeats):
                for name, engine in engines.items():
                    results[name].append(run(engine, batch, args.output))
            base = min(results["none"], key=lambda r: r["itl"])
            base_cpu = min(r["cpu"] for r in results["none"])
            for name, engine in engines.items():
                r = min(results[name], key=lambda r: r["itl"])
                cpu = min(x["cpu"] for x in results[name])
                acc = mean_len = ""
                if engine.speculator:
                    proposed, accepted, proposals = (
                        now - was for now, was in zip(snapshot(engine), before[name], strict=True)
                    )
                    acc = f"{accepted / proposed:.2f}" if proposed else "-"
                    mean_len = f"{accepted / proposals:.2f}" if proposals else "-"
                print(f"{workload:8} {b:>5} {name:6} {r['tok_s']:8.1f} {1000 * r['itl']:8.2f} "
                      f"{r['tok_s'] / base['tok_s']:8.2f} {base['itl'] / r['itl']:7.2f} {base_cpu / cpu:9.2f} {acc:>7} {mean_len:>8}",
                      flush=True)  # fmt: skip
    print(f"load after: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}")
    print("ITL x: how many times shorter the inter-token latency is than without speculation (wall clock);")
    print("CPU/tok x: the same for this process's CPU time per output token (less disturbed by other load)")


if __name__ == "__main__":
    main()
