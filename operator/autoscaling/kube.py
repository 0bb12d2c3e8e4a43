"""The three Kubernetes calls the autoscaler makes, over kopf's own authenticated client.

Going through kopf's client means the autoscaler uses exactly the credentials, retries and
timeouts the operator logged in with (in-cluster token, kubeconfig, or a test API server),
with no second Kubernetes client to configure.
"""

from __future__ import annotations

import logging
import urllib.parse

import kopf
from kopf._cogs.clients import api as kopf_api
from kopf._cogs.clients import errors as kopf_errors

MERGE_PATCH = {"Content-Type": "application/merge-patch+json"}
IDEP_PATH = "/apis/disagg.dev/v1alpha1/namespaces/{namespace}/inferencedeployments/{name}"


class KopfKube:
    """Pods and StatefulSets through the client kopf authenticated."""

    def __init__(
        self, logger: logging.Logger | logging.LoggerAdapter, settings: kopf.OperatorSettings | None = None
    ):
        self.logger = logger
        self.settings = settings or kopf.OperatorSettings()

    async def list_pods(self, namespace: str, labels: dict[str, str]) -> list[dict]:
        selector = ",".join(f"{k}={v}" for k, v in labels.items())
        url = f"/api/v1/namespaces/{namespace}/pods?" + urllib.parse.urlencode({"labelSelector": selector})
        body = await kopf_api.get(url, settings=self.settings, logger=self.logger)
        items = body.get("items") or []
        # Filter here as well: not every API server (nor every test double) applies selectors.
        return [
            p
            for p in items
            if all(((p.get("metadata") or {}).get("labels") or {}).get(k) == v for k, v in labels.items())
        ]

    async def get_statefulset(self, namespace: str, name: str) -> dict | None:
        try:
            return await kopf_api.get(
                f"/apis/apps/v1/namespaces/{namespace}/statefulsets/{name}",
                settings=self.settings,
                logger=self.logger,
            )
        except kopf_errors.APINotFoundError:
            return None

    async def get_deployment(self, namespace: str, name: str) -> dict | None:
        """The InferenceDeployment itself (fresh, not the copy a handler was given)."""
        try:
            return await kopf_api.get(
                IDEP_PATH.format(namespace=namespace, name=name), settings=self.settings, logger=self.logger
            )
        except kopf_errors.APINotFoundError:
            return None

    async def patch_status(self, namespace: str, name: str, status: dict) -> None:
        """Merge-patch the InferenceDeployment's status subresource."""
        await kopf_api.patch(
            IDEP_PATH.format(namespace=namespace, name=name) + "/status",
            payload={"status": status},
            headers=MERGE_PATCH,
            settings=self.settings,
            logger=self.logger,
        )

    async def scale_statefulset(self, namespace: str, name: str, replicas: int) -> None:
        await kopf_api.patch(
            f"/apis/apps/v1/namespaces/{namespace}/statefulsets/{name}",
            payload={"spec": {"replicas": replicas}},
            headers=MERGE_PATCH,
            settings=self.settings,
            logger=self.logger,
        )
