"""What to apply now: skip children already as desired, and roll decode out before prefill.

A child is up to date when every field the operator sets holds the value it sets (`drift`), so a
repeated reconcile that would change nothing writes nothing, and a field changed by hand is
applied back. Every applied child also carries the hash of its template
(`disagg.dev/applied-hash`): it tells a new template (a rollout) from a hand edit (a revert). A new
prefill template waits until decode runs its own current template on every replica and all of them
are ready: both pools are never more than one version apart, and the pool that holds the
long-lived streams moves first.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from disagg.operator.builders.common import digest
from disagg.operator.drift import differences

HASH_ANNOTATION = "disagg.dev/applied-hash"


def _without_replicas(manifest: dict) -> dict:
    # Replicas are compared on their own: the autoscaler, the HPA and the rollout all touch them,
    # and a replica change must never count as a new template.
    out = copy.deepcopy(manifest)
    out.get("spec", {}).pop("replicas", None)
    out["metadata"].get("annotations", {}).pop(HASH_ANNOTATION, None)
    return out


def stamp(manifest: dict) -> dict:
    """The manifest with its applied-hash annotation set."""
    out = copy.deepcopy(manifest)
    out["metadata"].setdefault("annotations", {})[HASH_ANNOTATION] = digest(_without_replicas(manifest))
    return out


def applied_hash(obj: dict | None) -> str | None:
    if not obj:
        return None
    return ((obj.get("metadata") or {}).get("annotations") or {}).get(HASH_ANNOTATION)


def up_to_date(desired: dict, observed: dict | None) -> bool:
    """Whether the observed child already holds every value `desired` (stamped) sets."""
    return observed is not None and not differences(desired, observed)


def generation_seen(observed: dict) -> bool:
    """The workload's controller has acted on its latest spec. LeaderWorkerSets before lws 0.7
    report no observedGeneration: for them the updated count stands alone."""
    meta = observed.get("metadata") or {}
    status = observed.get("status") or {}
    if "generation" not in meta:
        return True
    if "observedGeneration" not in status and observed.get("kind") == "LeaderWorkerSet":
        return True
    return status.get("observedGeneration", 0) >= meta["generation"]


def rolled_out(desired: dict, observed: dict | None) -> bool:
    """A workload runs the desired template on all its replicas, and they are all ready."""
    if observed is None or applied_hash(observed) != applied_hash(desired):
        return False
    status = observed.get("status") or {}
    if not generation_seen(observed):
        return False
    replicas = (observed.get("spec") or {}).get("replicas", 1)
    return status.get("updatedReplicas", 0) >= replicas and status.get("readyReplicas", 0) >= replicas


@dataclass
class Plan:
    apply: list[dict] = field(default_factory=list)  # stamped manifests to apply, in order
    unchanged: list[dict] = field(default_factory=list)
    held: list[dict] = field(default_factory=list)  # held back by the decode-first rule
    reasons: list[str] = field(default_factory=list)


def plan(
    desired: list[dict],
    observed: dict[tuple[str, str], dict | None],
    decode_key: tuple[str, str],
    prefill_key: tuple[str, str],
) -> Plan:
    """Sort the stamped desired children into apply / unchanged / held.

    `observed` maps (kind, name) to the live object (None when absent). A new prefill template
    is held while decode has not rolled out, unless prefill does not exist yet (first creation).
    """
    out = Plan()
    by_key = {(d["kind"], d["metadata"]["name"]): d for d in desired}
    decode_done = rolled_out(by_key[decode_key], observed.get(decode_key))
    for manifest in desired:
        key = (manifest["kind"], manifest["metadata"]["name"])
        live = observed.get(key)
        if up_to_date(manifest, live):
            out.unchanged.append(manifest)
            continue
        template_change = live is not None and applied_hash(live) != applied_hash(manifest)
        if key == prefill_key and template_change and not decode_done:
            out.held.append(manifest)
            out.reasons.append(f"{key[1]} waits until decode has rolled out")
            continue
        out.apply.append(manifest)
    return out
