"""What the rig writes for containerd, CNI, the kubelet, kube-proxy, the control plane and clients."""

from __future__ import annotations

import base64
import json
import tomllib
from pathlib import Path

import pytest
from disagg_node_rig import (
    cli,
    cni_config,
    containerd_config,
    controlplane,
    kubeconfig,
    kubelet_config,
    objects,
    pki,
    proxy_config,
    settings,
    tomlwriter,
)
from disagg_node_rig.layout import Layout

CFG = settings.load(environ={"DISAGG_NODE_STATE": "/state", "K8S_BIN": "/k8s"})
LAYOUT = Layout(CFG.state)


def test_defaults_and_derived_addresses():
    assert (CFG.host_ip, CFG.node_ip, CFG.link_prefix) == ("10.213.0.1", "10.213.0.2", 30)
    assert (CFG.pod_cidr, CFG.pod_gateway) == ("10.214.0.0/24", "10.214.0.1")
    assert CFG.kubernetes_service_ip == "10.0.0.1"
    assert CFG.dns_ip == CFG.node_ip
    assert CFG.state == Path("/state") and CFG.k8s_bin == Path("/k8s")
    default = settings.load(environ={})
    assert default.state == Path("~/.cache/disagg-node").expanduser()


def test_options_override_the_environment():
    cfg = settings.load(environ={"DISAGG_NODE_API_PORT": "1"}, overrides={"api_port": "2"})
    assert cfg.api_port == 2


def test_overlapping_ranges_are_refused():
    with pytest.raises(ValueError, match="overlaps"):
        settings.load(environ={"DISAGG_NODE_POD_CIDR": "10.0.0.128/25"})
    with pytest.raises(ValueError, match="two host addresses"):
        settings.load(environ={"DISAGG_NODE_LINK_CIDR": "10.213.0.0/31"})


def test_help_names_every_setting_with_its_variable_and_default():
    text = " ".join(cli.parser().format_help().split())
    for s in settings.SETTINGS:
        assert f"--{s.name.replace('_', '-')}" in text
        assert f"[{s.env}; default: {s.default or 'empty'}]" in text


def test_toml_writer_round_trips():
    doc = {"version": 2, "a": "x\"y", "flag": True, "list": ["p", "q"],
           "plugins": {"io.containerd.grpc.v1.cri": {"k": 1, "inner": {"z": False}}, "empty": {}}}  # fmt: skip
    assert tomllib.loads(tomlwriter.dumps(doc)) == doc


