"""The product as users run it, on a real node: the chart installs the operator pod, an
InferenceDeployment's pods run the project's own images on a real kubelet, a streamed chat goes
through its Service, KV moves between pods, the autoscaler adds and removes a prefill pod, a decode
pod dies mid-stream without a hung request, an image change rolls out decode first without a
failed request, and uninstalling leaves nothing. Every pod is admitted under `restricted`.

The tests run in file order against one installation (each step needs the previous one's state).
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import re
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass

import helm_python as helm
import httpx
import openai
import pytest
from cluster import CHART, IDEP, client, condition, eventually, example

from disagg.operator.kube import Kube

ROOT = pathlib.Path(__file__).resolve().parents[3]
RELEASE = "disagg"
NAME = "tiny"
STS = ("apps/v1", "StatefulSet")
DEPLOY = ("apps/v1", "Deployment")
INSTANCE = "app.kubernetes.io/instance"
COMPONENT = "app.kubernetes.io/component"
METRICS_PORT = 9100
# a prompt long enough to be prefilled remotely (above the disaggregation threshold), well
# inside the example's 512-token context
LONG_PROMPT = " ".join(f"word{i % 97}" for i in range(80))

pytestmark = pytest.mark.cluster


@dataclass
class Node:
    kubeconfig: str
    namespace: str
    helm: helm.Config


def kubeconfig() -> str:
    return os.environ["DISAGG_NODE_KUBECONFIG"]


async def _namespace(kube: Kube, name: str) -> None:
    # Pod Security admission enforces `restricted` here: a pod that fails it is never created.
    labels = {f"pod-security.kubernetes.io/{mode}": "restricted" for mode in ("enforce", "warn", "audit")}
    await kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}})


async def _gone(kube: Kube, namespace: str) -> None:
    async def deleted():
        return await kube.get("v1", "Namespace", None, namespace) is None

    await kube.request("DELETE", f"/api/v1/namespaces/{namespace}", missing_ok=True)
    await eventually(deleted, 300, f"namespace {namespace} deleted")


async def _delete_deployment(kube: Kube, ns: str) -> None:
    """Delete the InferenceDeployment and wait until it and its pods are gone (the operator
    removes its finalizer once the children are cleaned up)."""
    await kube.request(
        "DELETE", f"/apis/disagg.dev/v1alpha1/namespaces/{ns}/inferencedeployments/{NAME}", missing_ok=True
    )

    async def gone():
        if await kube.get(*IDEP, ns, NAME) is not None:
            return False
        return not await kube.list("v1", "Pod", ns, f"{INSTANCE}={NAME}")

    await eventually(gone, 180, "the InferenceDeployment and its pods gone", interval=2)


def _with_client(step, *args) -> None:
    """Run `await step(kube, *args)` with an API client of its own (module fixtures are sync)."""

    async def run():
        kube = client(kubeconfig())
        try:
            await step(kube, *args)
        finally:
            await kube.close()

    asyncio.run(run())


@pytest.fixture(scope="module")
def node():
    namespace = f"disagg-node-{uuid.uuid4().hex[:6]}"
    _with_client(_namespace, namespace)
    chart = helm.Chart.load(CHART)
    with chart, helm.Config(kubeconfig_path=kubeconfig(), namespace=namespace) as cfg:
        # a quick autoscaler, so that scaling shows within a minute
        values = {"watchNamespace": namespace, "autoscaler": {"intervalSeconds": 2, "windowSeconds": 6}}
        release = cfg.install(chart, RELEASE, values, timeout=180)
        assert release["status"] == "deployed"
        try:
            yield Node(kubeconfig(), namespace, cfg)
        finally:
            # the InferenceDeployment first: its finalizer needs the operator, which helm removes
            _with_client(_delete_deployment, namespace)
            try:
                cfg.uninstall(RELEASE, timeout=120)
            except Exception:  # already uninstalled by the last test
                pass
            _with_client(_gone, namespace)


@pytest.fixture
async def kube():
    admin = client(kubeconfig())
    yield admin
    await admin.close()


async def pods(kube: Kube, ns: str, component: str) -> list[dict]:
    return await kube.list("v1", "Pod", ns, f"{INSTANCE}={NAME},{COMPONENT}={component}")


def is_ready(pod: dict) -> bool:
    return pod["metadata"].get("deletionTimestamp") is None and any(
        c["type"] == "Ready" and c["status"] == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


async def ready_pods(kube: Kube, ns: str, component: str) -> list[dict]:
    return [p for p in await pods(kube, ns, component) if is_ready(p)]


async def service_url(kube: Kube, ns: str) -> str:
    svc = await kube.get("v1", "Service", ns, NAME)
    port = svc["spec"]["ports"][0]["port"]
    return f"http://{svc['spec']['clusterIP']}:{port}"


def scrape(pod: dict) -> dict[str, float]:
    """A worker pod's /metrics as {series: value} (pod IPs are routed to the node from here)."""
    text = httpx.get(f"http://{pod['status']['podIP']}:{METRICS_PORT}/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            out[series] = float(value)
    return out


def total(metrics: dict[str, float], name: str, **labels: str) -> float:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for s, v in metrics.items() if s.split("{")[0] == name and all(w in s for w in want))


