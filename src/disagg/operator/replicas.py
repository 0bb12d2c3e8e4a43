"""Who owns `spec.replicas` of a worker StatefulSet, in server-side-apply terms.

A role with fixed `replicas` is sized by the operator's own apply (field manager
`disagg-operator`). A role autoscaled in `operator` mode is sized by the autoscaler alone, as
field manager `disagg-autoscaler`:
- the operator's apply carries replicas only when it creates the StatefulSet (the pool starts at
  the autoscaler's last decision, or minReplicas); afterwards its apply leaves them out;
- on a real API server a field its only manager stops applying is removed (and the StatefulSet
  defaults to 1 replica), so before the operator's first apply without replicas the field is
  handed to `disagg-autoscaler` at its live value: an apply that changes nothing but the owner,
  guarded by the resourceVersion the operator saw, so it can never write back an old count;
- the autoscaler scales with a forced apply as `disagg-autoscaler` (a hand edit took the field
  over; the forced apply takes it back).
A role in `hpa` mode follows the same rule for the operator's side: created at minReplicas, then
handed over and left out; the HorizontalPodAutoscaler's scale writes take the field from there.
"""

from __future__ import annotations

from disagg.operator.constants import FIELD_MANAGER

AUTOSCALER_MANAGER = "disagg-autoscaler"


def managers_of(obj: dict | None, *path: str) -> set[str]:
    """The field managers that own `path` (e.g. "spec", "replicas") according to managedFields."""
    owners = set()
    for entry in ((obj or {}).get("metadata") or {}).get("managedFields") or []:
        fields = entry.get("fieldsV1") or {}
        for key in path:
            fields = fields.get(f"f:{key}") if isinstance(fields, dict) else None
        if fields is not None and entry.get("manager"):
            owners.add(entry["manager"])
    return owners


def replicas_patch(sts: dict, replicas: int, *, resource_version: str | None = None) -> dict:
    """The apply body that sets only `spec.replicas` of `sts` (optionally guarded by a resourceVersion)."""
    meta = sts["metadata"]
    metadata = {"name": meta["name"], "namespace": meta["namespace"]}
    if resource_version is not None:
        metadata["resourceVersion"] = resource_version
    return {
        "apiVersion": sts.get("apiVersion", "apps/v1"),
        "kind": sts.get("kind", "StatefulSet"),
        "metadata": metadata,
        "spec": {"replicas": int(replicas)},
    }


def needs_handover(live: dict | None) -> bool:
    """Whether the operator still owns the live StatefulSet's replicas and must hand them over
    before it applies without them (else the API server would reset the pool to 1)."""
    return live is not None and FIELD_MANAGER in managers_of(live, "spec", "replicas")


def handover_patch(live: dict) -> dict:
    """Hand `spec.replicas` to the autoscaler at the live value, only if nothing changed since `live`."""
    replicas = (live.get("spec") or {}).get("replicas", 1)
    return replicas_patch(
        live, replicas, resource_version=(live.get("metadata") or {}).get("resourceVersion")
    )
