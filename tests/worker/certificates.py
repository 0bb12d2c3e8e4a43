"""Test certificates in cert-manager's layout (tls.crt, tls.key, ca.crt per directory), made with
the openssl command: one CA, and a certificate per holder whose common name is its identity."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

SERVER_NAME = "disagg-internal"  # the DNS name every certificate carries (peers are reached by IP)


def _ssl(cwd: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(directory: Path) -> Path:
    directory.mkdir(parents=True)
    _ssl(directory, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
         "-days", "1", "-subj", "/CN=disagg-test-ca")  # fmt: skip
    return directory


def issue(ca: Path, directory: Path, common_name: str) -> Path:
    """`directory` holding a certificate for `common_name` (and SERVER_NAME) signed by `ca`."""
    directory.mkdir(parents=True)
    _ssl(directory, "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "tls.key", "-out", "tls.csr",
         "-subj", f"/CN={common_name}")  # fmt: skip
    (directory / "ext.cnf").write_text(f"subjectAltName=DNS:{SERVER_NAME}\n")
    _ssl(directory, "x509", "-req", "-in", "tls.csr", "-CA", str(ca / "ca.crt"), "-CAkey", str(ca / "ca.key"),
         "-CAcreateserial", "-out", "tls.crt", "-days", "1", "-extfile", "ext.cnf")  # fmt: skip
    shutil.copy(ca / "ca.crt", directory / "ca.crt")
    return directory
