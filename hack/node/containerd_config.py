"""containerd's configuration: its own root, state, socket and runc root under the rig's state
folder, CRI with bridge CNI, and the workarounds this kind of machine needs. Pure."""

from __future__ import annotations

from . import tomlwriter
from .layout import Layout

CNI_BIN_DIR = "/usr/lib/cni"  # Debian's containernetworking-plugins
# snapshotters this rig never uses: left out so containerd does not probe for them
DISABLED_PLUGINS = [
    "io.containerd.snapshotter.v1.aufs",
    "io.containerd.snapshotter.v1.btrfs",
    "io.containerd.snapshotter.v1.devmapper",
    "io.containerd.snapshotter.v1.zfs",
]


def config(layout: Layout, sandbox_image: str) -> dict:
    cri = "io.containerd.grpc.v1.cri"
    return {
        "version": 2,
        "root": str(layout.containerd_root),
        "state": str(layout.containerd_state / "state"),
        "disabled_plugins": DISABLED_PLUGINS,
        "grpc": {"address": str(layout.containerd_socket)},
        "ttrpc": {"address": f"{layout.containerd_socket}.ttrpc"},
        "plugins": {
            "io.containerd.internal.v1.opt": {"path": str(layout.containerd_opt)},
            cri: {
                "sandbox_image": sandbox_image,
                # exec/attach/port-forward streams, inside the namespace (the kubelet proxies them)
                "stream_server_address": "127.0.0.1",
                "stream_server_port": "0",
                # root here lacks CAP_SYS_RESOURCE: runc's write of oom_score_adj would fail the sandbox
                "restrict_oom_score_adj": True,
                # pod network namespaces under the state folder, not in the host's /run/netns
                "netns_mounts_under_state_dir": True,
                "containerd": {
                    "snapshotter": "overlayfs",
                    "default_runtime_name": "runc",
                    "runtimes": {
                        "runc": {
                            "runtime_type": "io.containerd.runc.v2",
                            "options": {"SystemdCgroup": False, "Root": str(layout.runc_root)},
                        }
                    },
                },
                "cni": {"bin_dir": CNI_BIN_DIR, "conf_dir": str(layout.cni_conf_dir), "max_conf_num": 1},
            },
        },
    }


def render(layout: Layout, sandbox_image: str) -> str:
    return tomlwriter.dumps(config(layout, sandbox_image))
