"""An in-memory Kubernetes API (kmock) with the two behaviours of a real API server the operator
relies on and the plain emulator lacks, and the real kopf runtime running our handlers against it.

- Server-side apply creates a missing object (the emulator answers 404 to a PATCH otherwise).
- A spec change bumps `metadata.generation`, so a workload's status lags its spec as in a cluster.
"""

from __future__ import annotations

import asyncio
import copy
import pathlib
import time

import aiohttp.web
import kmock
import yaml
from kmock._internal import enums

from disagg.operator.kube import Kube

ROOT = pathlib.Path(__file__).resolve().parents[2]

RESOURCES = {
    "v1/namespaces": {"kind": "Namespace", "namespaced": False, "verbs": ["list", "watch", "get"]},
    "apiextensions.k8s.io/v1/customresourcedefinitions": {
        "kind": "CustomResourceDefinition",
        "namespaced": False,
        "verbs": ["list", "watch", "get"],
    },
    "disagg.dev/v1alpha1/inferencedeployments": {
        "kind": "InferenceDeployment",
        "namespaced": True,
        "subresources": ["status"],
        "verbs": ["list", "watch", "get", "patch", "create", "delete"],
    },
    "apps/v1/statefulsets": {
        "kind": "StatefulSet",
        "namespaced": True,
        "verbs": ["list", "watch", "get", "patch", "create", "delete"],
    },
    "apps/v1/deployments": {
        "kind": "Deployment",
        "namespaced": True,
        "verbs": ["list", "watch", "get", "patch", "create", "delete"],
    },
    "v1/services": {"kind": "Service", "namespaced": True, "verbs": ["get", "patch", "create", "delete"]},
    "v1/configmaps": {"kind": "ConfigMap", "namespaced": True, "verbs": ["get", "patch", "create", "delete"]},
    "v1/serviceaccounts": {"kind": "ServiceAccount", "namespaced": True, "verbs": ["get", "patch", "create"]},
    "v1/secrets": {"kind": "Secret", "namespaced": True, "verbs": ["get"]},
    "v1/events": {"kind": "Event", "namespaced": True, "verbs": ["create", "list"]},
    "policy/v1/poddisruptionbudgets": {
        "kind": "PodDisruptionBudget",
        "namespaced": True,
        "verbs": ["get", "patch", "create"],
    },
}


