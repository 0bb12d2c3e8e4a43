"""Where everything of the rig lives under its state folder. Pure: paths only."""

from __future__ import annotations

import dataclasses
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Layout:
    state: Path

    # ---- kept between `down` and `up` ----------------------------------------------------------
    @property
    def images(self) -> Path:
        """Base rootfs tarballs, step snapshots, built docker-archives (the image cache)."""
        return self.state / "images"

    @property
    def containerd_root(self) -> Path:
        """containerd's content and snapshots: imported images survive `down`."""
        return self.state / "containerd" / "root"

    @property
    def imported(self) -> Path:
        """Which build of each image containerd holds (beside the content it describes)."""
        return self.containerd_root / "imported.json"

    @property
    def logs(self) -> Path:
        return self.state / "logs"

    # ---- made by `up`, removed by `down` -------------------------------------------------------
    @property
    def run(self) -> Path:
        return self.state / "run"

    @property
    def pids(self) -> Path:
        return self.run / "pids"

    @property
    def host_record(self) -> Path:
        """What the host had before `up` changed it (sysctls, folders): `down` puts it back."""
        return self.state / "host.json"

    @property
    def pki(self) -> Path:
        return self.run / "pki"

    @property
    def etcd_data(self) -> Path:
        return self.run / "etcd"

    @property
    def containerd_state(self) -> Path:
        return self.run / "containerd"

    @property
    def containerd_socket(self) -> Path:
        return self.containerd_state / "containerd.sock"

    @property
    def containerd_config(self) -> Path:
        return self.run / "containerd.toml"

    @property
    def runc_root(self) -> Path:
        return self.containerd_state / "runc"

    @property
    def containerd_opt(self) -> Path:
        return self.run / "containerd-opt"

    @property
    def cni_conf_dir(self) -> Path:
        return self.run / "cni" / "net.d"

    @property
    def cni_ipam_dir(self) -> Path:
        return self.run / "cni" / "ipam"

    @property
    def kubelet_root(self) -> Path:
        return self.run / "kubelet"

    @property
    def kubelet_config(self) -> Path:
        return self.run / "kubelet.json"

    @property
    def pod_logs(self) -> Path:
        return self.run / "pod-logs"

    @property
    def proxy_config(self) -> Path:
        return self.run / "kube-proxy.json"

    @property
    def resolv_conf(self) -> Path:
        return self.run / "resolv.conf"

    @property
    def dns_hosts(self) -> Path:
        return self.run / "dns-hosts"

    @property
    def dnsmasq_pid(self) -> Path:
        return self.run / "dnsmasq.pid"

    def kubeconfig_of(self, component: str) -> Path:
        return self.run / f"{component}.kubeconfig"

    # ---- what tests read -----------------------------------------------------------------------
    @property
    def kubeconfig(self) -> Path:
        return self.state / "kubeconfig"

    @property
    def rig_json(self) -> Path:
        return self.state / "rig.json"

    @property
    def lock(self) -> Path:
        return self.state / "rig.lock"
