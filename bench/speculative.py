"""Speculative decoding: tokens/s and inter-token latency at batch 1, 4 and 16, without
speculation and with each proposer, on a trained target (default `wide-trained`, 25M parameters:
its decode step reads 100 MB of weights, bound by memory bandwidth as real models are) with
`tiny-trained` as the draft model (same tokenizer, 1M parameters).

    python bench/speculative.py                     # both workloads, batch 1, 4, 16
    python bench/speculative.py --batches 1 --output 64
    python bench/speculative.py --model tiny-trained --draft tiny-trained-draft   # compute-bound

`--model` and `--draft` take a preset of `disagg make-model` (made once under .models/<preset>;
`wide-trained` trains for about 3 minutes on 2 idle cores) or a checkpoint directory.

Workloads (greedy, every request the same number of new tokens):
  * repeat: the prompt is a few corpus sentences said twice and begun a third time, so the
    continuation repeats text already in the context (prompt lookup applies);
  * chat: a question of the corpus as a chat turn, answered freely.
Every configuration runs the same prompts in the same command; ratios are against the run
without speculation, and the machine's load average is printed with the figures. Before the table:
the target's measured step time by rows (what a verify step of k + 1 rows costs against one row)
beside the floor of reading its weights once at this machine's read bandwidth.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

from bench_model import ensure_model  # noqa: E402
from memory_floor import read_bandwidth  # noqa: E402


def checkpoint(name_or_path: str) -> Path:
    """A preset's directory under .models/ (made now if missing), or the checkpoint directory given."""
    from disagg.worker.tools.make_model import PRESETS

    if name_or_path in PRESETS:
        return ensure_model(ROOT / ".models" / name_or_path, name_or_path)
    return Path(name_or_path)


def weight_bytes(path: Path) -> int:
    """Bytes of weights one decode step reads: every matrix but the embedding table (one row of it)."""
    import json

    config = json.loads((path / "config.json").read_text())
    total = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[config.get("torch_dtype", "float32")]
    return total - config["vocab_size"] * config["hidden_size"] * itemsize


def print_costs(name: str, costs, floor_s: float | None) -> None:
    base = costs.seconds[0]
    steps = ", ".join(
        f"{n}: {1000 * t:.2f} ({t / base:.2f}x)" for n, t in zip(costs.sizes, costs.seconds, strict=True)
    )
    floor = f"; floor {1000 * floor_s:.2f} ms" if floor_s else ""
    print(f"{name} step ms by rows (x one row): {steps}{floor}")


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
    ap.add_argument("--model", default="wide-trained", help="target: a preset or a checkpoint directory")
    ap.add_argument("--draft", default="tiny-trained", help="draft model: a preset or a checkpoint directory")
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
    model = checkpoint(args.model)
    draft = checkpoint(args.draft) if "draft" in args.proposers else None
    configs = {
        "none": {},
        "ngram": {"speculative_method": "ngram", "num_speculative_tokens": args.k},
        "draft": {"speculative_method": "draft", "num_speculative_tokens": args.k,
                  "speculative_draft_model": str(draft)},
    }  # fmt: skip
    configs = {name: kw for name, kw in configs.items() if name == "none" or name in args.proposers}
    for kw in configs.values():
        if kw:
            kw["speculative_adaptive"] = not args.always
    engines = {name: LLMEngine(model, threads=args.threads, **kw) for name, kw in configs.items()}
    tok = engines["none"].tokenizer
    read = read_bandwidth(256 << 20)
    print(f"read bandwidth {read.gbps:.1f} GB/s ({args.threads} thread(s), load {read.load:.2f}); "
          f"target {model.name} reads {weight_bytes(model) / 1e6:.0f} MB of weights per step")  # fmt: skip
    for name, engine in engines.items():
        costs = engine.speculator and engine.speculator.costs
        if costs:
            print_costs(f"{name}: target", costs, weight_bytes(model) / read.bytes_per_s)
        draft_costs = engine.speculator and engine.speculator.draft_costs
        if draft_costs:
            print_costs(f"{name}: draft {draft.name}", draft_costs, None)
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
