"""The thin Kubernetes client: URL paths and TLS setup from kopf's connection info."""

from __future__ import annotations

import base64
import shutil
import ssl
import subprocess

import kopf
import pytest

from disagg.operator.kube import _ssl_context, object_path, resource_path


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


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_tls_context_loads_inline_client_certificates(tmp_path):
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(tmp_path / "key"),
            "-out",
            str(tmp_path / "cert"),
            "-days",
            "1",
            "-subj",
            "/CN=test",
        ],
        check=True,
        capture_output=True,
    )

    def b64(name):
        return base64.b64encode((tmp_path / name).read_bytes()).decode()

    conn = kopf.ConnectionInfo(
        server="https://api.example:6443",
        ca_data=b64("cert"),
        certificate_data=b64("cert"),
        private_key_data=b64("key"),
    )
    ctx = _ssl_context(conn)
    assert isinstance(ctx, ssl.SSLContext) and ctx.verify_mode == ssl.CERT_REQUIRED
    assert _ssl_context(kopf.ConnectionInfo(server="https://x", insecure=True)) is False
    broken = kopf.ConnectionInfo(
        server="https://x",
        certificate_data=b64("cert"),
        private_key_data=base64.b64encode(b"not a key").decode(),
    )
    with pytest.raises(ssl.SSLError):
        _ssl_context(broken)
