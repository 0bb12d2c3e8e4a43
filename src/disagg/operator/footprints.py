"""What each pod the operator creates asks of its node when the spec does not say.

Requests are what the scheduler reserves and what the kernel's CPU shares follow under
contention: a container without one (BestEffort) is the first to wait for a CPU and to be
evicted. Every pod here is Burstable on purpose: it is guaranteed its request and may use idle
CPU above it; memory has a limit so a leak ends in a restart of that pod, not a node under
pressure. Workers are sized by the user (`spec.<role>.resources`): their need is the model's.
"""

from __future__ import annotations

# The router tokenizes every prompt and relays every token on one event loop. Measured on a
# 2-core node with both workers busy: 320-350 MB resident (SmolLM2's tokenizer), and without a
# CPU request its loop waited for a CPU 79-92% of the time; with 250m, 9-16%.
ROUTER = {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}}
# Leases, the worker registry and the prefix index: a few MB for thousands of cached prompts.
REDIS = {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "1Gi"}}
# One SCAN + DEL over a deployment's keys, then exit.
CLEANUP_JOB = {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}}

# What an init container may take from its pod's main container: it runs before it, so the pod's
# effective request is the larger of the two and copying costs the node nothing.
INIT_COPIED = ("cpu", "memory", "ephemeral-storage")


def or_default(resources: dict, default: dict) -> dict:
    """The spec's resources, or `default` when it sets none."""
    return resources if resources else {k: dict(v) for k, v in default.items()}


def for_init_container(main: dict) -> dict:
    """An init container's resources: the main container's CPU and memory (no GPUs, no RDMA)."""
    out = {}
    for section in ("requests", "limits"):
        kept = {k: v for k, v in (main.get(section) or {}).items() if k in INIT_COPIED}
        if kept:
            out[section] = kept
    return out
