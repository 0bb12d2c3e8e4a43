"""Where the operator's API client gets its credentials: `kubernetes_asyncio`'s own loaders.

In a pod, the in-cluster loader reads the projected service-account token and re-reads the file
every minute (bound tokens expire and the kubelet rotates the file); elsewhere, the kubeconfig
loader (KUBECONFIG or ~/.kube/config, exec plugins included). A `kopf.ConnectionInfo` (what a
custom login handler returns, e.g. for an emulated API server) is turned into the same
`Configuration`. Each source is a coroutine function that loads afresh on every call, so the
client can reload after a 401.
"""

from __future__ import annotations

import base64
import os
import tempfile
from collections.abc import Awaitable, Callable

import kopf
from kubernetes_asyncio import config
from kubernetes_asyncio.client import Configuration
from kubernetes_asyncio.config.config_exception import ConfigException

Source = Callable[[], Awaitable[Configuration]]


async def from_environment() -> Configuration:
    """In-cluster service account first (with token refresh), then a kubeconfig."""
    cfg = Configuration()
    try:
        config.load_incluster_config(client_configuration=cfg, try_refresh_token=True)
    except ConfigException:
        try:
            await config.load_kube_config(client_configuration=cfg)
        except (ConfigException, OSError) as exc:
            raise kopf.LoginError(f"no service account token and no usable kubeconfig: {exc}") from exc
    return cfg


def _file(data: str, directory: str, name: str) -> str:
    path = os.path.join(directory, name)
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
        f.write(base64.b64decode(data))
    return path


def from_connection(conn: kopf.ConnectionInfo) -> Source:
    """A source that always yields `conn` (inline certificate data goes to private files, mode 0600,
    written once and kept for the process: the TLS context is built from files)."""
    files: dict[str, str] = {}

    def inline(name: str, data: str) -> str:
        if name not in files:
            directory = files.setdefault("", tempfile.mkdtemp(prefix="disagg-kube-"))
            files[name] = _file(data, directory, name)
        return files[name]

    async def load() -> Configuration:
        cfg = Configuration()
        cfg.host = conn.server.rstrip("/")
        cfg.verify_ssl = not conn.insecure
        if conn.token:
            cfg.api_key["BearerToken"] = conn.token
            cfg.api_key_prefix["BearerToken"] = conn.scheme or "Bearer"
        if conn.ca_path or conn.ca_data:
            cfg.ssl_ca_cert = conn.ca_path or inline("ca", conn.ca_data)
        if conn.certificate_path or conn.certificate_data:
            cfg.cert_file = conn.certificate_path or inline("cert", conn.certificate_data)
        if conn.private_key_path or conn.private_key_data:
            cfg.key_file = conn.private_key_path or inline("key", conn.private_key_data)
        return cfg

    return load