def chat(url: str, prompt: str, max_tokens: int = 16, timeout: float = 120) -> tuple[str, str]:
    """One streamed chat completion with the OpenAI client: (text, finish_reason)."""
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=timeout, max_retries=0)
    text, finish = "", ""
    stream = api.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
    )
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


class Load:
    """Requests in background threads until stopped; counts what ended how."""

    def __init__(self, url: str, workers: int, prompt: str, max_tokens: int, pause: float = 0.0):
        self.url, self.prompt, self.max_tokens, self.pause = url, prompt, max_tokens, pause
        self.stop = threading.Event()
        self.ok = 0
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(workers)]

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                _text, finish = chat(self.url, self.prompt, self.max_tokens)
                with self._lock:
                    if finish in ("stop", "length"):
                        self.ok += 1
                    else:
                        self.errors.append(f"finish_reason {finish!r}")
            except Exception as exc:  # counted: the test decides which failures are allowed
                with self._lock:
                    self.errors.append(f"{type(exc).__name__}: {exc}")
            if self.pause:
                self.stop.wait(self.pause)

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(180)
        assert not any(t.is_alive() for t in self.threads), "a request hung"


# ---- install ------------------------------------------------------------------------------------


async def test_the_operator_pod_runs_under_its_uid_and_stays_up(node, kube):
    ns = node.namespace

    async def up():
        found = await kube.list("v1", "Pod", ns, f"app.kubernetes.io/name={RELEASE},{INSTANCE}={RELEASE}")
        return found if found and all(is_ready(p) for p in found) else None

    found = await eventually(up, 180, "the operator pod Ready")
    pod = found[0]
    assert pod["spec"]["securityContext"]["runAsUser"] == 65532
    await asyncio.sleep(10)  # a crash loop shows as restarts within seconds of Ready
    pod = await kube.get("v1", "Pod", ns, pod["metadata"]["name"])
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 0


async def test_the_cpu_example_serves_a_streamed_chat_through_its_service(node, kube):
    ns = node.namespace
    body = example(NAME, ns)
    spec = body["spec"]
    spec["decode"]["replicas"] = 2
    # the tiny model prefills faster here than a trip to the prefill pod, so the load placement
    # would keep prompts local: every prompt of 32+ uncached tokens goes to the prefill pod
    spec["kvTransfer"].update(prefillPlacement="threshold", disaggThreshold=32)
    for role in ("prefill", "decode"):  # a 2-core node: small requests so that every pod fits
        spec[role]["resources"]["requests"]["cpu"] = "100m"
    await kube.apply(body, field_manager="node-test")

    async def ready():
        idep = await kube.get(*IDEP, ns, NAME)
        return condition(idep, "Ready").get("status") == "True"

    await eventually(ready, 420, f"{NAME} Ready", interval=2)
    assert len(await ready_pods(kube, ns, "decode")) == 2
    url = await service_url(kube, ns)
    text, finish = await asyncio.to_thread(chat, url, "The capital of France is", 24)
    assert text and finish in ("stop", "length")


async def test_a_prompt_is_prefilled_on_the_prefill_pod_and_its_kv_bytes_counted_on_both_sides(node, kube):
    ns = node.namespace
    prefill = await ready_pods(kube, ns, "prefill")
    decode = await ready_pods(kube, ns, "decode")
    before_sent = sum(total(scrape(p), "disagg_kv_transfer_bytes_total", direction="send") for p in prefill)
    before_recv = sum(total(scrape(p), "disagg_kv_transfer_bytes_total", direction="recv") for p in decode)
    url = await service_url(kube, ns)
    await asyncio.to_thread(chat, url, LONG_PROMPT, 4)
    sent = (
        sum(total(scrape(p), "disagg_kv_transfer_bytes_total", direction="send") for p in prefill)
        - before_sent
    )
    recv = (
        sum(total(scrape(p), "disagg_kv_transfer_bytes_total", direction="recv") for p in decode)
        - before_recv
    )
    assert sent > 0 and sent == recv, (sent, recv)


# ---- autoscaling --------------------------------------------------------------------------------


async def _replicas(kube: Kube, ns: str, role: str) -> int:
    sts = await kube.get(*STS, ns, f"{NAME}-{role}")
    return sts["spec"]["replicas"]


