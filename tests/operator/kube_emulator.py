"""An in-memory Kubernetes API (kmock) with the two behaviours of a real API server the operator
relies on and the plain emulator lacks, and the real kopf runtime running our handlers against it.

- Server-side apply creates a missing object (the emulator answers 404 to a PATCH otherwise).
- A spec change bumps `metadata.generation`, so a workload's status lags its spec as in a cluster.
- Field ownership (`metadata.managedFields`, see `field_ownership`): an apply owns the fields it
  sets, conflicts with other owners unless forced, and REMOVES a field its manager stops applying
  when nobody else owns it (a StatefulSet then defaults to 1 replica, as in a cluster); a merge
  patch moves the fields it changes to its manager. An apply naming a stale
  `metadata.resourceVersion` is refused with 409.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import pathlib
import threading
import time

import aiohttp.web
import kmock
import kopf
import yaml
from field_ownership import Conflict, apply_patch, update_ownership
from kmock._internal import enums

from disagg.operator.kube import Kube
from disagg.operator.main import register_all
from disagg.operator.reconcile import Reconciler
from disagg.operator.settings import Settings

ROOT = pathlib.Path(__file__).resolve().parents[2]

IDEP_RESOURCE = "disagg.dev/v1alpha1/inferencedeployments"
TEST_CLIENT = "disagg-test"  # the User-Agent of the tests' own calls, told apart from the operator's
CHILD_VERBS = ["list", "watch", "get", "patch", "create", "delete"]
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
    "v1/services": {"kind": "Service", "namespaced": True, "verbs": CHILD_VERBS},
    "v1/configmaps": {"kind": "ConfigMap", "namespaced": True, "verbs": CHILD_VERBS},
    "v1/serviceaccounts": {"kind": "ServiceAccount", "namespaced": True, "verbs": CHILD_VERBS},
    "v1/secrets": {"kind": "Secret", "namespaced": True, "verbs": ["create"]},
    "networking.k8s.io/v1/networkpolicies": {
        "kind": "NetworkPolicy",
        "namespaced": True,
        "verbs": CHILD_VERBS,
    },
    "batch/v1/jobs": {"kind": "Job", "namespaced": True, "verbs": ["create"]},
    "v1/pods": {"kind": "Pod", "namespaced": True, "verbs": ["list", "get"]},
    "v1/events": {"kind": "Event", "namespaced": True, "verbs": ["create", "list"]},
    "policy/v1/poddisruptionbudgets": {
        "kind": "PodDisruptionBudget",
        "namespaced": True,
        "verbs": CHILD_VERBS,
    },
    "autoscaling/v2/horizontalpodautoscalers": {
        "kind": "HorizontalPodAutoscaler",
        "namespaced": True,
        "verbs": CHILD_VERBS,
    },
}
# Served only when a test asks for it (as a cluster with the Prometheus Operator would).
SERVICE_MONITORS = {
    "monitoring.coreos.com/v1/servicemonitors": {
        "kind": "ServiceMonitor",
        "namespaced": True,
        "verbs": CHILD_VERBS,
    }
}

# Served only when a test asks for it (as a cluster with LeaderWorkerSet installed would).
LEADER_WORKER_SETS = {
    "leaderworkerset.x-k8s.io/v1/leaderworkersets": {
        "kind": "LeaderWorkerSet",
        "namespaced": True,
        "subresources": ["status"],
        "verbs": CHILD_VERBS,
    }
}


# Defaults the API server fills in when a field is absent (only those the tests look at).
DEFAULTS = {"statefulsets": {("spec", "replicas"): 1}}


class ApiServerEmulator(kmock.KubernetesEmulator):
    _revision = 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.requests_seen: list[tuple[str, str]] = []
        # (client, group, resource[/subresource], RBAC verb) of every resource request; the client
        # is the User-Agent's product (`disagg-operator`, `kopf`, the tests' own `disagg-test`).
        self.calls: set[tuple[str, str, str, str]] = set()
        self.forbidden: set[tuple[str, str]] = set()  # (RBAC verb, plural) answered 403, as RBAC would

    def _record_call(self, request) -> None:
        if not request.resource.plural:
            return  # discovery (/apis/<group>/<version>): not an RBAC-checked resource
        method = str(request.method.value if hasattr(request.method, "value") else request.method).upper()
        if method == "GET":
            if request.params.get("watch") in ("true", "1"):
                verb = "watch"
            else:
                verb = "get" if request.name else "list"
        else:
            verb = {"POST": "create", "PATCH": "patch", "PUT": "update"}.get(method)
            if method == "DELETE":
                verb = "delete" if request.name else "deletecollection"
        resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
        client = request.headers.get("User-Agent", "unknown").split("/")[0].split(" ")[0]
        self.calls.add((client, request.resource.group, resource, verb))
        if (verb, resource) in self.forbidden:
            raise kmock.KubernetesError(status=403, reason="Forbidden", message=f"cannot {verb} {resource}")

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

    def _check_apply_precondition(self, request, live) -> None:
        wanted = ((request.data or {}).get("metadata") or {}).get("resourceVersion")
        have = (live.raw.get("metadata") or {}).get("resourceVersion")
        if wanted is not None and str(wanted) != str(have):
            raise kmock.KubernetesError(
                status=409, reason="Conflict", message=f"resourceVersion {wanted} is stale (now {have})"
            )

    def _track_fields(self, request, live) -> None:
        """Turn an apply into the patch a real API server would make of it, and keep managedFields."""
        content_type = request.headers.get("Content-Type", "")
        manager = (
            request.params.get("fieldManager") or request.headers.get("User-Agent", "unknown").split("/")[0]
        )
        if "apply-patch" in content_type:
            try:
                patch = apply_patch(
                    live.raw,
                    request.data,
                    manager,
                    force=request.params.get("force") == "true",
                    defaults=DEFAULTS.get(request.resource.plural, {}),
                )
            except Conflict as exc:
                raise kmock.KubernetesError(status=409, reason="Conflict", message=str(exc)) from None
            request.data.clear()  # the request itself is frozen; its body is not
            request.data.update(patch)
        else:
            update_ownership(live.raw, request.data, manager)

    async def _handle(self, request):
        if request.resource is not None:
            # (action, plural) of every resource request, for tests that count calls.
            self.requests_seen.append((str(request.action.value).lower(), request.resource.plural))
            self._record_call(request)
        if request.resource is not None and request.action == enums.action.UPDATE and request.name:
            self._check_revision_test(request)
            key = (request.resource, request.namespace, request.name)
            live = self._objects[key] if key in self._objects and not self._objects[key].deleted else None
            if live is not None and isinstance(request.data, dict) and request.subresource is None:
                if "apply-patch" in request.headers.get("Content-Type", ""):
                    self._check_apply_precondition(request, live)
                self._track_fields(request, live)
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
                    data = apply_patch(
                        {},
                        request.data,
                        request.params.get("fieldManager") or "unknown",
                        force=True,
                        defaults=DEFAULTS.get(request.resource.plural, {}),
                    )
                    data.setdefault("metadata", {})["generation"] = 1
                    # An apply that creates is authorized as `create` too by a real API server.
                    client = request.headers.get("User-Agent", "unknown").split("/")[0].split(" ")[0]
                    self.calls.add((client, request.resource.group, request.resource.plural, "create"))
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

    def __init__(self, k8s: ApiServerEmulator, api: Kube, reconciler, url: str = ""):
        self.k8s = k8s
        self.api = api
        self.reconciler = reconciler
        self.url = url

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


@contextlib.asynccontextmanager
async def emulated_api():
    """Just the emulated API server, with the resources the operator uses, and a client of it."""
    async with ApiServerEmulator() as k8s, kmock.Server(k8s) as server:
        for key, info in RESOURCES.items():
            k8s.resources[key] = info
        api = Kube(kopf.ConnectionInfo(server=str(server.url), insecure=True), user_agent=TEST_CLIENT)
        try:
            yield k8s, api
        finally:
            await api.close()


@contextlib.asynccontextmanager
async def running_operator(
    autoscaler_settings=None,
    extra_resources: dict | None = None,
    *,
    settings: Settings | None = None,
):
    """The operator (and, given its settings, the autoscaler sharing the operator's API client)
    in the real kopf runtime against the emulated API server.

    kmock serves in the test's event loop; kopf runs in its own thread and loop, as in production
    (kopf cancels every task started after it, which would include the test's own teardown).
    """
    async with ApiServerEmulator() as k8s, kmock.Server(k8s) as server:
        for key, info in {**RESOURCES, **(extra_resources or {})}.items():
            k8s.resources[key] = info
        conn = kopf.ConnectionInfo(server=str(server.url), insecure=True)
        registry = kopf.OperatorRegistry()
        # The process's own wiring (`disagg operator`), with the autoscaler only when asked for.
        disabled = {} if autoscaler_settings is not None else {"DISAGG_AUTOSCALER_DISABLED": "1"}
        register_all(
            registry,
            login=lambda **_: conn,
            resync_seconds=3600,
            autoscaler_settings=autoscaler_settings,
            env=disabled,
            settings=settings,
        )

        @kopf.on.startup(registry=registry, id="test-speed")
        def _fast_exit(settings: kopf.OperatorSettings, **_):
            # Do not keep a stopping test operator waiting for in-flight work it will never finish.
            settings.queueing.exit_timeout = 0.2
            settings.background.instant_exit_timeout = 0.2

        stop = threading.Event()
        thread = threading.Thread(
            target=lambda: asyncio.run(
                kopf.operator(registry=registry, clusterwide=True, standalone=True, stop_flag=stop)
            ),
            name="kopf",
            daemon=True,
        )
        thread.start()
        api = Kube(conn, user_agent=TEST_CLIENT)
        reconciler = Reconciler(Kube(conn, user_agent=TEST_CLIENT))
        try:
            yield Cluster(k8s, api, reconciler, str(server.url))
        finally:
            stop.set()
            await asyncio.to_thread(thread.join, 20)
            await api.close()
            await reconciler.kube.close()
            assert not thread.is_alive(), "the operator did not stop"
