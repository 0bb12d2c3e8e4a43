"""The operator's Kubernetes calls, over `kubernetes_asyncio`'s API client.

kopf's own client is internal, so the operator keeps this small surface: server-side apply, get,
list (paginated), status merge-patch, delete (with a uid precondition), discovery. The transport,
TLS and credentials are `kubernetes_asyncio`'s (see `credentials`); on top of it every call:
- retries 429 and 5xx answers and connection errors with capped exponential backoff (honouring
  Retry-After), and 409 for requests that are safe to repeat (an apply without a resourceVersion
  precondition: the server reports a write race, the same apply settles it);
- reloads its credentials once after a 401 (a rotated service-account token, an expired exec
  credential) and repeats the call;
- lists in pages (`limit`/`continue`), starting over if the continue token expired (410).
The reconciler and the autoscaler share one instance.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass
from typing import Any

import aiohttp
import kopf
from kubernetes_asyncio.client import ApiClient, Configuration
from kubernetes_asyncio.client.exceptions import ApiException

from disagg.operator import credentials
from disagg.operator.constants import FIELD_MANAGER

# Plural resource names of the kinds the operator reads or writes.
PLURALS = {
    "ServiceAccount": "serviceaccounts",
    "ConfigMap": "configmaps",
    "Secret": "secrets",
    "NetworkPolicy": "networkpolicies",
    "Job": "jobs",
    "Pod": "pods",
    "Service": "services",
    "StatefulSet": "statefulsets",
    "LeaderWorkerSet": "leaderworkersets",
    "Deployment": "deployments",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "ServiceMonitor": "servicemonitors",
    "HorizontalPodAutoscaler": "horizontalpodautoscalers",
    "InferenceDeployment": "inferencedeployments",
    # Cluster-level kinds, for installing the CRD and RBAC (the cluster test suite).
    "Namespace": "namespaces",
    "CustomResourceDefinition": "customresourcedefinitions",
    "ClusterRole": "clusterroles",
    "ClusterRoleBinding": "clusterrolebindings",
    "Role": "roles",
    "RoleBinding": "rolebindings",
}
PAGE_SIZE = 500
RETRYABLE = frozenset({429, 500, 502, 503, 504})


class KubeError(RuntimeError):
    def __init__(self, status: int, method: str, url: str, message: str):
        super().__init__(f"{method} {url}: HTTP {status}: {message}")
        self.status = status


@dataclass(frozen=True)
class Retry:
    """How often and how long to retry a call the server may answer later."""

    attempts: int = 6  # tries in all
    base_seconds: float = 0.2
    max_seconds: float = 10.0

    def delay(self, attempt: int, retry_after: str | None = None) -> float:
        """Seconds before try `attempt + 1`: the server's Retry-After when given, else jittered backoff."""
        if retry_after:
            try:
                return min(float(retry_after), self.max_seconds)
            except ValueError:
                pass
        backoff = min(self.base_seconds * 2**attempt, self.max_seconds)
        return backoff * random.uniform(0.5, 1.0)


def retryable(status: int, *, repeatable_conflict: bool) -> bool:
    return status in RETRYABLE or (status == 409 and repeatable_conflict)


def resource_path(api_version: str, kind: str, namespace: str | None, name: str | None = None) -> str:
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    parts = [base]
    if namespace:
        parts.append(f"namespaces/{namespace}")
    parts.append(PLURALS[kind])
    if name:
        parts.append(name)
    return "/".join(parts)


def label_selector(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels.items())


def matches_labels(obj: dict, labels: dict[str, str]) -> bool:
    found = (obj.get("metadata") or {}).get("labels") or {}
    return all(found.get(k) == v for k, v in labels.items())


def object_path(obj: dict) -> str:
    meta = obj["metadata"]
    return resource_path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])


def _message(body: Any) -> str:
    try:
        return json.loads(body).get("message", body)
    except (TypeError, ValueError, AttributeError):
        return str(body)


