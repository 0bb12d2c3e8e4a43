"""Per-worker identities on real processes: each worker holds its own certificate (common name =
its worker id) and `--peer-identity certificate`. A holder of the deployment's credential with a
valid certificate of its own cannot make a prefill worker write KV into another worker's blocks,
nor register a KV transport in another worker's name; the deployment's own paths still work."""

from __future__ import annotations

import shutil

import grpc
import httpx
import pytest

from disagg.proto import kv_transfer_pb2 as kv_pb
from disagg.proto import kv_transfer_pb2_grpc as kv_grpc
from disagg.proto import worker_pb2 as pb
from disagg.proto import worker_pb2_grpc as pb_grpc
from disagg.worker.serving.auth import InternalAuth, TLSFiles

from ..certificates import SERVER_NAME, issue, make_ca
from ..cluster import Cluster, threshold_placement

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command"),
]

INTRUDER = "decode-9"  # a valid certificate of the deployment's CA, for a worker that is not serving


@pytest.fixture(scope="module", params=["nixl", "grpc"])
def deployment(request, tiny_model, tmp_path_factory, redis_server):
    tmp = tmp_path_factory.mktemp(f"identity-{request.param}")
    ca = make_ca(tmp / "ca")
    c = Cluster(tiny_model, tmp, redis_url=redis_server.url, kv_transfer=request.param,
                worker_args=(*threshold_placement(8), "--peer-identity", "certificate"),
                deployment=f"identity-{request.param}", env={"DISAGG_GRPC_TLS_SERVER_NAME": SERVER_NAME})  # fmt: skip
    for (
        proc
    ) in c.procs():  # each process its own certificate, as cert-manager's csi-driver mounts one per pod
        proc.env = {**c.env, "DISAGG_GRPC_TLS_DIR": str(issue(ca, tmp / "certs" / proc.name, proc.name))}
    intruder = issue(ca, tmp / "certs" / INTRUDER, INTRUDER)
    try:
        c.start()
        yield c, request.param, intruder
    finally:
        c.stop()


def _complete(c: Cluster) -> httpx.Response:
    body = {"model": c.model_name, "prompt": list(range(5, 45)), "max_tokens": 6, "temperature": 0}
    r = httpx.post(f"{c.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    c.assert_prefilled_on(r, "prefill-0")  # went through the P/D path
    return r


def _channel(c: Cluster, worker: str, certificate) -> grpc.Channel:
    return InternalAuth(None, TLSFiles.load(str(certificate), SERVER_NAME)).channel(
        c.workers[worker].grpc_address
    )


def test_a_worker_acts_only_for_itself(deployment, redis_server):
    c, transport, intruder = deployment
    before = _complete(c).json()["choices"][0]["text"]
    decode_blocks = c.load("decode-0").total_blocks
    channel = _channel(c, "prefill-0", intruder)
    stub = InternalAuth(c.token).wrap(pb_grpc.WorkerStub(channel))  # it holds the deployment's credential

    # a KV transport registered in decode-0's name would take decode-0's prefills
    answer = stub.Handshake(pb.HandshakeRequest(worker_id="decode-0", payload=b"x"), timeout=10)
    assert answer.error.code == "permission_denied" and INTRUDER in answer.error.message, answer
    # nor does any Handshake answer say where the callee's own KV memory is
    assert [f.name for f in pb.HandshakeResponse.DESCRIPTOR.fields] == ["worker_id", "error"]
    # a Prefill naming decode-0's blocks: refused before any work
    poison = pb.PrefillRequest(request_id="poison", prompt_token_ids=list(range(5, 45)), decode_worker_id="decode-0",
                               dst_block_ids=list(range(min(3, decode_blocks))), transfer_id="poison:0:x")  # fmt: skip
    answer = stub.Prefill(poison, timeout=30)
    assert answer.error.code == "permission_denied", answer
    assert "'decode-0'" in answer.error.message and INTRUDER in answer.error.message
    # acting for itself it is not refused for who it is (it simply has no KV transport here)
    poison.decode_worker_id = INTRUDER
    assert stub.Prefill(poison, timeout=30).error.code != "permission_denied"
    assert c.metric("prefill-0", "disagg_peer_identity_refused_total", method="Prefill") == 1
    assert c.metric("prefill-0", "disagg_peer_identity_refused_total", method="Handshake") == 1
    channel.close()

    if transport == "grpc":  # pushes straight into decode-0's cache, in prefill-0's name
        channel = _channel(c, "decode-0", intruder)
        kv = kv_grpc.KVTransferStub(channel)
        metadata = (("authorization", f"Bearer {c.token}"),)
        chunk = kv_pb.KVBlockChunk(
            request_id="poison:0:x", sender="prefill-0-0badc0de", dst_block_ids=[0], last=True
        )
        notice = kv_pb.KVNotice(request_id="poison:0:x", sender="prefill-0-0badc0de")
        for method, request in ((kv.PushBlocks, iter([chunk])), (kv.Notify, notice)):
            with pytest.raises(grpc.RpcError) as info:
                method(request, timeout=5, metadata=metadata)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, info.value
            assert INTRUDER in info.value.details()
        for method in ("PushBlocks", "Notify"):
            assert c.metric("decode-0", "disagg_peer_identity_refused_total", method=method) == 1
        assert c.metric("decode-0", "disagg_kv_transfer_refused_total") >= 1
        channel.close()

    # the deployment's own paths are untouched: the same answer through prefill-0, nothing leaked
    assert _complete(c).json()["choices"][0]["text"] == before
    c.assert_released(redis_server.url)
