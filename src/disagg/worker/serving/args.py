"""`ServingArgs`: how a worker serves its engine in a deployment (where decode workers prefill,
how KV moves, how long transfers and drains may take), each setting declared once with its
default, help and check, like `EngineArgs`.

`disagg worker` generates its flags from these fields (`DISAGG_<FLAG>` gives a pod's default),
hands them as one object to the worker process and its gRPC service, and `disagg up` passes
them to its workers with `to_cli_args`; the planner simulates the same placement with the same
defaults, and the operator names the flags it writes into pods through `cli_flag`.
Standard library only: the operator imports it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.worker.engine.settings import Settings, setting

KV_TRANSFERS = ("nixl", "grpc")  # NIXL (UCX); the gRPC-stream fallback (kv_transfer.BACKENDS)
# load: a decode worker prices a local and a remote prefill (serving/disagg_policy.py);
# threshold: every prompt with at least disagg_threshold uncached tokens goes to a prefill worker
PREFILL_PLACEMENTS = ("load", "threshold")


@dataclass
class ServingArgs(Settings):
    GROUP = "serving"

    kv_transfer: str = setting("nixl", "how KV blocks move between workers: nixl, or the grpc stream fallback",
                               choices=KV_TRANSFERS)  # fmt: skip
    disagg_threshold: int = setting(
        64, "decode workers prefill locally when fewer prompt tokens than this are uncached", minimum=0
    )
    prefill_placement: str = setting(
        "load",
        "load: a decode worker prefills where the first token comes sooner (protecting its running "
        "streams); threshold: every prompt with --disagg-threshold uncached tokens goes to a prefill worker",
        choices=PREFILL_PLACEMENTS,
    )
    disagg_busy_slack: float = setting(
        2.0,
        "with load placement, a decoding worker sends a prompt to a prefill worker unless that delays "
        "its first token more than this factor over a local prefill",
        minimum=1.0,
    )
    prefill_timeout: float = setting(
        120.0, "seconds a decode worker waits for a prefill worker's answer", minimum=0.0, exclusive_min=True
    )
    lease_seconds: float = setting(
        30.0,
        "lease of a KV transfer record; a dead peer's blocks are reclaimed after it",
        minimum=0.0,
        exclusive_min=True,
    )
    drain_timeout: float = setting(
        30.0,
        "longest wait for in-flight streams when draining (/drain, then SIGTERM share it)",
        minimum=0.0,
    )
    drain_handoff: float = setting(
        2.0,
        "seconds a draining worker lets its streams run before handing the rest to the router, which "
        "resumes each on another decode worker from the tokens already sent; at or above "
        "--drain-timeout the worker waits for them instead",
        minimum=0.0,
    )
    handoff_pull_window: float = setting(
        5.0,
        "seconds a draining worker keeps serving the K/V of the streams it handed off, for their new "
        "workers to pull instead of recomputing it (0: they recompute)",
        minimum=0.0,
    )

    def quarantine_seconds(self) -> float:
        """How long a decode worker holds the blocks of an aborted transfer whose KV may still land:
        longer than the prefill worker can keep writing (its Prefill call's timeout) plus a lease."""
        return self.prefill_timeout + self.lease_seconds
