"""The operator against a real cluster: CRD and RBAC from the chart, the `disagg operator` process,
the CPU example applied, scaled and deleted (children garbage-collected through owner references).

Needs DISAGG_TEST_KUBECONFIG; uses a throwaway namespace. Pods need not become ready (the worker
image may not be pullable from the cluster): the checks are on the objects and the status.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import subprocess
import sys
import time
import uuid

import helm_python as helm
import kopf
import pytest
import yaml

from disagg.operator.kube import Kube

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ROOT = pathlib.Path(__file__).resolve().parents[2]
IDEP = ("disagg.dev/v1alpha1", "InferenceDeployment")
USER = "disagg-cluster-test"  # the test's own field manager, as `kubectl apply --server-side` would be


async def eventually(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(1.0)


@pytest.fixture
async def kube():
    os.environ["KUBECONFIG"] = os.environ["DISAGG_TEST_KUBECONFIG"]
    conn = kopf.login_with_kubeconfig(settings=kopf.OperatorSettings())
    client = Kube(conn)
    yield client
    await client.close()


@pytest.fixture
async def namespace(kube):
    name = f"disagg-test-{uuid.uuid4().hex[:6]}"
    await kube.apply(
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}, field_manager=USER
    )
    yield name
    await kube.delete("v1", "Namespace", None, name)


@pytest.fixture
async def installed(kube, namespace):
    """The CRD and the namespaced RBAC, as the chart renders them."""
    with helm.Chart.load(ROOT / "charts" / "disagg") as chart:
        (crd,) = chart.crds
        rendered = chart.render({"watchNamespace": namespace}, name="disagg-test", namespace=namespace)
    await kube.apply(yaml.safe_load(crd["data"]), field_manager=USER)
    rbac = [d for d in yaml.safe_load_all(rendered["disagg/templates/rbac.yaml"]) if d]
    rbac += [d for d in yaml.safe_load_all(rendered["disagg/templates/serviceaccount.yaml"]) if d]
    for doc in rbac:
        await kube.apply(doc, field_manager=USER)
    await eventually(lambda: kube.serves("disagg.dev/v1alpha1", "inferencedeployments"), 60, "the CRD served")
    yield
    for doc in rbac:
        if doc["kind"] in ("ClusterRole", "ClusterRoleBinding"):
            await kube.delete(doc["apiVersion"], doc["kind"], None, doc["metadata"]["name"])


@pytest.fixture
def operator_process(installed, namespace, tmp_path):
    log = open(tmp_path / "operator.log", "w")  # noqa: SIM115  (closed below)
    env = dict(os.environ, KUBECONFIG=os.environ["DISAGG_TEST_KUBECONFIG"])
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "disagg.worker.cli",
            "operator",
            "--namespace",
            namespace,
            "--standalone",
            "--log-format",
            "plain",
            "--resync-seconds",
            "20",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    yield proc
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


async def test_cpu_example_lifecycle(kube, namespace, operator_process):
    body = yaml.safe_load((ROOT / "examples" / "cpu-tiny.yaml").read_text())
    body["metadata"]["namespace"] = namespace
    await kube.apply(body, field_manager=USER)

    async def children():
        found = [
            await kube.get("apps/v1", "StatefulSet", namespace, f"tiny-{role}")
            for role in ("prefill", "decode")
        ]
        return all(found) and await kube.get("apps/v1", "Deployment", namespace, "tiny-router")

    await eventually(children, 120, "the children")

    async def status():
        idep = await kube.get(*IDEP, namespace, "tiny")
        conditions = {c["type"] for c in (idep.get("status") or {}).get("conditions") or []}
        return conditions == {"Ready", "Progressing", "Degraded"} and idep["status"]["endpoint"]

    await eventually(status, 120, "the status conditions")
    idep = await kube.get(*IDEP, namespace, "tiny")
    assert "disagg.dev/finalizer" in idep["metadata"]["finalizers"]

    body["spec"]["decode"]["replicas"] = 2
    await kube.apply(body, field_manager=USER)

    async def scaled():
        sts = await kube.get("apps/v1", "StatefulSet", namespace, "tiny-decode")
        return sts["spec"]["replicas"] == 2

    await eventually(scaled, 120, "decode scaled to 2")

    await kube.delete(*IDEP, namespace, "tiny")

    async def collected():
        gone = [
            await kube.get("apps/v1", "StatefulSet", namespace, f"tiny-{r}") is None
            for r in ("prefill", "decode")
        ]
        return all(gone) and await kube.get(*IDEP, namespace, "tiny") is None

    await eventually(collected, 180, "deletion and garbage collection")
    assert operator_process.poll() is None, "the operator exited"