async def test_the_autoscaler_adds_a_prefill_pod_under_load_and_removes_it_after(node, kube):
    ns = node.namespace
    autoscaling = {
        "minReplicas": 1,
        "maxReplicas": 2,
        "target": {"ttftMilliseconds": 1},  # any request is over it: load scales up
        "scaleUp": {"stabilizationSeconds": 0},
        "scaleDown": {"stabilizationSeconds": 0},
    }
    await kube.request(
        "PATCH",
        f"/apis/disagg.dev/v1alpha1/namespaces/{ns}/inferencedeployments/{NAME}",
        body={"spec": {"prefill": {"replicas": None, "autoscaling": autoscaling}}},
        content_type="application/merge-patch+json",
    )
    url = await service_url(kube, ns)

    async def two_ready():
        return await _replicas(kube, ns, "prefill") == 2 and len(await ready_pods(kube, ns, "prefill")) == 2

    with Load(url, workers=3, prompt=LONG_PROMPT, max_tokens=4) as load:
        await eventually(two_ready, 300, "a second prefill pod Ready under load", interval=1)
    assert load.ok > 0 and not load.errors, load.errors[:5]

    async def back_to_one():
        return await _replicas(kube, ns, "prefill") == 1 and len(await pods(kube, ns, "prefill")) == 1

    await eventually(back_to_one, 300, "the pool back to one prefill pod when idle", interval=1)


# ---- faults -------------------------------------------------------------------------------------


async def test_a_decode_pod_deleted_mid_stream_hangs_no_request_and_is_replaced(node, kube):
    ns = node.namespace
    url = await service_url(kube, ns)
    victim = (await ready_pods(kube, ns, "decode"))[0]["metadata"]["name"]
    with Load(url, workers=6, prompt="Tell me a long story.", max_tokens=400) as load:
        await asyncio.sleep(3)  # streams running on both decode pods
        await kube.request("DELETE", f"/api/v1/namespaces/{ns}/pods/{victim}")
        await asyncio.sleep(5)
    # every request ended: tokens, or an error the client saw (none hung: Load joins its threads)
    assert load.ok > 0
    for error in load.errors:
        assert re.search(
            r"APIError|APIStatusError|InternalServerError|ServiceUnavailable|finish_reason", error
        ), error

    async def replaced():
        found = await ready_pods(kube, ns, "decode")
        return len(found) == 2 and any(p["metadata"]["name"] == victim for p in found)

    await eventually(replaced, 300, "the StatefulSet replaced the deleted decode pod", interval=2)

    async def settled():
        workers = await ready_pods(kube, ns, "decode") + await ready_pods(kube, ns, "prefill")
        for pod in workers:
            m = scrape(pod)
            if total(m, "disagg_num_requests_running") or total(m, "disagg_kv_blocks_used"):
                return False
        return True

    await eventually(settled, 60, "no running request and no KV block held on any worker", interval=2)


# ---- rollout ------------------------------------------------------------------------------------


def _image_of(pod: dict) -> str:
    return pod["spec"]["containers"][0]["image"]


async def test_an_image_change_rolls_out_decode_first_with_no_failed_request(node, kube):
    ns = node.namespace
    idep = await kube.get(*IDEP, ns, NAME)
    repository, tag = idep["spec"]["image"]["repository"], idep["spec"]["image"]["tag"]
    new_tag = f"{tag}-rollout"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "hack" / "node" / "rig.py"),
            "tag",
            f"{repository}:{tag}",
            f"{repository}:{new_tag}",
        ],
        check=True,
    )
    new_image = f"{repository}:{new_tag}"
    url = await service_url(kube, ns)
    first_new: dict[str, float] = {}
    all_new: dict[str, float] = {}
    with Load(url, workers=1, prompt="Say hello.", max_tokens=8, pause=0.5) as load:
        await kube.request(
            "PATCH",
            f"/apis/disagg.dev/v1alpha1/namespaces/{ns}/inferencedeployments/{NAME}",
            body={"spec": {"image": {"tag": new_tag}}},
            content_type="application/merge-patch+json",
        )

        async def rolled():
            now = time.monotonic()
            for role in ("decode", "prefill"):
                found = await pods(kube, ns, role)
                images = [_image_of(p) for p in found]
                if new_image in images:
                    first_new.setdefault(role, now)
                if found and all(i == new_image for i in images) and all(is_ready(p) for p in found):
                    all_new.setdefault(role, now)
            return len(all_new) == 2

        await eventually(rolled, 600, "decode and prefill rolled out to the new image", interval=1)
        await asyncio.sleep(3)
    assert all_new["decode"] <= first_new["prefill"], (first_new, all_new)
    assert load.ok > 0 and not load.errors, load.errors[:5]


# ---- uninstall ----------------------------------------------------------------------------------


async def test_uninstalling_and_deleting_the_namespace_leave_nothing(node, kube):
    ns = node.namespace
    await _delete_deployment(kube, ns)
    node.helm.uninstall(RELEASE, timeout=120)
    await _gone(kube, ns)
    selector = f"{INSTANCE}={RELEASE}"
    for api_version, kind in (
        ("rbac.authorization.k8s.io/v1", "ClusterRole"),
        ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"),
    ):
        path = f"/apis/{api_version}/{kind.lower()}s"
        found = await kube.request("GET", path, params={"labelSelector": selector})
        assert not found.get("items"), (kind, [i["metadata"]["name"] for i in found["items"]])
