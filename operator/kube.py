"""The operator's few Kubernetes calls, over aiohttp, with kopf's connection credentials.

kopf's own API client is internal, so the operator keeps this thin layer: server-side apply,
get, list, status merge-patch, delete, and discovery. Credentials come from the same
`kopf.ConnectionInfo` the login handler hands to kopf; the reconciler and the autoscaler share
one instance (configured by the login handler, see `handlers.register`).
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import tempfile
from typing import Any

import aiohttp
import kopf

from disagg.operator.constants import FIELD_MANAGER

# Plural resource names of the kinds the operator reads or writes.
PLURALS = {
    "ServiceAccount": "serviceaccounts",
    "ConfigMap": "configmaps",
    "Secret": "secrets",
    "Pod": "pods",
    "Service": "services",
    "StatefulSet": "statefulsets",
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


class KubeError(RuntimeError):
    def __init__(self, status: int, method: str, url: str, message: str):
        super().__init__(f"{method} {url}: HTTP {status}: {message}")
        self.status = status


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


def _ssl_context(conn: kopf.ConnectionInfo) -> ssl.SSLContext | bool:
    if conn.insecure:
        return False
    cadata = base64.b64decode(conn.ca_data).decode() if conn.ca_data else None
    ctx = ssl.create_default_context(cafile=conn.ca_path, cadata=cadata)
    if conn.certificate_path or conn.certificate_data:
        # ssl loads client certificates only from files: inline kubeconfig data goes through a
        # private temporary directory that is removed right after loading.
        with tempfile.TemporaryDirectory(prefix="disagg-kube-") as tmp:
            cert = conn.certificate_path or _write(os.path.join(tmp, "cert"), conn.certificate_data)
            key = conn.private_key_path or (
                _write(os.path.join(tmp, "key"), conn.private_key_data) if conn.private_key_data else None
            )
            ctx.load_cert_chain(cert, key)
    return ctx


def _write(path: str, data: str) -> str:
    with open(path, "wb") as f:
        f.write(base64.b64decode(data))
    return path


class Kube:
    """An API client configured from a `kopf.ConnectionInfo` (set at login)."""

    def __init__(self, conn: kopf.ConnectionInfo | None = None):
        self._conn = conn
        self._session: aiohttp.ClientSession | None = None

    def configure(self, conn: kopf.ConnectionInfo) -> None:
        self._conn = conn
        self._session = None  # re-created with the new credentials on the next call

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _new_session(self) -> aiohttp.ClientSession:
        conn = self._conn
        if conn is None:
            raise RuntimeError("Kubernetes credentials are not known yet (the login handler has not run)")
        headers = {"Accept": "application/json"}
        auth = None
        if conn.token:
            headers["Authorization"] = f"{conn.scheme or 'Bearer'} {conn.token}"
        elif conn.username and conn.password:
            auth = aiohttp.BasicAuth(conn.username, conn.password)
        return aiohttp.ClientSession(
            base_url=conn.server.rstrip("/") + "/",
            headers=headers,
            auth=auth,
            connector=aiohttp.TCPConnector(ssl=_ssl_context(conn)),
            timeout=aiohttp.ClientTimeout(total=30),
        )

    async def _request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        content_type: str | None = None,
        params: dict | None = None,
        missing_ok: bool = False,
    ) -> dict | None:
        if self._session is None or self._session.closed:
            self._session = self._new_session()
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if content_type else None
        async with self._session.request(
            method, path.lstrip("/"), data=data, headers=headers, params=params
        ) as resp:
            text = await resp.text()
            if resp.status == 404 and missing_ok:
                return None
            if resp.status >= 400:
                try:
                    message = json.loads(text).get("message", text)
                except ValueError:
                    message = text
                raise KubeError(resp.status, method, path, message)
            return json.loads(text) if text else {}

    async def apply(self, obj: dict, field_manager: str = FIELD_MANAGER) -> dict:
        """Server-side apply as `field_manager` (the operator's by default), taking over conflicting fields.

        Fields this manager applied before and `obj` leaves out are removed: always apply whole objects.
        """
        return await self._request(
            "PATCH",
            object_path(obj),
            body=obj,
            content_type="application/apply-patch+yaml",
            params={"fieldManager": field_manager, "force": "true"},
        )

    async def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict | None:
        return await self._request("GET", resource_path(api_version, kind, namespace, name), missing_ok=True)

    async def list(self, api_version: str, kind: str, namespace: str, label_selector: str) -> list[dict]:
        found = await self._request(
            "GET",
            resource_path(api_version, kind, namespace),
            params={"labelSelector": label_selector},
            missing_ok=True,
        )
        return (found or {}).get("items") or []

    async def patch_status(
        self, api_version: str, kind: str, namespace: str, name: str, status: dict
    ) -> None:
        await self._request(
            "PATCH",
            resource_path(api_version, kind, namespace, name) + "/status",
            body={"status": status},
            content_type="application/merge-patch+json",
        )

    async def delete(self, api_version: str, kind: str, namespace: str | None, name: str) -> None:
        await self._request("DELETE", resource_path(api_version, kind, namespace, name), missing_ok=True)

    async def serves(self, api_version: str, plural: str) -> bool:
        """Whether the cluster serves a resource (e.g. ServiceMonitor only with the Prometheus Operator)."""
        base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        found = await self._request("GET", base, missing_ok=True)
        return bool(found) and any(r.get("name") == plural for r in found.get("resources", []))
