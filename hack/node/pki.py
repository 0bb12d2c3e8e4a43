"""A throwaway CA and the certificates of the rig's cluster, made with openssl: the API server's
serving certificate (valid for the loopback, the link address the node reaches it on and the
`kubernetes` Service), client certificates in the groups Kubernetes' default RBAC expects of each
component, the kubelet's serving certificate, the service-account key pair and the admin token."""

from __future__ import annotations

import dataclasses
import secrets
from pathlib import Path

from . import proc


@dataclasses.dataclass(frozen=True)
class Cert:
    name: str
    subject: str
    server_names: tuple[str, ...] = ()  # subjectAltName entries: "IP:..." / "DNS:..."
    client: bool = True


def certs(node_name: str, node_ip: str, host_ip: str, kubernetes_ip: str, domain: str) -> list[Cert]:
    """Pure: what the cluster needs."""
    api_names = (
        "IP:127.0.0.1", f"IP:{host_ip}", f"IP:{kubernetes_ip}", "DNS:localhost", "DNS:kubernetes",
        "DNS:kubernetes.default", "DNS:kubernetes.default.svc", f"DNS:kubernetes.default.svc.{domain}",
    )  # fmt: skip
    return [
        Cert("apiserver", "/CN=kube-apiserver", api_names, client=False),
        Cert("apiserver-kubelet-client", "/O=system:masters/CN=kube-apiserver-kubelet-client"),
        Cert("kubelet", f"/O=system:nodes/CN=system:node:{node_name}"),
        Cert("kubelet-serving", f"/CN={node_name}", (f"IP:{node_ip}", f"DNS:{node_name}"), client=False),
        Cert("kube-proxy", "/CN=system:kube-proxy"),
        Cert("kube-controller-manager", "/CN=system:kube-controller-manager"),
        Cert("kube-scheduler", "/CN=system:kube-scheduler"),
    ]


def extensions(cert: Cert) -> str:
    """Pure: the openssl extension section of one certificate."""
    usage = "clientAuth" if cert.client else "serverAuth"
    lines = [
        "[ext]",
        "basicConstraints=critical,CA:FALSE",
        "keyUsage=critical,digitalSignature,keyEncipherment",
        f"extendedKeyUsage={usage}",
    ]
    if cert.server_names:
        lines.append("subjectAltName=" + ",".join(cert.server_names))
    return "\n".join(lines) + "\n"


def _openssl(*args: str) -> None:
    proc.run(["openssl", *args])


def make(pki: Path, wanted: list[Cert]) -> str:
    """Writes the CA, each certificate and key, sa.key/sa.pub and tokens.csv; returns the admin token."""
    pki.mkdir(parents=True, exist_ok=True)
    pki.chmod(0o700)
    ca_key, ca_crt = pki / "ca.key", pki / "ca.crt"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca_crt),
             "-days", "30", "-subj", "/CN=disagg-node-ca")  # fmt: skip
    for cert in wanted:
        key, csr, crt, ext = (pki / f"{cert.name}.{s}" for s in ("key", "csr", "crt", "ext"))
        ext.write_text(extensions(cert))
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(csr),
            "-subj",
            cert.subject,
        )
        _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca_crt), "-CAkey", str(ca_key), "-CAcreateserial",
                 "-out", str(crt), "-days", "30", "-extfile", str(ext), "-extensions", "ext")  # fmt: skip
        csr.unlink()
        ext.unlink()
    _openssl("genrsa", "-out", str(pki / "sa.key"), "2048")
    _openssl("rsa", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub"))
    token = secrets.token_hex(16)
    (pki / "tokens.csv").write_text(f'{token},admin,admin,"system:masters"\n')
    (pki / "admin.token").write_text(token + "\n")
    for path in pki.iterdir():
        path.chmod(0o600)
    return token