class Kube:
    """An API client; credentials from `source` (a `kopf.ConnectionInfo` or a `credentials.Source`),
    by default the pod's service account or the kubeconfig."""

    def __init__(
        self,
        source: kopf.ConnectionInfo | credentials.Source | None = None,
        *,
        retry: Retry = Retry(),  # noqa: B008  (frozen)
        timeout_seconds: float = 30.0,
        user_agent: str = FIELD_MANAGER,
    ):
        self._source = self._as_source(source)
        self.user_agent = user_agent
        self.retry = retry
        self.timeout = timeout_seconds
        self._client: ApiClient | None = None
        self._stale = False
        self._loading = asyncio.Lock()

    @staticmethod
    def _as_source(source) -> credentials.Source:
        if source is None:
            return credentials.from_environment
        if isinstance(source, kopf.ConnectionInfo):
            return credentials.from_connection(source)
        return source

    def configure(self, source: kopf.ConnectionInfo | credentials.Source) -> None:
        """Use other credentials from the next call on (callable from any thread: kopf runs a
        synchronous login handler in a worker thread; the old client is closed by the next call)."""
        self._source = self._as_source(source)
        self._stale = True

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def _api(self, *, reload: bool = False) -> ApiClient:
        async with self._loading:
            if (reload or self._stale) and self._client is not None:
                await self._client.close()
                self._client = None
            self._stale = False
            if self._client is None:
                cfg: Configuration = await self._source()
                self._client = ApiClient(cfg)
                self._client.user_agent = self.user_agent
            return self._client

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        content_type: str = "application/json",
        params: dict | None = None,
        missing_ok: bool = False,
        repeatable_conflict: bool = False,
    ) -> dict | None:
        """One API call with the retries above; None for a 404 when `missing_ok`."""
        reloaded = False
        attempt = 0
        while True:
            client = await self._api()
            try:
                found = await client.call_api(
                    path,
                    method,
                    query_params=list((params or {}).items()),
                    header_params={"Content-Type": content_type, "Accept": "application/json"},
                    body=body,
                    auth_settings=["BearerToken"],
                    response_types_map={200: "object", 201: "object", 202: "object"},
                    _return_http_data_only=True,
                    _request_timeout=self.timeout,
                )
                return found if isinstance(found, dict) else {}
            except ApiException as exc:
                if exc.status == 404 and missing_ok:
                    return None
                if exc.status == 401 and not reloaded:
                    reloaded = True
                    await self._api(reload=True)
                    continue
                if not retryable(exc.status, repeatable_conflict=repeatable_conflict) or (
                    attempt + 1 >= self.retry.attempts
                ):
                    raise KubeError(exc.status, method, path, _message(exc.body)) from None
                retry_after = (exc.headers or {}).get("Retry-After")
            except (aiohttp.ClientError, TimeoutError) as exc:
                if attempt + 1 >= self.retry.attempts:
                    raise KubeError(0, method, path, f"{type(exc).__name__}: {exc}") from None
                retry_after = None
            await asyncio.sleep(self.retry.delay(attempt, retry_after))
            attempt += 1

    async def apply(self, obj: dict, field_manager: str = FIELD_MANAGER) -> dict:
        """Server-side apply as `field_manager` (the operator's by default), taking over conflicting fields.

        Fields this manager applied before and `obj` leaves out are removed: always apply whole objects.
        """
        guarded = bool((obj.get("metadata") or {}).get("resourceVersion"))
        return await self.request(
            "PATCH",
            object_path(obj),
            body=obj,
            content_type="application/apply-patch+yaml",
            params={"fieldManager": field_manager, "force": "true"},
            # A resourceVersion is a precondition: its 409 is the answer, not a race to retry.
            repeatable_conflict=not guarded,
        )

    async def create_only(self, obj: dict) -> bool:
        """POST `obj`; True when created, False when it already exists (409), which is left as it is.
        The answer is dropped: for a Secret it would carry the values back."""
        meta = obj["metadata"]
        try:
            await self.request(
                "POST", resource_path(obj["apiVersion"], obj["kind"], meta.get("namespace")), body=obj
            )
        except KubeError as exc:
            if exc.status == 409:
                return False
            raise
        return True

    async def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict | None:
        return await self.request("GET", resource_path(api_version, kind, namespace, name), missing_ok=True)

    async def list(self, api_version: str, kind: str, namespace: str, label_selector: str) -> list[dict]:
        """Every matching object, page by page (each item gets apiVersion and kind)."""
        path = resource_path(api_version, kind, namespace)
        items: list[dict] = []
        token = ""
        restarted = False
        while True:
            params = {"labelSelector": label_selector, "limit": str(PAGE_SIZE)}
            if token:
                params["continue"] = token
            try:
                page = await self.request("GET", path, params=params, missing_ok=True)
            except KubeError as exc:
                if exc.status != 410 or restarted:
                    raise
                # The continue token expired (compaction): start over from a fresh snapshot.
                restarted, items, token = True, [], ""
                continue
            if page is None:
                return []
            items += [{"apiVersion": api_version, "kind": kind, **i} for i in page.get("items") or []]
            token = (page.get("metadata") or {}).get("continue") or ""
            if not token:
                return items

    async def patch_status(
        self, api_version: str, kind: str, namespace: str, name: str, status: dict
    ) -> None:
        await self.request(
            "PATCH",
            resource_path(api_version, kind, namespace, name) + "/status",
            body={"status": status},
            content_type="application/merge-patch+json",
        )

    async def delete(
        self, api_version: str, kind: str, namespace: str | None, name: str, *, uid: str | None = None
    ) -> None:
        """Delete (dependents in the background); with `uid`, only that very object, not a namesake."""
        options: dict = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}
        if uid:
            options["preconditions"] = {"uid": uid}
        try:
            await self.request(
                "DELETE", resource_path(api_version, kind, namespace, name), body=options, missing_ok=True
            )
        except KubeError as exc:
            if not (uid and exc.status == 409):
                raise  # 409 with a uid: a namesake stands there now, and it is not ours to delete

    async def serves(self, api_version: str, plural: str) -> bool:
        """Whether the cluster serves a resource (e.g. ServiceMonitor only with the Prometheus Operator)."""
        base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        found = await self.request("GET", base, missing_ok=True)
        return bool(found) and any(r.get("name") == plural for r in found.get("resources", []))
