"""The autoscaler's hold on the replicas of the StatefulSets it sizes.

It writes `spec.replicas` as field manager `disagg-autoscaler` (a forced server-side apply, see
`disagg.operator.replicas`), and it is the one place that undoes anyone else's change of them:
the revert, its Event and its entry in `status.<role>.autoscaling.decisions` happen here only.
The timer and the StatefulSet watch both come through here; a lock per StatefulSet serializes
them, and each reads the StatefulSet and the InferenceDeployment afresh under it, so a change
the timer makes (status first, then the StatefulSet) is never mistaken for a hand edit.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from disagg.operator import constants as c
from disagg.operator import events
from disagg.operator.autoscaling.control import Decision, Memory
from disagg.operator.autoscaling.spec import AutoscalingSpecError, autoscaled_roles
from disagg.operator.autoscaling.state import role_status
from disagg.operator.constants import FIELD_MANAGER
from disagg.operator.kube import Kube
from disagg.operator.replicas import AUTOSCALER_MANAGER, managers_of, replicas_patch


def revert_message(role: str, sts_name: str, found: int, restored: int) -> str:
    return (
        f"replicas of StatefulSet {sts_name} were changed to {found} outside the autoscaler; restored "
        f"{restored}: spec.{role}.autoscaling owns the replica count (edit its minReplicas/maxReplicas, "
        f"or replace autoscaling with replicas, to size this pool by hand)"
    )


def owned_replicas(idep: dict, role: str) -> int | None:
    """The autoscaler's last decision for the role, as recorded in the status (None before its first)."""
    value = (((idep.get("status") or {}).get(role) or {}).get("autoscaling") or {}).get("desiredReplicas")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class ReplicaOwner:
    def __init__(self, kube: Kube, post: Callable[..., None] = events.post):
        self.kube = kube
        self.post = post
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}

    def lock(self, namespace: str, sts_name: str) -> asyncio.Lock:
        return self._locks.setdefault((namespace, sts_name), asyncio.Lock())

    async def scale(self, sts: dict, replicas: int) -> None:
        """Set the replicas as their owner (forced: takes the field back from a hand edit)."""
        await self.kube.apply(replicas_patch(sts, replicas), field_manager=AUTOSCALER_MANAGER)

    async def revert_hand_edit(
        self, namespace: str, sts_name: str, now: float | None = None
    ) -> Decision | None:
        """If the StatefulSet's replicas differ from the autoscaler's last decision, restore them, say
        why (Event and status), and return the revert; None when there was nothing to undo."""
        async with self.lock(namespace, sts_name):
            sts = await self.kube.get("apps/v1", "StatefulSet", namespace, sts_name)
            name = (((sts or {}).get("metadata") or {}).get("labels") or {}).get(c.LABEL_DEPLOYMENT)
            if sts is None or not name:
                return None
            idep = await self.kube.get(c.API_VERSION, c.KIND, namespace, name)
            return await self.revert_locked(sts, idep, time.time() if now is None else now)

    async def revert_locked(self, sts: dict, idep: dict | None, now: float) -> Decision | None:
        """`revert_hand_edit` for a caller that holds the StatefulSet's lock and has just read both."""
        meta = sts.get("metadata") or {}
        role = (meta.get("labels") or {}).get(c.LABEL_ROLE)
        found = (sts.get("spec") or {}).get("replicas")
        if role not in c.ROLES or found is None or meta.get("deletionTimestamp"):
            return None
        if idep is None or (idep.get("metadata") or {}).get("deletionTimestamp"):
            return None
        try:
            aspec = autoscaled_roles(idep.get("spec") or {}).get(role)
        except AutoscalingSpecError:
            return None  # the timer reports a bad section
        if aspec is None or aspec.mode != "operator":
            return None
        owned = owned_replicas(idep, role)
        if owned is None:
            # No decision yet (the first tick ran before the StatefulSet existed): the pool still
            # has the count the operator created it with, and a change by anyone else is a hand edit.
            if not managers_of(sts, "spec", "replicas") - {FIELD_MANAGER, AUTOSCALER_MANAGER}:
                return None
            owned = aspec.min_replicas
        if owned == int(found):
            return None
        restored = aspec.clamp(owned)
        reason = revert_message(role, meta["name"], int(found), restored)
        decision = Decision(restored, int(found), "revert", "ReplicasReverted", reason, Memory())
        previous = ((idep.get("status") or {}).get(role) or {}).get("autoscaling") or {}
        new = role_status(aspec, decision, previous, now, record=True)
        idep_meta = idep["metadata"]
        await self.kube.patch_status(
            c.API_VERSION, c.KIND, idep_meta["namespace"], idep_meta["name"], {role: {"autoscaling": new}}
        )
        await self.scale(sts, restored)
        self.post(idep, "Warning", "ReplicasReverted", reason)
        return decision
