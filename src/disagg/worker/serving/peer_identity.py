"""Which worker an internal call comes from, when each worker holds its own certificate.

With `--peer-identity token` the internal credential is the deployment's: whoever holds it may act
for any worker. With `certificate`, each worker's TLS certificate names it (common name = its
worker id; in a cluster cert-manager's csi-driver issues one per pod), mutual TLS proves that the
caller holds the key of the certificate it presents, and a worker serves a call that acts for a
worker only from that worker: a `Prefill` writes KV only into the blocks of the decode worker
whose certificate called, a `Handshake` registers a KV transport only for the worker that sent
it, a gRPC KV push is accepted only from the sender it names. A compromised pod can then have
others write KV only into its own cache (docs/security.md says what is left).
"""

from __future__ import annotations

import logging
import ssl
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import Counter

log = logging.getLogger("disagg.peer_identity")

REFUSED = Counter(
    "disagg_peer_identity_refused",
    "Internal calls refused because the caller's certificate names another worker than the one "
    "the call acts for (a KV write into another worker's blocks, a handshake in another's name).",
    ["method"],
)


def caller_name(context) -> str | None:
    """The common name of the certificate the caller presented (None without mutual TLS)."""
    names = (context.auth_context() or {}).get("x509_common_name") or []
    return names[0].decode(errors="replace") if names else None


def certificate_name(path: Path) -> str | None:
    """The common name of the PEM certificate at `path`; None when Python cannot decode it here."""
    decode = getattr(getattr(ssl, "_ssl", None), "_test_decode_cert", None)  # CPython's own decoder
    if decode is None:
        return None
    subject = decode(str(path)).get("subject", ())
    return next((value for rdn in subject for key, value in rdn if key == "commonName"), None)


@dataclass(frozen=True)
class PeerIdentity:
    mode: str = "token"  # auth.PEER_IDENTITIES

    def refusal(self, context, acts_for: str, method: str) -> str | None:
        """Why `method`, acting for worker `acts_for`, is refused (None: it may proceed)."""
        if self.mode != "certificate":
            return None
        name = caller_name(context)
        if name == acts_for:
            return None
        REFUSED.labels(method).inc()
        return (f"{method} for worker {acts_for!r} refused: the caller's certificate names "
                f"{name!r}; a worker may act only for itself")  # fmt: skip


def check_own_certificate(tls_dir: str, worker_id: str) -> None:
    """With per-worker identities a worker's certificate must name it, or every peer would refuse
    it: stop at start, saying so, rather than fail each call later."""
    name = certificate_name(Path(tls_dir) / "tls.crt")
    if name is None:
        log.warning("could not read the common name of %s/tls.crt; peers check it", tls_dir)
    elif name != worker_id:
        raise SystemExit(
            f"disagg worker: --peer-identity certificate: the certificate in {tls_dir}/tls.crt names "
            f"{name!r}, not this worker ({worker_id!r}); issue each worker a certificate whose "
            "common name is its worker id (cert-manager's csi-driver: common-name ${POD_NAME})"
        )
