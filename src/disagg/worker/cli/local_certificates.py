"""Certificates for `disagg up --peer-identity certificate`: a CA of this run, and for every child a
directory in cert-manager's layout (tls.crt, tls.key, ca.crt) whose certificate names the child
(common name = its worker id or "router"; DNS name SERVER_NAME, which peers check, since they are
reached by address). Made with the openssl command, keys in 0600 files under 0700 directories.
The CA's key stays in the run's secrets directory: whoever reads it could mint any identity, as
whoever holds a cluster issuer's key could."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

SERVER_NAME = "disagg-internal"
DAYS = "30"


def _openssl(cwd: Path, *args: str) -> None:
    try:
        subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"disagg up: openssl {args[0]} failed: {e.stderr.strip()[-500:]}") from None


def _private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


def issue(directory: Path, names: list[str]) -> dict[str, Path]:
    """A fresh CA in `directory`, and one certificate directory per name in `directory/<name>`."""
    if shutil.which("openssl") is None:
        raise SystemExit(
            "disagg up: --peer-identity certificate needs the openssl command (Debian: apt-get install openssl)"
        )
    ca = _private_dir(directory)
    old = os.umask(0o077)  # keys created 0600
    try:
        _openssl(ca, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                 "-keyout", "ca.key", "-out", "ca.crt", "-days", DAYS, "-subj", "/CN=disagg-up-ca")  # fmt: skip
        out = {}
        for name in names:
            d = _private_dir(ca / name)
            _openssl(d, "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                     "-keyout", "tls.key", "-out", "tls.csr", "-subj", f"/CN={name}")  # fmt: skip
            (d / "san.cnf").write_text(f"subjectAltName=DNS:{SERVER_NAME}\n")
            _openssl(d, "x509", "-req", "-in", "tls.csr", "-CA", str(ca / "ca.crt"), "-CAkey", str(ca / "ca.key"),
                     "-CAcreateserial", "-out", "tls.crt", "-days", DAYS, "-extfile", "san.cnf")  # fmt: skip
            shutil.copyfile(ca / "ca.crt", d / "ca.crt")
            out[name] = d
    finally:
        os.umask(old)
    return out
