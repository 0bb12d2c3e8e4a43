"""The data plane trusts only holders of the deployment's credential: every worker gRPC call and
/drain refuses a missing or wrong one; Redis refuses clients without its password; neither secret
appears in any process's command line or log; a client's X-Request-Id names nothing on the workers."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import httpx
import pytest
import redis

from disagg.proto import kv_transfer_pb2 as kv_pb
from disagg.proto import kv_transfer_pb2_grpc as kv_grpc
from disagg.proto import worker_pb2 as pb
from disagg.proto import worker_pb2_grpc as pb_grpc
from disagg.worker.engine.args import EngineArgs

from ..certificates import SERVER_NAME, issue, make_ca
from ..cluster import Cluster, threshold_placement

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory, secure_redis):
    # the gRPC KV transport: its KVTransfer service is on the workers' servers too
    c = Cluster(
        tiny_model,
        tmp_path_factory.mktemp("security"),
        redis_url=secure_redis.url,
        kv_transfer="grpc",
        worker_args=threshold_placement(8),
        deployment="security",
        env={"DISAGG_REDIS_PASSWORD": secure_redis.password},
    )
    try:
        yield c.start()
    finally:
        c.stop()


def _complete(cluster: Cluster, prompt, **extra) -> httpx.Response:
    body = {"model": cluster.model_name, "prompt": prompt, "max_tokens": 6, "temperature": 0, **extra}
    return httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=120)


CALLS = [
    ("Generate", lambda s: list(s.Generate(pb.GenerateRequest(request_id="x", prompt_token_ids=[5, 6]), timeout=5))),
    ("Prefill", lambda s: s.Prefill(pb.PrefillRequest(request_id="x", prompt_token_ids=[5]), timeout=5)),
    ("Handshake", lambda s: s.Handshake(pb.HandshakeRequest(worker_id="evil", payload=b"x"), timeout=5)),
    ("Abort", lambda s: s.Abort(pb.AbortRequest(request_id="x"), timeout=5)),
    ("Load", lambda s: s.Load(pb.LoadRequest(), timeout=5)),
    ("Health", lambda s: s.Health(pb.HealthRequest(), timeout=5)),
]  # fmt: skip


@pytest.mark.parametrize("token", [None, "wrong-token"], ids=["missing", "wrong"])
def test_worker_calls_without_the_credential_are_refused(cluster, secure_redis, token):
    for worker in ("decode-0", "prefill-0"):
        stub = cluster.stub(worker, token=token)
        for name, call in CALLS:
            with pytest.raises(grpc.RpcError) as info:
                call(stub)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, (worker, name, info.value)
        # the gRPC KV transport's service: no blocks pushed, no notice taken
        channel = grpc.insecure_channel(cluster.workers[worker].grpc_address)
        kv = kv_grpc.KVTransferStub(channel)
        metadata = () if token is None else (("authorization", f"Bearer {token}"),)
        chunk = kv_pb.KVBlockChunk(request_id="x", sender="evil", dst_block_ids=[0], last=True)
        notice = kv_pb.KVNotice(request_id="x", sender="evil")
        for method, request in ((kv.PushBlocks, iter([chunk])), (kv.Notify, notice)):
            with pytest.raises(grpc.RpcError) as info:
                method(request, timeout=5, metadata=metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        channel.close()
        # /drain: refused, and the worker stays in rotation
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        drain = cluster.workers[worker].health.replace("/health", "/drain")
        assert httpx.get(drain, headers=headers, timeout=5).status_code == 401
        assert httpx.get(cluster.workers[worker].health, timeout=5).status_code == 200
    assert cluster.metric("decode-0", "disagg_internal_auth_refused_total") >= len(CALLS) + 3
    # the router's worker list is internal too
    r = httpx.get(f"{cluster.url}/internal/workers", headers=headers, timeout=5)
    assert r.status_code == 401
    # with the credential every path works: a disaggregated completion, KV over gRPC
    assert cluster.stub("decode-0").Load(pb.LoadRequest(), timeout=5).worker_id == "decode-0"
    r = _complete(cluster, list(range(5, 45)))
    assert r.status_code == 200, r.text
    cluster.assert_prefilled_on(r, "prefill-0")
    cluster.assert_released(secure_redis.url)


def test_router_health_names_no_worker_or_address(cluster):
    body = httpx.get(f"{cluster.url}/health", timeout=5).json()
    text = json.dumps(body)
    for name, proc in cluster.workers.items():
        assert name not in text and proc.grpc_address not in text, body
    assert body["ready_workers"] == {"decode": 1, "prefill": 1}
    detail = httpx.get(f"{cluster.url}/internal/workers", headers=cluster.internal_headers, timeout=5).json()
    assert {w["id"] for w in detail["workers"]} == set(cluster.workers)


def test_worker_health_names_no_worker_address_or_load(cluster):
    for name, proc in cluster.workers.items():
        r = httpx.get(proc.health, timeout=5)
        assert r.status_code == 200 and r.json()["ready"] is True
        text = r.text
        assert name not in text and proc.grpc_address not in text and "load" not in text, text


def test_redis_refuses_clients_without_the_password(secure_redis):
    client = redis.Redis.from_url(secure_redis.url)
    try:
        with pytest.raises(redis.AuthenticationError):
            client.ping()
    finally:
        client.close()
    ok = redis.Redis.from_url(secure_redis.url, password=secure_redis.password)
    wrong = redis.Redis.from_url(secure_redis.url, password="not-it")
    try:
        with pytest.raises(redis.AuthenticationError):
            wrong.ping()
    finally:
        wrong.close()
    try:
        assert ok.ping()
        assert ok.config_get("protected-mode") == {"protected-mode": "yes"}
    finally:
        ok.close()


def test_duplicate_client_request_id_cannot_abort_another_stream(cluster, secure_redis):
    """While one client streams, others send the same X-Request-Id and hang up at once (the
    router then aborts their generation on the worker). The first stream is untouched: the
    router's own ids reach the workers, the client's id is only echoed back."""
    body = {"model": cluster.model_name, "prompt": list(range(7, 27)), "max_tokens": 300, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    headers = {"X-Request-Id": "same-id"}
    victim: dict = {"events": []}

    def victim_stream():
        with httpx.stream(
            "POST", f"{cluster.url}/v1/completions", json=body, headers=headers, timeout=120
        ) as r:
            victim["status"], victim["echo"] = r.status_code, r.headers.get("X-Request-Id")
            for line in r.iter_lines():
                if line.startswith("data: "):
                    victim["events"].append(line[6:])

    t = threading.Thread(target=victim_stream)
    t.start()
    while len(victim["events"]) < 3 and t.is_alive():
        threading.Event().wait(0.01)
    for i in range(40):  # hang up at different moments: before, during and after the worker call starts
        if not t.is_alive():
            break
        with contextlib.suppress(httpx.TimeoutException):
            httpx.post(f"{cluster.url}/v1/completions", json=body, headers=headers,
                       timeout=httpx.Timeout(5.0, read=0.002 * (1 + i % 20)))  # fmt: skip
    t.join(120)
    assert victim["status"] == 200 and victim["echo"] == "same-id"
    assert victim["events"][-1] == "[DONE]"
    finish = [json.loads(e)["choices"][0]["finish_reason"] for e in victim["events"][:-1]]
    assert finish[-1] == "length", victim["events"][-3:]
    cluster.assert_released(secure_redis.url)


def test_worker_without_a_credential_refuses_to_start(tiny_model):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISAGG_")}
    cmd = [sys.executable, "-m", "disagg.worker.cli", "worker", *EngineArgs.cli_args(model=str(tiny_model))]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "no internal credential" in r.stderr and "DISAGG_INTERNAL_TOKEN" in r.stderr, r.stderr
    r = subprocess.run([*cmd[:3], "router", "--model", str(tiny_model), "--workers", "127.0.0.1:1"],
                       env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode != 0 and "no internal credential" in r.stderr, r.stderr


def test_redis_url_password_is_scrubbed_from_errors_and_logs(caplog):
    from disagg.worker.kv_state import KVState, RedisUnavailable

    state = KVState("redis://:s3cr3t%2Fpw@127.0.0.1:1/0", "x", "w")
    with pytest.raises(RedisUnavailable) as info:
        state.workers()
    assert "s3cr3t" not in str(info.value) and "***" in str(info.value)
    assert "s3cr3t" not in caplog.text
    state.close()


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _descendants(pid: int) -> list[int]:
    out = []
    for child in Path(f"/proc/{pid}/task").glob("*/children"):
        for c in child.read_text().split():
            out += [int(c), *_descendants(int(c))]
    return out


def test_no_secret_in_any_command_line_or_log(cluster, secure_redis):
    """After serving (and refusing) requests, neither the Redis password nor the internal token
    appears in the command line of any process of the deployment or in any of their logs."""
    assert _complete(cluster, list(range(9, 60))).status_code == 200
    assert httpx.get(f"{cluster.url}/internal/workers", timeout=5).status_code == 401
    pids = [p.popen.pid for p in cluster.procs()] + [secure_redis.proc.pid]
    pids += [d for pid in pids for d in _descendants(pid)]
    secrets_ = (secure_redis.password, cluster.token)
    for pid in pids:
        line = _cmdline(pid)
        assert line, f"process {pid} is gone"
        for secret in secrets_:
            assert secret not in line, f"a secret is on the command line of {pid}: {line}"
    for proc in cluster.procs():
        text = proc.log.read_text(errors="replace")
        assert text, proc.name
        for secret in secrets_:
            assert secret not in text, f"a secret is in the log of {proc.name}"


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_grpc_over_mutual_tls(tiny_model, tmp_path, redis_server):
    tls = issue(make_ca(tmp_path / "ca"), tmp_path / "tls", SERVER_NAME)
    env = {"DISAGG_GRPC_TLS_DIR": str(tls), "DISAGG_GRPC_TLS_SERVER_NAME": SERVER_NAME}
    c = Cluster(tiny_model, tmp_path, redis_url=redis_server.url, kv_transfer="grpc",
                worker_args=threshold_placement(8), deployment="tls", env=env)  # fmt: skip
    try:
        c.start()
        r = _complete(c, list(range(5, 45)))
        assert r.status_code == 200, r.text
        c.assert_prefilled_on(r, "prefill-0")
        # plaintext, even with the token, does not get through
        with grpc.insecure_channel(c.workers["decode-0"].grpc_address) as ch:
            with pytest.raises(grpc.RpcError) as info:
                pb_grpc.WorkerStub(ch).Load(
                    pb.LoadRequest(), timeout=5, metadata=(("authorization", f"Bearer {c.token}"),)
                )
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert c.stub("decode-0").Load(pb.LoadRequest(), timeout=5).worker_id == "decode-0"  # over TLS
        # TLS without a client certificate signed by the CA is refused too
        creds = grpc.ssl_channel_credentials(root_certificates=(tls / "ca.crt").read_bytes())
        options = [("grpc.ssl_target_name_override", SERVER_NAME)]
        with grpc.secure_channel(c.workers["decode-0"].grpc_address, creds, options=options) as ch:
            with pytest.raises(grpc.RpcError):
                pb_grpc.WorkerStub(ch).Load(
                    pb.LoadRequest(), timeout=5, metadata=(("authorization", f"Bearer {c.token}"),)
                )
        c.assert_released(redis_server.url)
    finally:
        c.stop()
