"""`disagg plan`: how many prefill and decode replicas to run for a request mix and its SLOs.

    disagg plan --model .models/small --workload chat --replicas 8,16,64
    disagg plan --profile profile.json --workload summarization --ttft-ms 800 --tpot-ms 60

The engine is measured on this machine (or a saved profile is read), then each replica budget's
best prefill/decode split is found by simulating the deployment at rising request rates; the
goodput (highest rate with >= 90% of requests within both SLOs) is printed beside the same number
of colocated replicas, for two kinds of split: DistServe's (each role does only its phase) and
the one this product serves (decode workers prefill where that is cheaper, idle prefill workers
may be lent whole requests: --overflow-margin, --disagg-threshold). Where DistServe's split wins,
serve it with `--prefill-placement threshold` and no `--prefill-overflow`.
"""

from __future__ import annotations

import argparse
import sys

from disagg.worker.engine.args import EngineArgs
from disagg.worker.serving.args import ServingArgs

# serving settings the simulation has no use for (it models no transport, timeout or drain)
PLACEMENT_EXCLUDED = ("kv_transfer", "prefill_timeout", "lease_seconds", "drain_timeout", "drain_handoff")


def _replica_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of integers, got {text!r}"
        ) from None
    if not values or min(values) < 2:
        raise argparse.ArgumentTypeError("each replica budget must be >= 2")
    return values


def _margin(text: str) -> float | None:
    if text.strip().lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of requests or none, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"the margin must be >= 0, got {value:g}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    from disagg.worker.planner.goodput import BASE_SCALE
    from disagg.worker.planner.workload import WORKLOADS

    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="model directory to measure the engine on")
    source.add_argument("--profile", help="a saved engine profile (JSON) instead of measuring")
    p.add_argument("--save-profile", help="write the measured profile here")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="chat")
    p.add_argument("--slo-scale", type=float, default=BASE_SCALE,
                   help="SLOs as this multiple of the unloaded single-request latency")  # fmt: skip
    p.add_argument("--ttft-ms", type=float, help="TTFT SLO (overrides --slo-scale)")
    p.add_argument(
        "--tpot-ms", type=float, help="TPOT SLO, mean time per output token (overrides --slo-scale)"
    )
    p.add_argument(
        "--replicas", type=_replica_list, default=[8, 16, 64], help="replica budgets, e.g. 8,16,64"
    )
    p.add_argument("--transfer-gbps", type=float, default=None,
                   help="KV transfer bandwidth in GB/s (default: the profile's; none: free transfers)")  # fmt: skip
    p.add_argument(
        "--max-batch", type=int, default=EngineArgs.max_num_seqs, help="decode batch cap (max_num_seqs)"
    )
    p.add_argument("--chunk-tokens", type=int, default=EngineArgs.max_num_batched_tokens,
                   help="colocated prefill chunk (max_num_batched_tokens)")  # fmt: skip
    p.add_argument("--overflow-margin", type=_margin, default=None, metavar="MARGIN",
                   help="the served split's router --prefill-overflow margin (default: none, the router "
                        "lends no prefill worker, as it serves by default)")  # fmt: skip
    # the served split's decode workers place prompts as `disagg worker` does, with its defaults
    ServingArgs.add_cli_args(p, skip=PLACEMENT_EXCLUDED)


def run(args) -> int:
    from disagg.worker.planner import profile as profiles
    from disagg.worker.planner.advisor import Settings, advise
    from disagg.worker.planner.goodput import SLO, TARGET, unloaded_slo
    from disagg.worker.planner.workload import WORKLOADS

    if args.profile:
        prof, raw = profiles.load(args.profile)
    else:
        print(f"measuring the engine on {args.model} ...", file=sys.stderr, flush=True)
        raw = profiles.measure(args.model)
        if args.save_profile:
            profiles.save(raw, args.save_profile)
        prof = profiles.Profile.from_json(raw)
    if args.transfer_gbps is not None:
        raw = {**raw, "transfer_bytes_per_second": args.transfer_gbps * 1e9}
        prof = profiles.Profile.from_json(raw)
    workload = WORKLOADS[args.workload]
    base = unloaded_slo(prof, workload)
    slo = base.scaled(args.slo_scale)
    slo = SLO(
        args.ttft_ms / 1e3 if args.ttft_ms else slo.ttft, args.tpot_ms / 1e3 if args.tpot_ms else slo.tpot
    )
    settings = Settings(
        max_batch=args.max_batch,
        chunk_tokens=args.chunk_tokens,
        overflow_margin=args.overflow_margin,
        disagg_threshold=args.disagg_threshold,
        prefill_placement=args.prefill_placement,
        disagg_busy_slack=args.disagg_busy_slack,
    )
    print(
        f"engine profile ({raw.get('model', '?')}, {raw.get('machine', '?')}, {raw.get('measured_at', '?')}):"
    )
    print(f"  {prof.describe()}")
    print(f"workload {workload.name}: {workload.description}; prompts {workload.prompt_tokens[0]}-"
          f"{workload.prompt_tokens[1]} tokens, outputs {workload.output_tokens[0]}-{workload.output_tokens[1]}")  # fmt: skip
    print(
        f"SLO: {slo} (unloaded: {base}); goodput = highest Poisson rate with >= {TARGET:.0%} of requests within both"
    )
    margin = settings.overflow_margin
    lending = "never"
    if margin is not None:
        lending = (f"when decode is busier by > {margin:g} requests and the prompt costs it no more than the\n"
                   "  decode steps the request saves the decode replica")  # fmt: skip
    for line in (
        "assumptions: continuous batching (<= {b}); step times as profiled, plus the profile's cost of",
        "  each row's context (its prompt and half its output); colocated replicas interleave decode",
        "  steps with prefill chunks of <= {c} tokens, requests round robin; DistServe's split: prefill",
        "  replicas take prompts from the earliest free, decode replicas never prefill; the served split:",
        "  this product's router and decode workers (the cheapest worker by streams; a decode worker",
        "  prefills a prompt itself where cheaper, --disagg-threshold {t}; the router lends an idle",
        "  prefill worker whole requests {o})",
    ):
        print(
            line.format(b=settings.max_batch, c=settings.chunk_tokens, t=settings.disagg_threshold, o=lending)
        )
    print(
        f"\n{'replicas':>8} {'colocated':>10} {'DistServe P:D':>14} {'goodput':>8} {'ratio':>6}"
        f" {'served P:D':>11} {'goodput':>8} {'ratio':>6}   (goodput, req/s)"
    )
    for n in args.replicas:
        plan = advise(prof, workload, slo, n, settings)
        print(f"{n:>8} {plan.colocated:>10.2f} {f'{plan.prefill}:{plan.decode}':>14} {plan.disaggregated:>8.2f} "
              f"{plan.ratio:>6.2f} {f'{plan.served_prefill}:{plan.served_decode}':>11} {plan.served:>8.2f} "
              f"{plan.served_ratio:>6.2f}", flush=True)  # fmt: skip
    return 0
