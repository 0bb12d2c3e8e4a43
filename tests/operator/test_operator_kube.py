"""The operator's API client: paths, retries, pagination and credential refresh, against a small HTTP
server that answers as an API server under load would (429 with Retry-After, 5xx, write races,
expired continue tokens, expired tokens)."""

from __future__ import annotations

import base64
import contextlib
import datetime
import os
import shutil
import subprocess

import kopf
import pytest
from aiohttp import web
from kubernetes_asyncio.config import incluster_config

from disagg.operator import credentials
from disagg.operator.kube import Kube, KubeError, Retry, object_path, resource_path

FAST = Retry(attempts=4, base_seconds=0.01, max_seconds=0.05)


def test_resource_paths():
    assert resource_path("v1", "Service", "ns", "api") == "/api/v1/namespaces/ns/services/api"
    assert resource_path("apps/v1", "StatefulSet", "ns") == "/apis/apps/v1/namespaces/ns/statefulsets"
    assert resource_path("v1", "Namespace", None, "ns") == "/api/v1/namespaces/ns"
    assert object_path(
        {
            "apiVersion": "disagg.dev/v1alpha1",
            "kind": "InferenceDeployment",
            "metadata": {"name": "x", "namespace": "ns"},
        }
    ) == ("/apis/disagg.dev/v1alpha1/namespaces/ns/inferencedeployments/x")


def test_backoff_is_capped_and_honours_retry_after():
    retry = Retry(base_seconds=0.2, max_seconds=10)
    assert retry.delay(0, "3") == 3.0
    assert retry.delay(0, "600") == 10
    assert 0.1 <= retry.delay(0) <= 0.2
    assert 5 <= retry.delay(20) <= 10


class FakeApiServer:
    """Answers from a script: each request pops the next (status, body, headers) for its path."""

    def __init__(self):
        self.script: dict[str, list[tuple[int, dict, dict]]] = {}
        self.seen: list[tuple[str, str, dict, str | None]] = []  # method, path, query, Authorization

    async def handle(self, request: web.Request) -> web.Response:
        self.seen.append(
            (request.method, request.path, dict(request.query), request.headers.get("Authorization"))
        )
        queue = self.script.get(request.path) or [(200, {}, {})]
        status, body, headers = queue.pop(0) if len(queue) > 1 else queue[0]
        if callable(body):
            body = body(request)
        return web.json_response(body, status=status, headers=headers)


@contextlib.asynccontextmanager
async def fake_api():
    fake = FakeApiServer()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fake.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield fake, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


STS = "/apis/apps/v1/namespaces/ns/statefulsets/web"
OBJ = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "web", "namespace": "ns"}}


async def test_throttled_and_failing_calls_are_retried():
    async with fake_api() as (fake, url):
        fake.script[STS] = [
            (429, {"message": "slow down"}, {"Retry-After": "0"}),
            (503, {"message": "etcd leader change"}, {}),
            (500, {"message": "internal"}, {}),
            (200, {"metadata": {"name": "web"}}, {}),
        ]
        kube = Kube(kopf.ConnectionInfo(server=url, insecure=True), retry=FAST)
        try:
            assert (await kube.get("apps/v1", "StatefulSet", "ns", "web"))["metadata"]["name"] == "web"
            assert len(fake.seen) == 4
            fake.script[STS] = [(503, {"message": "down"}, {})]
            with pytest.raises(KubeError) as err:
                await kube.get("apps/v1", "StatefulSet", "ns", "web")
            assert err.value.status == 503 and len(fake.seen) == 4 + FAST.attempts
            fake.script[STS] = [(422, {"message": "spec.replicas: Invalid value"}, {})]
            with pytest.raises(KubeError, match="Invalid value"):
                await kube.apply(OBJ)
            assert len(fake.seen) == 5 + FAST.attempts  # a refusal is not retried
        finally:
            await kube.close()


async def test_a_write_race_is_retried_but_a_failed_precondition_is_not():
    async with fake_api() as (fake, url):
        race = (409, {"message": "the object has been modified"}, {})
        fake.script[STS] = [race, (200, {"metadata": {"name": "web"}}, {})]
        kube = Kube(kopf.ConnectionInfo(server=url, insecure=True), retry=FAST)
        try:
            await kube.apply(OBJ)
            assert [s[0] for s in fake.seen] == ["PATCH", "PATCH"]
            assert fake.seen[0][2] == {"fieldManager": "disagg-operator", "force": "true"}
            fake.script[STS] = [race]
            guarded = {**OBJ, "metadata": {**OBJ["metadata"], "resourceVersion": "7"}}
            with pytest.raises(KubeError) as err:
                await kube.apply(guarded)
            assert err.value.status == 409 and len(fake.seen) == 3
        finally:
            await kube.close()


