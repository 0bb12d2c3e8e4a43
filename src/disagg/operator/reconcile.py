"""One reconcile of an InferenceDeployment: build, compare, apply what changed, prune, report status.

Runs for create/update/resume, for every event of a child of any kind it owns (so a child deleted
or edited by hand is recreated or restored at once, and the status follows readiness), and on a
slow timer as a safety net. Children are read from the watch-fed cache (`children`), not listed.
Runs of the same object are serialized; a run that finds nothing to change writes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import kopf

from disagg.operator import constants as c
from disagg.operator import credential_secret, events, pod_health, replicas, rollout
from disagg.operator import spec as specs
from disagg.operator import status as statuses
from disagg.operator.builders import build_children, common, leader_worker_set, spans_nodes, workload_key
from disagg.operator.children import UNKNOWN, Children
from disagg.operator.drift import differences
from disagg.operator.kube import Kube, KubeError
from disagg.operator.settings import Settings

DISCOVERY_TTL_SECONDS = 60.0


class InvalidSpec(kopf.PermanentError):
    """The resource cannot be reconciled until its spec changes."""


@dataclass
class Outcome:
    applied: list[str]
    held: list[str]
    status: dict
    pruned: list[str] | None = None


def _key(manifest: dict) -> tuple[str, str]:
    return manifest["kind"], manifest["metadata"]["name"]


def autoscaled_workloads(idep: specs.InferenceDeployment, settings: Settings) -> set[tuple[str, str]]:
    """The worker StatefulSets (or LeaderWorkerSets) whose replicas are not the operator's:
    autoscaled roles, either mode."""
    return {
        workload_key(idep, role, settings) for role in c.ROLES if idep.spec.role(role).autoscaling is not None
    }


def leave_replicas_to_autoscaler(desired: list[dict], observed: dict, autoscaled: set) -> list[dict]:
    """Drop `spec.replicas` from autoscaled StatefulSets that exist: only their creation sets it."""
    out = []
    for manifest in desired:
        if _key(manifest) in autoscaled and observed.get(_key(manifest)) is not None:
            manifest = {**manifest, "spec": {k: v for k, v in manifest["spec"].items() if k != "replicas"}}
        out.append(manifest)
    return out


def describe(manifest: dict, was: dict | None, seen_before: bool) -> tuple[str, str, str]:
    """The Event (type, reason, message) for one applied child: a creation, a new template, a
    replica count the spec changed, or a field changed outside the operator and now restored."""
    kind, name = _key(manifest)
    if was is None:
        reason = "Recreated" if seen_before else "Created"
        return "Normal", reason, f"{reason.lower()} {kind} {name}"
    if rollout.applied_hash(was) != rollout.applied_hash(manifest):
        return "Normal", "Updated", f"updated {kind} {name}"
    changed = differences(manifest, was)
    if changed == ["spec.replicas"]:
        have = (was.get("spec") or {}).get("replicas")
        want = manifest["spec"]["replicas"]
        if c.FIELD_MANAGER in replicas.managers_of(was, "spec", "replicas"):
            return "Normal", "Scaled", f"scaled {kind} {name} from {have} to {want} replicas"
        return (
            "Warning",
            "ReplicasReverted",
            (
                f"{kind} {name} replicas {have} -> {want}: the InferenceDeployment's spec owns the replica "
                f"count; change its replicas instead of editing the {kind}"
            ),
        )
    return (
        "Warning",
        "DriftReverted",
        (
            f"{kind} {name}: {', '.join(changed)} changed outside the operator; restored from the "
            f"InferenceDeployment's spec (edit it instead)"
        ),
    )


def _has_replicas(obj: dict | None) -> bool:
    return obj is not None and obj.get("kind") in ("StatefulSet", "Deployment", "LeaderWorkerSet")


def _ready(obj: dict) -> bool:
    want = (obj.get("spec") or {}).get("replicas", 1)
    return (obj.get("status") or {}).get("readyReplicas", 0) >= want


class Reconciler:
    def __init__(
        self,
        kube: Kube,
        post: Callable[..., None] = events.post,
        children: Children | None = None,
        settings: Settings | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.kube = kube
        self.clock = clock  # wall time: pods' condition timestamps are wall time
        self.settings = settings or Settings()
        self._secret_ensured: set[str] = set()  # uids whose credentials Secret exists (as far as we know)
        self.post = post  # Events on the InferenceDeployment
        self.children = children if children is not None else Children()
        self._locks: dict[str, asyncio.Lock] = {}
        self._sm_checked: tuple[float, bool] | None = None
        self._lws_checked: tuple[float, bool] | None = None  # when the LWS API was last found served
        self._waiting: dict[str, int] = {}  # uid -> runs queued for the lock
        self._held: dict[str, set[str]] = {}  # uid -> children held back, to post the Event once
        self._pod_problems: dict[str, set[tuple[str, str]]] = {}  # uid -> (pod, reason) posted

    def _lock(self, uid: str) -> asyncio.Lock:
        return self._locks.setdefault(uid, asyncio.Lock())

    def forget(self, uid: str) -> None:
        self._secret_ensured.discard(uid)
        self._locks.pop(uid, None)
        self._waiting.pop(uid, None)
        self._held.pop(uid, None)
        self._pod_problems.pop(uid, None)

    def recheck_secret(self, uid: str) -> None:
        """Have the next run create the credentials Secret again if it went (the slow resync asks:
        the operator does not watch Secrets, which would need the right to read them)."""
        self._secret_ensured.discard(uid)

    async def _ensure_secret(self, body: dict, idep: specs.InferenceDeployment) -> None:
        if idep.uid in self._secret_ensured:
            return
        if await credential_secret.ensure(self.kube, idep):
            name = credential_secret.secrets.credentials_name(idep)
            self.post(body, type="Normal", reason="Created", message=f"created Secret {name}")
        self._secret_ensured.add(idep.uid)

    async def _service_monitors_served(self) -> bool:
        # Discovery changes rarely (installing the Prometheus Operator); ask once a minute at most.
        now = time.monotonic()
        if self._sm_checked is None or now - self._sm_checked[0] > DISCOVERY_TTL_SECONDS:
            self._sm_checked = (now, await self.kube.serves("monitoring.coreos.com/v1", "servicemonitors"))
        return self._sm_checked[1]

    async def _leader_worker_sets_served(self) -> bool:
        # Asked only for a role spanning nodes (discovery: no RBAC rule). A yes holds a minute; a no
        # is asked again next time, so the refused role is built at the first reconcile (a spec
        # edit, the resync) after LeaderWorkerSet is installed.
        now = time.monotonic()
        if self._lws_checked is None or now - self._lws_checked[0] > DISCOVERY_TTL_SECONDS:
            if not await self.kube.serves(leader_worker_set.API_VERSION, leader_worker_set.PLURAL):
                return False
            self._lws_checked = (now, True)
        return self._lws_checked[1]

    async def _live(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        found = self.children.lookup(kind, namespace, name)
        if found is not UNKNOWN:
            return found
        # Not seen yet (the watch's initial listing has not reached it): ask once.
        obj = await self.kube.get(api_version, kind, namespace, name)
        if obj is None:
            self.children.absent(kind, namespace, name)
        else:
            self.children.seen({"apiVersion": api_version, "kind": kind, **obj})
        return obj

    async def _observe(self, desired: list[dict], idep: specs.InferenceDeployment) -> dict:
        """The live desired children, keyed by (kind, name), from the cache."""
        return {
            _key(m): await self._live(m["apiVersion"], m["kind"], idep.namespace, m["metadata"]["name"])
            for m in desired
        }

    async def _prune(self, body: dict, idep: specs.InferenceDeployment, desired: list[dict]) -> list[str]:
        """Delete the children this resource controls that its spec no longer asks for."""
        wanted = {_key(m) for m in desired}
        pruned = []
        for obj in self.children.owned_by(idep.namespace, idep.uid):
            meta = obj["metadata"]
            labels = meta.get("labels") or {}
            if _key(obj) in wanted or labels.get(c.LABEL_MANAGED_BY) != c.FIELD_MANAGER:
                continue
            await self.kube.delete(
                obj["apiVersion"], obj["kind"], idep.namespace, meta["name"], uid=meta.get("uid")
            )
            self.children.absent(obj["kind"], idep.namespace, meta["name"])
            pruned.append(f"{obj['kind']}/{meta['name']}")
            self.post(
                body,
                type="Normal",
                reason="Pruned",
                message=f"deleted {obj['kind']} {meta['name']}: the spec no longer asks for it",
            )
        return pruned

    async def _write_status(self, body: dict, new: dict) -> None:
        meta = body["metadata"]
        if statuses.changed(body.get("status") or {}, new):
            await self.kube.patch_status(c.API_VERSION, c.KIND, meta["namespace"], meta["name"], new)

    async def _reject(self, body: dict, message: str) -> None:
        meta = body["metadata"]
        previous = (body.get("status") or {}).get("conditions") or []
        new = statuses.compute(
            generation=int(meta.get("generation") or 1),
            endpoint="",
            desired={},
            observed={},
            held=[],
            problem=("InvalidSpec", message),
            previous=previous,
        )
        new = {k: v for k, v in new.items() if k in ("observedGeneration", "conditions")}
        if statuses.changed(body.get("status") or {}, new):
            self.post(body, type="Warning", reason="InvalidSpec", message=message)
        await self._write_status(body, new)

    async def _pod_problems_of(
        self, body: dict, idep: specs.InferenceDeployment, observed: dict
    ) -> list[pod_health.PodProblem]:
        """What keeps this deployment's pods from serving, each new one posted as an Event. The
        pods are listed only while some workload lacks ready replicas: a healthy deployment costs
        no call, and one that is not is looked at on each of its children's changes and resyncs."""
        if all(_ready(obj) for obj in observed.values() if _has_replicas(obj)):
            self._pod_problems[idep.uid] = set()
            return []
        pods = await self.kube.list(
            "v1",
            "Pod",
            idep.namespace,
            f"{c.LABEL_DEPLOYMENT}={idep.name},{c.LABEL_MANAGED_BY}={c.FIELD_MANAGER}",
        )
        found = pod_health.problems(pods, self.clock(), self.settings.not_ready_grace_seconds)
        seen = {(p.pod, p.reason) for p in found}
        posted = self._pod_problems.get(idep.uid, set())
        for p in found:
            if (p.pod, p.reason) not in posted:
                self.post(body, type="Warning", reason=p.reason, message=p.describe())
        self._pod_problems[idep.uid] = seen
        return found

    async def reconcile(self, body: dict, logger: logging.Logger) -> Outcome:
        meta = body["metadata"]
        uid = meta.get("uid", "")
        lock = self._lock(uid)
        if lock.locked() and self._waiting.get(uid, 0) > 0:
            # A run is already queued behind the current one and will read the latest state itself.
            return Outcome(applied=[], held=[], status={})
        self._waiting[uid] = self._waiting.get(uid, 0) + 1
        try:
            await lock.acquire()
        finally:
            self._waiting[uid] -= 1
        try:
            # Work from the latest stored object: the event that triggered this run may predate
            # the status an earlier run wrote, and conditions must keep their transition times.
            fresh = await self.kube.get(c.API_VERSION, c.KIND, meta["namespace"], meta["name"])
            if fresh is None or fresh["metadata"].get("uid", "") != uid:
                return Outcome(applied=[], held=[], status={})
            if fresh["metadata"].get("deletionTimestamp"):
                return Outcome(applied=[], held=[], status={})  # going away: nothing to create or fix
            return await self._reconcile(fresh, logger)
        finally:
            lock.release()

    async def _reconcile(self, body: dict, logger: logging.Logger) -> Outcome:
        try:
            idep = specs.parse(body)
            sm_available = idep.spec.monitoring.service_monitor and await self._service_monitors_served()
            lws_available = spans_nodes(idep, self.settings) and await self._leader_worker_sets_served()
            desired = [
                rollout.stamp(m)
                for m in build_children(
                    idep,
                    body,
                    service_monitor_available=sm_available,
                    settings=self.settings,
                    leader_worker_sets=lws_available,
                )
            ]
        except specs.SpecError as exc:
            await self._reject(body, str(exc))
            raise InvalidSpec(str(exc)) from exc
        except RuntimeError as exc:  # e.g. HPA mode in a build without HPA support
            await self._reject(body, str(exc))
            raise InvalidSpec(str(exc)) from exc

        observed = await self._observe(desired, idep)
        autoscaled = autoscaled_workloads(idep, self.settings)
        desired = leave_replicas_to_autoscaler(desired, observed, autoscaled)
        decode_key = workload_key(idep, "decode", self.settings)
        prefill_key = workload_key(idep, "prefill", self.settings)
        plan = rollout.plan(desired, observed, decode_key, prefill_key)
        seen_before = "observedGeneration" in (body.get("status") or {})

        problem = None
        applied = []
        try:
            await self._ensure_secret(body, idep)  # before any pod that references it
        except KubeError as exc:
            problem = ("ApplyFailed", f"Secret {credential_secret.secrets.credentials_name(idep)}: {exc}")
            self.post(body, type="Warning", reason="ApplyFailed", message=problem[1])
            logger.error("creating the credentials Secret failed: %s", exc)
        for manifest in plan.apply if problem is None else []:
            key = _key(manifest)
            was = observed.get(key)
            try:
                if key in autoscaled and replicas.needs_handover(was):
                    await self.kube.apply(
                        replicas.handover_patch(was), field_manager=replicas.AUTOSCALER_MANAGER
                    )
                observed[key] = await self.kube.apply(manifest)
            except KubeError as exc:
                problem = ("ApplyFailed", f"{key[0]} {key[1]}: {exc}")
                self.post(body, type="Warning", reason="ApplyFailed", message=problem[1])
                logger.error("applying %s %s failed: %s", *key, exc)
                break
            self.children.seen(observed[key])
            version = (observed[key].get("metadata") or {}).get("resourceVersion")
            if was is not None and version == (was.get("metadata") or {}).get("resourceVersion"):
                # The server found nothing to change (a value it stores in another form): no news.
                logger.debug("apply of %s %s changed nothing: %s", *key, differences(manifest, was))
                continue
            applied.append(f"{key[0]}/{key[1]}")
            kind, reason, message = describe(manifest, was, seen_before)
            self.post(body, type=kind, reason=reason, message=message)
        pruned = [] if problem else await self._prune(body, idep, desired)

        held_names = {m["metadata"]["name"] for m in plan.held}
        newly_held = held_names - self._held.get(idep.uid, set())
        for name in sorted(newly_held):
            self.post(
                body, type="Normal", reason="RolloutHeld", message=f"{name} waits until decode has rolled out"
            )
        self._held[idep.uid] = held_names

        pod_problems = await self._pod_problems_of(body, idep, observed)
        by_kind_name = {_key(m): m for m in desired}
        workloads = {
            "decode": decode_key,
            "prefill": prefill_key,
            "router": ("Deployment", common.router_name(idep)),
        }
        new_status = statuses.compute(
            generation=idep.generation,
            endpoint=common.endpoint(idep),
            desired={n: by_kind_name[k] for n, k in workloads.items()},
            observed={n: observed.get(k) for n, k in workloads.items()},
            held=plan.reasons,
            problem=problem,
            redis_observed=observed.get(("StatefulSet", common.redis_name(idep))),
            redis_managed=idep.spec.redis.managed,
            previous=(body.get("status") or {}).get("conditions") or [],
            pod_problems=pod_problems,
        )
        await self._write_status(body, new_status)
        if problem is not None:
            raise kopf.TemporaryError(problem[1], delay=15)
        return Outcome(applied=applied, held=sorted(held_names), status=new_status, pruned=pruned)