def test_containerd_keeps_everything_under_the_state_folder():
    doc = tomllib.loads(containerd_config.render(LAYOUT, "registry.k8s.io/pause:3.10"))
    for key in ("root", "state"):
        assert doc[key].startswith("/state/")
    assert doc["grpc"]["address"] == str(LAYOUT.containerd_socket)
    cri = doc["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["restrict_oom_score_adj"] is True
    assert cri["netns_mounts_under_state_dir"] is True
    assert cri["sandbox_image"] == "registry.k8s.io/pause:3.10"
    runc = cri["containerd"]["runtimes"]["runc"]["options"]
    assert runc == {"SystemdCgroup": False, "Root": str(LAYOUT.runc_root)}
    assert cri["cni"]["conf_dir"] == str(LAYOUT.cni_conf_dir)
    assert doc["plugins"]["io.containerd.internal.v1.opt"]["path"].startswith("/state/")


def test_cni_bridge_serves_the_pod_range():
    doc = json.loads(cni_config.render(CFG, LAYOUT))
    bridge = doc["plugins"][0]
    assert bridge["type"] == "bridge" and bridge["bridge"] == CFG.bridge and bridge["isGateway"]
    assert bridge["ipam"]["ranges"] == [[{"subnet": "10.214.0.0/24", "gateway": "10.214.0.1"}]]
    assert bridge["ipam"]["dataDir"] == str(LAYOUT.cni_ipam_dir)
    assert doc["plugins"][1]["type"] == "portmap"


def test_kubelet_configuration():
    doc = json.loads(kubelet_config.render(CFG, LAYOUT, "/pki"))
    assert doc["failCgroupV1"] is False
    assert doc["cgroupRoot"] == "/dg" and doc["cgroupDriver"] == "cgroupfs"
    assert doc["containerRuntimeEndpoint"] == f"unix://{LAYOUT.containerd_socket}"
    assert doc["address"] == "10.213.0.2" and doc["clusterDNS"] == ["10.213.0.2"]
    assert doc["authentication"]["anonymous"]["enabled"] is False
    assert doc["authentication"]["x509"]["clientCAFile"] == "/pki/ca.crt"
    assert doc["imageGCHighThresholdPercent"] == 100
    assert doc["podLogsDir"].startswith("/state/")
    args = kubelet_config.args(CFG, LAYOUT, "/k8s/kubelet")
    assert "--node-ip=10.213.0.2" in args and "--hostname-override=dg-node" in args
    assert f"--root-dir={LAYOUT.kubelet_root}" in args


def test_kube_proxy_configuration():
    doc = json.loads(proxy_config.render(CFG, LAYOUT))
    assert doc["mode"] == "iptables" and doc["clusterCIDR"] == "10.214.0.0/24"
    assert doc["nodePortAddresses"] == ["10.213.0.2/32"]
    assert doc["conntrack"] == {
        "maxPerCore": 0,
        "min": 0,
        "tcpEstablishedTimeout": "0s",
        "tcpCloseWaitTimeout": "0s",
    }
    assert doc["clientConnection"]["kubeconfig"] == str(LAYOUT.kubeconfig_of("kube-proxy"))


def test_kubeconfig_embeds_the_ca_and_the_user():
    doc = json.loads(kubeconfig.render("https://127.0.0.1:1", b"PEM", kubeconfig.token_user("t")))
    cluster = doc["clusters"][0]["cluster"]
    assert cluster["server"] == "https://127.0.0.1:1"
    assert base64.b64decode(cluster["certificate-authority-data"]) == b"PEM"
    assert doc["users"][0]["user"] == {"token": "t"}
    assert doc["current-context"] == doc["contexts"][0]["name"]
    cert = kubeconfig.cert_user(b"C", b"K")
    assert base64.b64decode(cert["client-key-data"]) == b"K"


def test_certificates_name_every_address_clients_use():
    certs = {c.name: c for c in pki.certs("dg-node", "10.213.0.2", "10.213.0.1", "10.0.0.1", "cluster.local")}
    api = certs["apiserver"]
    for name in ("IP:127.0.0.1", "IP:10.213.0.1", "IP:10.0.0.1", "DNS:kubernetes.default.svc.cluster.local"):
        assert name in api.server_names
    assert certs["kubelet"].subject == "/O=system:nodes/CN=system:node:dg-node"
    assert "IP:10.213.0.2" in certs["kubelet-serving"].server_names
    assert "serverAuth" in pki.extensions(api) and "subjectAltName=IP:127.0.0.1," in pki.extensions(api)
    assert "clientAuth" in pki.extensions(certs["kube-proxy"])


def test_control_plane_command_lines():
    api = controlplane.apiserver_args(CFG, LAYOUT)
    assert "--bind-address=127.0.0.1" in api and f"--secure-port={CFG.api_port}" in api
    assert "--service-cluster-ip-range=10.0.0.0/24" in api
    assert "--endpoint-reconciler-type=none" in api
    assert "--kubelet-preferred-address-types=InternalIP" in api
    etcd = controlplane.etcd_args(CFG, LAYOUT)
    assert f"--listen-client-urls=http://127.0.0.1:{CFG.etcd_port}" in etcd
    assert "--leader-elect=false" in controlplane.scheduler_args(CFG, LAYOUT)


def test_kubernetes_endpointslice_points_at_the_relay():
    es = objects.kubernetes_endpointslice(CFG)
    assert es["metadata"]["labels"] == {"kubernetes.io/service-name": "kubernetes"}
    assert es["endpoints"][0]["addresses"] == ["10.213.0.1"]
    assert es["ports"] == [{"name": "https", "port": CFG.api_port, "protocol": "TCP"}]