async def test_lists_are_read_page_by_page_and_restart_after_an_expired_token():
    path = "/apis/apps/v1/namespaces/ns/statefulsets"

    def page(request):
        token = request.query.get("continue", "")
        assert request.query["limit"] == "500" and request.query["labelSelector"] == "a=b"
        following = {"": "p2", "p2": "p3", "p3": ""}[token]
        return {"metadata": {"continue": following}, "items": [{"metadata": {"name": token or "p1"}}]}

    async with fake_api() as (fake, url):
        fake.script[path] = [(200, page, {})]
        kube = Kube(kopf.ConnectionInfo(server=url, insecure=True), retry=FAST)
        try:
            items = await kube.list("apps/v1", "StatefulSet", "ns", "a=b")
            assert [i["metadata"]["name"] for i in items] == ["p1", "p2", "p3"]
            assert items[0]["kind"] == "StatefulSet"
            expired = (410, {"message": "continue token expired"}, {})
            fake.script[path] = [(200, page, {}), expired, (200, page, {})]
            items = await kube.list("apps/v1", "StatefulSet", "ns", "a=b")
            assert [i["metadata"]["name"] for i in items] == ["p1", "p2", "p3"]  # no page twice
        finally:
            await kube.close()


async def test_the_service_account_token_is_reread_as_it_rotates(tmp_path, monkeypatch):
    """In a pod: the token file is read again once a minute (the kubelet rotates bound tokens),
    and at once after a 401."""
    token = tmp_path / "token"
    ca = tmp_path / "ca.crt"
    token.write_text("first")
    ca.write_text("not read: the test server is plain HTTP")
    now = [datetime.datetime(2030, 1, 1)]

    class Clock(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return now[0]

    monkeypatch.setattr(incluster_config.datetime, "datetime", Clock)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(token))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(ca))

    async with fake_api() as (fake, url):

        async def in_cluster():
            cfg = await credentials.from_environment()
            # The loader points at https://$KUBERNETES_SERVICE_HOST with the pod's CA; the test serves HTTP.
            cfg.host, cfg.ssl_ca_cert = url, None
            return cfg

        kube = Kube(in_cluster, retry=FAST)
        try:
            await kube.get("v1", "Pod", "ns", "p")
            token.write_text("second")
            await kube.get("v1", "Pod", "ns", "p")
            now[0] += datetime.timedelta(seconds=61)
            await kube.get("v1", "Pod", "ns", "p")
            assert [s[3] for s in fake.seen] == ["Bearer first", "Bearer first", "Bearer second"]

            token.write_text("third")
            fake.script["/api/v1/namespaces/ns/pods/p"] = [
                (401, {"message": "Unauthorized"}, {}),
                (200, {}, {}),
            ]
            await kube.get("v1", "Pod", "ns", "p")
            assert [s[3] for s in fake.seen[3:]] == ["Bearer second", "Bearer third"]
        finally:
            await kube.close()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
async def test_inline_kubeconfig_certificates_become_private_files(tmp_path):
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(tmp_path / "key")]
        + ["-out", str(tmp_path / "cert"), "-days", "1", "-subj", "/CN=test"],
        check=True,
        capture_output=True,
    )

    def b64(name):
        return base64.b64encode((tmp_path / name).read_bytes()).decode()

    conn = kopf.ConnectionInfo(
        server="https://api.example:6443/",
        ca_data=b64("cert"),
        certificate_data=b64("cert"),
        private_key_data=b64("key"),
        token="t",
    )
    cfg = await credentials.from_connection(conn)()
    assert cfg.host == "https://api.example:6443" and cfg.verify_ssl
    for path in (cfg.ssl_ca_cert, cfg.cert_file, cfg.key_file):
        assert os.stat(path).st_mode & 0o777 == 0o600 and os.path.getsize(path) > 0
    assert await cfg.get_api_key_with_prefix("BearerToken") == "Bearer t"
    again = await credentials.from_connection(conn)()
    assert again.cert_file != cfg.cert_file  # each client its own files
    kube = Kube(conn)
    try:
        await kube._api()  # the TLS context loads the certificate and its key
        await kube._api(reload=True)  # and again after a reload (the files are reused)
    finally:
        await kube.close()