class ApiServerEmulator(kmock.KubernetesEmulator):
    _revision = 0

    def _next_revision(self) -> str:
        type(self)._revision += 1
        return str(self._revision)

    def _stamp_revision(self, request) -> None:
        # Every write gets a new resourceVersion, as in a real API server; kopf's JSON patches test it.
        revision = self._next_revision()
        if isinstance(request.data, list):
            request.data.append({"op": "add", "path": "/metadata/resourceVersion", "value": revision})
        elif isinstance(request.data, dict):
            request.data.setdefault("metadata", {})["resourceVersion"] = revision

    def _check_revision_test(self, request) -> None:
        # A JSON patch that tests a stale resourceVersion is rejected with 422, as a real API server does.
        key = (request.resource, request.namespace, request.name)
        if not isinstance(request.data, list) or key not in self._objects or self._objects[key].deleted:
            return
        live = (self._objects[key].raw.get("metadata") or {}).get("resourceVersion")
        for op in request.data:
            if (
                op.get("op") == "test"
                and op.get("path") == "/metadata/resourceVersion"
                and op.get("value") != live
            ):
                raise kmock.KubernetesError(
                    status=422, reason="Invalid", message="resourceVersion test failed"
                )

    async def _serve_list(self, request):
        listing = await super()._serve_list(request)
        listing["metadata"]["resourceVersion"] = str(self._revision)  # the point a following watch resumes at
        return listing

    async def _serve_watch(self, request):
        # A watch from a listed resourceVersion streams only later changes (the plain emulator
        # replays every object, which kopf would take as stale duplicates of what it just listed).
        since = request.params.get("resourceVersion") or "0"
        since = int(since) if since.isdigit() else 0
        async for event in super()._serve_watch(request):
            if isinstance(event, dict):
                revision = (event.get("object", {}).get("metadata") or {}).get("resourceVersion") or "0"
                if int(revision) <= since:
                    continue
            yield event

    async def _handle(self, request):
        if request.resource is not None and request.action == enums.action.UPDATE and request.name:
            self._check_revision_test(request)
        if request.resource is not None and request.action in (enums.action.CREATE, enums.action.UPDATE):
            self._stamp_revision(request)
        if request.action == enums.action.CREATE and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + self._next_revision()
        if request.resource is not None and request.action == enums.action.UPDATE and request.name:
            key = (request.resource, request.namespace, request.name)
            content_type = request.headers.get("Content-Type", "")
            async with self._lock:
                live = self._objects[key] if key in self._objects and not self._objects[key].deleted else None
                if live is None and "apply-patch" in content_type:
                    data = copy.deepcopy(request.data)
                    data.setdefault("metadata", {})["generation"] = 1
                    if key not in self._objects:
                        self._objects[key] = data
                    else:
                        self._objects[key].create(data)
                    raw = self._objects[key].raw
                    await self._buses[request.resource].put({"type": "ADDED", "object": raw})
                    # One write, one watch event: answer here rather than let the PATCH path emit MODIFIED.
                    return aiohttp.web.json_response(dict(raw), status=201)
                elif (
                    live is not None
                    and request.subresource != "status"
                    and isinstance(request.data, dict)
                    and "spec" in request.data
                ):
                    merged = copy.deepcopy(dict(live.raw))
                    _merge(merged, {"spec": request.data["spec"]})
                    if merged.get("spec") != live.raw.get("spec"):
                        generation = (live.raw.get("metadata") or {}).get("generation", 1) + 1
                        request.data.setdefault("metadata", {})["generation"] = generation
        return await super()._handle(request)


def _merge(into: dict, patch: dict) -> None:
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def load_example(name: str, *, namespace: str = "default", uid: str = "uid-1") -> dict:
    body = yaml.safe_load((ROOT / "examples" / name).read_text())
    body["metadata"].update(namespace=namespace, uid=uid)
    return body


class Cluster:
    """The emulated API plus a client for the test's own calls (as `kubectl` would make them)."""

    def __init__(self, k8s: ApiServerEmulator, api: Kube, reconciler):
        self.k8s = k8s
        self.api = api
        self.reconciler = reconciler

    def live(self, resource: str, name: str, namespace: str = "default") -> dict | None:
        """The stored object, `resource` written as "group/version/plural" ("v1/plural" for core)."""
        *group_version, plural = resource.split("/")
        group, version = group_version if len(group_version) == 2 else ("", group_version[0])
        for (res, ns, obj_name), obj in self.k8s.objects.items():
            if (res.group, res.version, res.plural, ns, obj_name) == (
                group,
                version,
                plural,
                namespace,
                name,
            ):
                return None if obj.deleted else copy.deepcopy(dict(obj.raw))
        return None

    def events(self) -> list[dict]:
        return [
            dict(o.raw)
            for (res, _, _), o in self.k8s.objects.items()
            if res.plural == "events" and not o.deleted
        ]

    async def eventually(self, check, timeout: float = 15.0, what: str = "condition"):
        deadline = time.monotonic() + timeout
        while True:
            value = check()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            await asyncio.sleep(0.05)

    async def mark_ready(self, kind: str, name: str, namespace: str = "default", ready: int | None = None):
        """Play the workload controller: report the current spec fully rolled out (and `ready` pods ready)."""
        resource = "apps/v1/statefulsets" if kind == "StatefulSet" else "apps/v1/deployments"
        obj = self.live(resource, name, namespace)
        replicas = obj["spec"].get("replicas", 1)
        status = {
            "observedGeneration": obj["metadata"].get("generation", 1),
            "replicas": replicas,
            "updatedReplicas": replicas,
            "readyReplicas": replicas if ready is None else ready,
            "availableReplicas": replicas if ready is None else ready,
        }
        await self.api.patch_status("apps/v1", kind, namespace, name, status)
