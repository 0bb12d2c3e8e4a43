"""What the cluster suite does to a real API server besides running the operator: install the chart
with Helm's library, mint the chart ServiceAccount's token, run `disagg operator` with it, serve a
Prometheus API for the autoscaler, and read objects and Events back."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import subprocess
import sys
import time
import uuid

import helm_python as helm
import yaml
from aiohttp import web
from kubernetes_asyncio import config
from kubernetes_asyncio.client import Configuration

from disagg.operator.kube import Kube

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "disagg"
IDEP = ("disagg.dev/v1alpha1", "InferenceDeployment")
USER = "disagg-cluster-test"  # the test's own field manager, as `kubectl apply --server-side` would be
RELEASE = "disagg-test"  # the chart's objects (and its ServiceAccount) take this name


def admin_kubeconfig() -> str:
    return os.environ["DISAGG_TEST_KUBECONFIG"]


def client(kubeconfig: str) -> Kube:
    async def load() -> Configuration:
        cfg = Configuration()
        await config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        return cfg

    return Kube(load)


async def eventually(check, timeout: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(interval)


def new_namespace() -> str:
    return f"disagg-test-{uuid.uuid4().hex[:6]}"


def helm_config(namespace: str) -> helm.Config:
    return helm.Config(kubeconfig_path=admin_kubeconfig(), namespace=namespace)


def chart_values(namespace: str, **extra) -> dict:
    # No operator pod: the suite runs the operator process itself, with the chart's credentials.
    return {"watchNamespace": namespace, "replicaCount": 0, **extra}


async def service_account_kubeconfig(kube: Kube, namespace: str, path: pathlib.Path) -> pathlib.Path:
    """A kubeconfig holding a token of the chart's ServiceAccount (TokenRequest API, one hour)."""
    answer = await kube.request(
        "POST",
        f"/api/v1/namespaces/{namespace}/serviceaccounts/{RELEASE}/token",
        body={
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {"expirationSeconds": 3600},
        },
    )
    admin = yaml.safe_load(pathlib.Path(admin_kubeconfig()).read_text())
    context = next(c for c in admin["contexts"] if c["name"] == admin["current-context"])["context"]
    cluster = next(c for c in admin["clusters"] if c["name"] == context["cluster"])["cluster"]
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "cluster", "cluster": cluster}],
                "users": [{"name": RELEASE, "user": {"token": answer["status"]["token"]}}],
                "contexts": [{"name": "sa", "context": {"cluster": "cluster", "user": RELEASE}}],
                "current-context": "sa",
            }
        )
    )
    path.chmod(0o600)
    return path


def start_operator(kubeconfig: pathlib.Path, namespace: str, log: pathlib.Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBERNETES_", "DISAGG_"))}
    env.update(
        KUBECONFIG=str(kubeconfig),
        # Quick autoscaler ticks and windows, so a test sees several decisions in seconds.
        DISAGG_AUTOSCALER_INTERVAL_SECONDS="1",
        DISAGG_AUTOSCALER_WINDOW_SECONDS="2",
        DISAGG_AUTOSCALER_METRICS_PORT="0",
    )
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "disagg.worker.cli", "operator", "--namespace", namespace]
            # A resync far away: whatever comes back within seconds came back through a watch.
            + ["--standalone", "--log-format", "plain", "--resync-seconds", "600"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


class FakePrometheus:
    """A Prometheus HTTP API answering the autoscaler's queries: TTFT as set, traffic, fresh gauges."""

    def __init__(self):
        self.ttft_seconds = 2.0
        self.queries = 0
        self.port = 0

    async def query(self, request: web.Request) -> web.Response:
        self.queries += 1
        q = request.query["query"]
        if q.startswith("histogram_quantile"):
            value = self.ttft_seconds
        elif "timestamp(" in q:
            value = time.time()
        elif q.startswith("sum(increase("):
            value = 500.0
        else:
            value = 0.0  # queue waiting, KV use
        result = [{"metric": {}, "value": [time.time(), str(value)]}]
        return web.json_response({"status": "success", "data": {"resultType": "vector", "result": result}})


@contextlib.asynccontextmanager
async def fake_prometheus():
    prom = FakePrometheus()
    app = web.Application()
    app.router.add_get("/api/v1/query", prom.query)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    prom.port = site._server.sockets[0].getsockname()[1]
    try:
        yield prom
    finally:
        await runner.cleanup()


async def events(kube: Kube, namespace: str, name: str) -> list[dict]:
    """Events about the InferenceDeployment `name`."""
    found = await kube.request(
        "GET",
        f"/api/v1/namespaces/{namespace}/events",
        params={"fieldSelector": f"involvedObject.name={name},involvedObject.kind=InferenceDeployment"},
    )
    return found.get("items") or []


async def reasons(kube: Kube, namespace: str, name: str, reason: str) -> list[dict]:
    return [e for e in await events(kube, namespace, name) if e.get("reason") == reason]


def condition(obj: dict | None, ctype: str) -> dict:
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == ctype:
            return cond
    return {}


def example(name: str, namespace: str) -> dict:
    body = yaml.safe_load((ROOT / "examples" / "cpu-tiny.yaml").read_text())
    body["metadata"].update(name=name, namespace=namespace)
    return body


SERVICE_MONITOR_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "servicemonitors.monitoring.coreos.com"},
    "spec": {
        "group": "monitoring.coreos.com",
        "scope": "Namespaced",
        "names": {"kind": "ServiceMonitor", "plural": "servicemonitors", "singular": "servicemonitor"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                },
            }
        ],
    },
}
