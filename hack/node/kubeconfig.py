"""Kubeconfig documents (JSON, which every client reads as YAML). Pure."""

from __future__ import annotations

import base64
import json


def document(server: str, ca_pem: bytes, user: dict, name: str = "disagg-node") -> dict:
    """`user`: {"token": ...} or {"client-certificate-data": ..., "client-key-data": ...}."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": name,
                "cluster": {
                    "server": server,
                    "certificate-authority-data": base64.b64encode(ca_pem).decode(),
                },
            }
        ],
        "users": [{"name": name, "user": user}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": name}}],
        "current-context": name,
    }


def token_user(token: str) -> dict:
    return {"token": token}


def cert_user(cert_pem: bytes, key_pem: bytes) -> dict:
    return {
        "client-certificate-data": base64.b64encode(cert_pem).decode(),
        "client-key-data": base64.b64encode(key_pem).decode(),
    }


def render(server: str, ca_pem: bytes, user: dict) -> str:
    return json.dumps(document(server, ca_pem, user), indent=2) + "\n"
