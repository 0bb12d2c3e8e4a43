"""Speculative decoding through `disagg up` P/D, measured from the router as a client sees it.

Two deployments on the same cores, one after the other: 1 prefill + 1 decode worker (every prompt
with 8 or more uncached tokens prefilled remotely, `--prefill-placement threshold`; the count of
those that were is printed), plain, then with the decode worker
speculating (the prefill worker never does: `disagg up` strips it). The same greedy requests are
streamed one at a time through the router's OpenAI API; per request TTFT and TPOT (time per output
token after the first: (end - first token) / (tokens - 1), since a speculative step may stream
several tokens in one chunk). Outputs must be identical (greedy speculation is exact).

    python bench/speculative_serving.py [--model wide-trained] [--draft tiny-trained] [--method draft]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import urllib.request
from pathlib import Path

from speculative import checkpoint, prompts  # noqa: E402

from disagg.worker.cli.flags import Up  # noqa: E402
from disagg.worker.cli.ports import free_port  # noqa: E402
from disagg.worker.cli.up import Deployment, add_arguments  # noqa: E402
from disagg.worker.engine.args import EngineArgs  # noqa: E402
from disagg.worker.serving.args import ServingArgs  # noqa: E402


def deploy(args, name: str, speculative: bool) -> Deployment:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    spec = {"speculative_method": args.method, "num_speculative_tokens": args.k}
    if args.method == "draft":
        spec["speculative_draft_model"] = str(checkpoint(args.draft))
    ns = parser.parse_args([
        Up.MODEL, str(checkpoint(args.model)), Up.PREFILL, "1", Up.DECODE, "1",
        Up.PORT, str(free_port()), *EngineArgs.cli_args(threads=args.threads), Up.TIMEOUT, "600",
        *ServingArgs.cli_args(prefill_placement="threshold", disagg_threshold=8),
        Up.RUN_DIR, str(Path(args.run_dir) / name), *(EngineArgs.cli_args(**spec) if speculative else []),
    ])  # fmt: skip
    dep = Deployment(ns)
    dep.plan()
    return dep


def stream(url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    start, first, text = time.perf_counter(), None, []
    with urllib.request.urlopen(req, timeout=600) as r:
        prefill_worker = r.headers.get("X-Disagg-Prefill-Worker", "")
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0]["text"]:
                first = first or time.perf_counter()
                text.append(chunk["choices"][0]["text"])
    end = time.perf_counter()
    return {"ttft": first - start, "tpot": (end - first) / (max_tokens - 1), "text": "".join(text),
            "prefill_worker": prefill_worker}  # fmt: skip


def measure(args, name: str, speculative: bool, batch: list[list[int]]) -> list[dict]:
    dep = deploy(args, name, speculative)
    try:
        dep.start()
        model = dep.model.name
        stream(dep.router_url, model, batch[-1], 8)  # warm-up (its own prompt): connections, KV handshake
        return [stream(dep.router_url, model, p, args.output) for p in batch[:-1]]
    finally:
        dep.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="wide-trained", help="target: a preset or a checkpoint directory")
    ap.add_argument("--draft", default="tiny-trained", help="draft model: a preset or a checkpoint directory")
    ap.add_argument("--method", default="draft", choices=("draft", "ngram"))
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--workload", default="chat", choices=("chat", "repeat"))
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--output", type=int, default=128, help="new tokens per request")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--run-dir", default=".run/bench-speculative-serving")
    args = ap.parse_args()

    from disagg.worker.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(checkpoint(args.model))
    batch = prompts(tokenizer, args.workload, args.requests + 1, seed=1)
    load = os.getloadavg()[0]
    plain = measure(args, "plain", False, batch)
    spec = measure(args, "speculative", True, batch)
    if [r["text"] for r in plain] != [r["text"] for r in spec]:
        raise SystemExit("speculative outputs differ from plain ones (greedy must be identical)")
    remote = sum(bool(r["prefill_worker"]) for r in plain + spec)
    print(f"\n{args.model} + {args.method}" + (f" ({args.draft})" if args.method == "draft" else "") +
          f", k={args.k}, {args.workload}: {args.requests} requests of {args.output} tokens, one at a time "
          f"through the router; 1 prefill + 1 decode, {args.threads} thread(s); prefilled remotely: {remote} "
          f"of {len(plain + spec)}; load {load:.2f} -> {os.getloadavg()[0]:.2f}")  # fmt: skip
    print(f"{'':14}{'TTFT p50 ms':>12}{'TPOT p50 ms':>12}{'TPOT mean ms':>13}")
    for name, rows in (("plain", plain), ("speculative", spec)):
        ttft = statistics.median(r["ttft"] for r in rows) * 1e3
        tpot = [r["tpot"] * 1e3 for r in rows]
        print(f"{name:<14}{ttft:>12.1f}{statistics.median(tpot):>12.2f}{statistics.fmean(tpot):>13.2f}")
    ratio = statistics.fmean(r["tpot"] for r in plain) / statistics.fmean(r["tpot"] for r in spec)
    print(f"TPOT plain / speculative: {ratio:.2f}x (outputs identical)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
