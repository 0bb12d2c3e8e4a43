"""What the operator's installer decides, not each InferenceDeployment: flags of `disagg operator`."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    # hostPath model sources mount a node's directory into pods; only under these prefixes, and
    # none by default (a user allowed to create InferenceDeployments could otherwise read any
    # directory of any node).
    host_path_prefixes: tuple[str, ...] = ()
    # Where the operator itself runs: its autoscaler scrapes the pods' /metrics from there, so
    # the NetworkPolicies let that namespace in.
    operator_namespace: str | None = None
    # The most GPUs one node gives one pod: a GPU role whose tensorParallelSize exceeds this runs as
    # a LeaderWorkerSet, several pods per worker (builders/leader_worker_set.py).
    gpus_per_node: int = 8
    # How often every resource is re-checked for drift.
    resync_seconds: float = 60.0
    # The PriorityClass the router and the managed Redis run under unless their spec names one:
    # the chart creates it, so they are scheduled before workers and evicted after them.
    serving_priority_class: str | None = None
    # How long a running pod may fail its readiness probe before the status calls it a problem
    # (a worker loading a large checkpoint is not ready for minutes, and that is no fault).
    not_ready_grace_seconds: float = 600.0

    def host_path_allowed(self, path: str) -> bool:
        """`path` (normalised: no `..` escapes) lies under one of the allowed prefixes."""
        path = posixpath.normpath(path)
        for prefix in self.host_path_prefixes:
            prefix = posixpath.normpath(prefix)
            if path == prefix or path.startswith(prefix.rstrip("/") + "/"):
                return True
        return False
