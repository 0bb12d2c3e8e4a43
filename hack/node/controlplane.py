"""The control plane on the host's loopback: etcd (Debian's), kube-apiserver, kube-controller-manager
and kube-scheduler from $K8S_BIN, each component with its own certificate. The command lines are
pure functions; `start` runs them and waits for each to answer."""

from __future__ import annotations

import ssl
import urllib.request

from . import proc
from .layout import Layout
from .settings import Config

COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")


def etcd_args(cfg: Config, layout: Layout) -> list[str]:
    client, peer = f"http://127.0.0.1:{cfg.etcd_port}", f"http://127.0.0.1:{cfg.etcd_peer_port}"
    return [
        "etcd", "--name=disagg-node", f"--data-dir={layout.etcd_data}",
        f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=disagg-node={peer}", f"--quota-backend-bytes={2 << 30}",
        "--snapshot-count=10000",
    ]  # fmt: skip


def apiserver_args(cfg: Config, layout: Layout) -> list[str]:
    pki = layout.pki
    return [
        str(cfg.k8s_bin / "kube-apiserver"),
        f"--etcd-servers=http://127.0.0.1:{cfg.etcd_port}",
        "--bind-address=127.0.0.1",
        f"--advertise-address={cfg.host_ip}",
        f"--secure-port={cfg.api_port}",
        f"--tls-cert-file={pki}/apiserver.crt",
        f"--tls-private-key-file={pki}/apiserver.key",
        f"--client-ca-file={pki}/ca.crt",
        f"--token-auth-file={pki}/tokens.csv",
        "--authorization-mode=Node,RBAC",
        "--enable-admission-plugins=NodeRestriction",
        f"--service-account-issuer=https://kubernetes.default.svc.{cfg.cluster_domain}",
        f"--service-account-key-file={pki}/sa.pub",
        f"--service-account-signing-key-file={pki}/sa.key",
        f"--service-cluster-ip-range={cfg.service_cidr}",
        # the `kubernetes` EndpointSlice is the rig's (the relay's address), not the API server's
        "--endpoint-reconciler-type=none",
        f"--kubelet-client-certificate={pki}/apiserver-kubelet-client.crt",
        f"--kubelet-client-key={pki}/apiserver-kubelet-client.key",
        f"--kubelet-certificate-authority={pki}/ca.crt",
        "--kubelet-preferred-address-types=InternalIP",
        f"--cert-dir={layout.run}/apiserver-certs",
        "--profiling=false",
    ]


def controller_manager_args(cfg: Config, layout: Layout) -> list[str]:
    pki = layout.pki
    return [
        str(cfg.k8s_bin / "kube-controller-manager"),
        f"--kubeconfig={layout.kubeconfig_of('kube-controller-manager')}",
        "--bind-address=127.0.0.1",
        f"--secure-port={cfg.kcm_port}",
        "--leader-elect=false",
        f"--service-account-private-key-file={pki}/sa.key",
        f"--root-ca-file={pki}/ca.crt",
        "--use-service-account-credentials=true",
        "--controllers=*",
    ]


def scheduler_args(cfg: Config, layout: Layout) -> list[str]:
    return [
        str(cfg.k8s_bin / "kube-scheduler"),
        f"--kubeconfig={layout.kubeconfig_of('kube-scheduler')}",
        "--bind-address=127.0.0.1",
        f"--secure-port={cfg.scheduler_port}",
        "--leader-elect=false",
    ]


def _healthy(url: str, verify_ca: str | None = None) -> bool:
    ctx = ssl.create_default_context(cafile=verify_ca) if verify_ca else ssl._create_unverified_context()
    try:
        with urllib.request.urlopen(url, context=ctx if url.startswith("https") else None, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def start(cfg: Config, layout: Layout, api, say) -> None:
    layout.etcd_data.mkdir(parents=True, exist_ok=True)
    layout.etcd_data.chmod(0o700)
    proc.start(layout, "etcd", etcd_args(cfg, layout))
    proc.wait_for(lambda: _healthy(f"http://127.0.0.1:{cfg.etcd_port}/health"), 30, "etcd healthy")
    say("etcd healthy")
    proc.start(layout, "kube-apiserver", apiserver_args(cfg, layout))
    proc.wait_for(
        lambda: proc.must_live(layout, "kube-apiserver") and api.ready(), 120, "kube-apiserver ready"
    )
    say("kube-apiserver ready")
    proc.start(layout, "kube-controller-manager", controller_manager_args(cfg, layout))
    proc.start(layout, "kube-scheduler", scheduler_args(cfg, layout))
    for name, port in (("kube-controller-manager", cfg.kcm_port), ("kube-scheduler", cfg.scheduler_port)):
        proc.wait_for(lambda n=name, p=port: proc.must_live(layout, n) and _healthy(f"https://127.0.0.1:{p}/healthz"),
                      60, f"{name} healthy")  # fmt: skip
    say("kube-controller-manager and kube-scheduler healthy")


def stop(layout: Layout) -> list[str]:
    return [name for name in reversed(COMPONENTS) if proc.stop(layout, name)]
