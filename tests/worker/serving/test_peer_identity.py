"""Per-worker identities: who a call acts for must be who its certificate names; the settings that
make it hold are checked at start; renewed certificates are taken up without a restart."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
from concurrent import futures

import grpc
import pytest

from disagg.worker.serving import auth
from disagg.worker.serving.peer_identity import REFUSED, PeerIdentity, check_own_certificate
from disagg.worker.serving.stubs import WorkerStubs

from ..certificates import SERVER_NAME, issue, make_ca

needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


class _Context:
    def __init__(self, common_name: str | None):
        self._ctx = {"transport_security_type": [b"ssl"]}
        if common_name is not None:
            self._ctx["x509_common_name"] = [common_name.encode()]

    def auth_context(self):
        return self._ctx


def _refused(method: str) -> float:
    return REFUSED.labels(method)._value.get()


def test_a_call_acting_for_another_worker_is_refused_and_counted():
    identity = PeerIdentity("certificate")
    before = _refused("Prefill")
    assert identity.refusal(_Context("decode-0"), "decode-0", "Prefill") is None
    message = identity.refusal(_Context("decode-1"), "decode-0", "Prefill")
    assert "'decode-0'" in message and "'decode-1'" in message
    assert "None" in identity.refusal(_Context(None), "decode-0", "Prefill")  # no client certificate
    assert _refused("Prefill") == before + 2


def test_with_the_deployment_token_any_holder_may_act_for_any_worker():
    assert PeerIdentity("token").refusal(_Context("decode-1"), "decode-0", "Prefill") is None
    assert PeerIdentity().refusal(_Context(None), "decode-0", "Handshake") is None


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    auth.add_cli_args(p)
    auth.add_peer_identity_arg(p)
    return p.parse_args(argv)


def test_certificate_identities_need_mutual_tls(tmp_path, monkeypatch):
    monkeypatch.setenv(auth.TOKEN_ENV, "t" * 32)
    with pytest.raises(auth.MissingCredential, match="--peer-identity certificate needs --grpc-tls-dir"):
        auth.from_cli_args(_args(["--peer-identity", "certificate"]), "disagg worker")
    for name in ("tls.crt", "tls.key"):  # TLS, but no CA to check callers' certificates with
        (tmp_path / name).write_bytes(b"-")
    with pytest.raises(auth.MissingCredential, match="ca.crt"):
        auth.from_cli_args(_args(["--peer-identity", "certificate", "--grpc-tls-dir", str(tmp_path)]), "w")
    (tmp_path / "ca.crt").write_bytes(b"-")
    made = auth.from_cli_args(_args(["--peer-identity", "certificate", "--grpc-tls-dir", str(tmp_path)]), "w")
    assert made.peer_identity == "certificate"
    monkeypatch.setenv(auth.PEER_IDENTITY_ENV, "certificate")
    assert _args([]).peer_identity == "certificate"  # the pods' setting, from the environment


@needs_openssl
def test_a_worker_whose_certificate_names_another_stops_at_start(tmp_path):
    ca = make_ca(tmp_path / "ca")
    check_own_certificate(str(issue(ca, tmp_path / "d0", "decode-0")), "decode-0")
    shared = issue(ca, tmp_path / "shared", SERVER_NAME)  # one certificate for the whole deployment
    with pytest.raises(SystemExit, match=f"names '{SERVER_NAME}', not this worker \\('decode-0'\\)"):
        check_own_certificate(str(shared), "decode-0")


def _echo_server(tls: auth.InternalAuth):
    server = grpc.server(futures.ThreadPoolExecutor(2))
    echo = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t", {"Echo": echo})])
    port = tls.add_port(server, "127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def _echo(address: str, client_dir) -> bytes:
    client = auth.InternalAuth(None, auth.TLSFiles.load(str(client_dir), SERVER_NAME))
    with client.channel(address) as channel:
        return channel.unary_unary("/t/Echo")(b"ping", timeout=10)


@needs_openssl
def test_renewed_certificates_serve_new_connections_without_a_restart(tmp_path):
    old_ca, new_ca = make_ca(tmp_path / "old-ca"), make_ca(tmp_path / "new-ca")
    served = issue(old_ca, tmp_path / "served", "prefill-0")
    files = auth.TLSDirectory(str(served), SERVER_NAME)
    assert files.current() is files.current()  # nothing re-read while nothing changed
    server, address = _echo_server(auth.InternalAuth(None, files))
    try:
        old_client, new_client = (
            issue(old_ca, tmp_path / "c1", "decode-0"),
            issue(new_ca, tmp_path / "c2", "decode-0"),
        )
        assert _echo(address, old_client) == b"ping"
        renewed = issue(new_ca, tmp_path / "renewed", "prefill-0")
        for name in auth.TLSDirectory.NAMES:  # written in place, as cert-manager renews a volume's files
            tmp = served / f".{name}"
            shutil.copy(renewed / name, tmp)
            os.replace(tmp, served / name)
        assert _echo(address, new_client) == b"ping"
        with pytest.raises(grpc.RpcError):  # the old CA no longer signs what the server trusts
            _echo(address, old_client)
        # and the clients this process makes present the renewed certificate too
        assert files.current().cert == (renewed / "tls.crt").read_bytes()
    finally:
        server.stop(None)


def test_worker_stubs_open_a_new_channel_once_the_certificate_is_renewed(tmp_path):
    for name in auth.TLSDirectory.NAMES:
        (tmp_path / name).write_bytes(b"old " + name.encode())
    stubs = WorkerStubs(auth.InternalAuth(None, auth.TLSDirectory(str(tmp_path))))

    async def channels():
        out = []
        for renew in (False, False, True):
            if renew:
                (tmp_path / "tls.crt").write_bytes(b"renewed certificate")
            stubs.stub("127.0.0.1:1")
            out.append(stubs._channels["127.0.0.1:1"][0])
        await stubs.close()
        return out

    first, again, renewed = asyncio.run(channels())
    assert first is again and renewed is not first


def test_a_renewal_caught_half_written_keeps_the_previous_files(tmp_path):
    for name in auth.TLSDirectory.NAMES:
        (tmp_path / name).write_bytes(name.encode())
    files = auth.TLSDirectory(str(tmp_path))
    first = files.current()
    (tmp_path / "tls.key").unlink()
    assert files.current() is first
    (tmp_path / "tls.key").write_bytes(b"new key")
    assert files.current().key == b"new key"
