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

    def host_path_allowed(self, path: str) -> bool:
        """`path` (normalised: no `..` escapes) lies under one of the allowed prefixes."""
        path = posixpath.normpath(path)
        for prefix in self.host_path_prefixes:
            prefix = posixpath.normpath(prefix)
            if path == prefix or path.startswith(prefix.rstrip("/") + "/"):
                return True
        return False
