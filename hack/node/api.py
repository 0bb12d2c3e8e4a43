"""A small Kubernetes API client (stdlib): the few reads and writes the rig makes itself — Node
status, the `kubernetes` EndpointSlice, Services and EndpointSlices for DNS, pods at teardown."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request


class ApiError(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class Api:
    def __init__(self, server: str, ca_file: str, token: str, timeout: float = 10.0):
        self.server = server.rstrip("/")
        self.token = token
        self.timeout = timeout
        self.context = ssl.create_default_context(cafile=ca_file)

    def request(
        self, method: str, path: str, body: dict | None = None, content_type: str = "application/json"
    ):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.server + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {self.token}")
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(req, context=self.context, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as err:
            raise ApiError(err.code, err.read().decode(errors="replace")[:500]) from None
        return json.loads(raw) if raw else None

    def get(self, path: str):
        return self.request("GET", path)

    def items(self, path: str) -> list[dict]:
        return self.get(path).get("items") or []

    def apply(self, path: str, name: str, body: dict, manager: str = "disagg-node") -> dict:
        """Server-side apply of one object at `path/name`."""
        return self.request(
            "PATCH", f"{path}/{name}?fieldManager={manager}&force=true", body, "application/apply-patch+yaml"
        )

    def delete(self, path: str, missing_ok: bool = True):
        try:
            return self.request("DELETE", path)
        except ApiError as err:
            if err.status == 404 and missing_ok:
                return None
            raise

    def ready(self) -> bool:
        req = urllib.request.Request(self.server + "/readyz")
        req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, context=self.context, timeout=2) as resp:
                return resp.status == 200
        except (OSError, urllib.error.URLError):
            return False
