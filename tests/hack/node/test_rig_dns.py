"""The cluster's DNS names from Services and EndpointSlices; the wire format of the readiness query;
what teardown reads from /proc."""

from __future__ import annotations

import struct

from disagg_node_rig import cgroups, dnshosts, dnsquery, mounts


def svc(ns, name, ip, **spec):
    return {"metadata": {"namespace": ns, "name": name}, "spec": {"clusterIP": ip, **spec}}


def slice_(ns, service, endpoints, address_type="IPv4"):
    return {"metadata": {"namespace": ns, "labels": {"kubernetes.io/service-name": service}},
            "addressType": address_type, "endpoints": endpoints}  # fmt: skip


def ep(addr, ready=True, hostname=None):
    out = {"addresses": [addr], "conditions": {"ready": ready}}
    if hostname:
        out["hostname"] = hostname
    return out


def test_cluster_ip_services_and_headless_endpoints():
    services = [
        svc("default", "kubernetes", "10.0.0.1"),
        svc("demo", "tiny", "10.0.0.20"),
        svc("demo", "tiny-prefill", "None"),
        svc("demo", "tiny-early", "None", publishNotReadyAddresses=True),
        svc("demo", "ext", None, type="ExternalName", externalName="example.org"),
    ]
    slices = [
        slice_("demo", "tiny", [ep("10.214.0.5")]),  # not headless: only the ClusterIP
        slice_(
            "demo",
            "tiny-prefill",
            [ep("10.214.0.7", hostname="tiny-prefill-0"), ep("10.214.0.8", ready=False)],
        ),
        slice_("demo", "tiny-early", [ep("10.214.0.9", ready=False, hostname="tiny-early-0")]),
        slice_("demo", "tiny-prefill", [{"addresses": ["fd00::1"]}], address_type="IPv6"),
    ]
    text = dnshosts.render(services, slices, "cluster.local")
    assert text.splitlines() == [
        "10.0.0.1 kubernetes.default.svc.cluster.local",
        "10.214.0.9 tiny-early-0.tiny-early.demo.svc.cluster.local",
        "10.214.0.9 tiny-early.demo.svc.cluster.local",
        "10.214.0.7 tiny-prefill-0.tiny-prefill.demo.svc.cluster.local",
        "10.214.0.7 tiny-prefill.demo.svc.cluster.local",
        "10.0.0.20 tiny.demo.svc.cluster.local",
    ]


def test_dns_query_and_answer():
    q = dnsquery.query("kubernetes.default.svc.cluster.local", 0x1234)
    assert q[:2] == b"\x12\x34" and q.endswith(b"\x07cluster\x05local\x00\x00\x01\x00\x01")
    question = q[12:]
    answer = struct.pack(">HHHHHH", 0x1234, 0x8180, 1, 2, 0, 0) + question
    answer += b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, 0, 4) + bytes([10, 0, 0, 1])
    answer += b"\xc0\x0c" + struct.pack(">HHIH", 5, 1, 0, 2) + b"\xc0\x0c"  # a CNAME: skipped
    assert dnsquery.answer(answer, 0x1234) == (0, ["10.0.0.1"])
    nx = struct.pack(">HHHHHH", 7, 0x8183, 1, 0, 0, 0) + question
    assert dnsquery.answer(nx, 7) == (3, [])


def test_mount_points_unescaped_and_deepest_first():
    info = (
        "22 1 0:21 / /proc rw - proc proc rw\n"
        "90 22 0:50 / /st/run/kubelet rw - ext4 /dev/vda rw\n"
        "91 90 0:51 / /st/run/kubelet/pods/x/volumes/a\\040b rw - tmpfs tmpfs rw\n"
        "92 90 0:52 / /st/run/kubelet rw - ext4 /dev/vda rw\n"
        "93 1 0:53 / /st/runner rw - ext4 /dev/vda rw\n"
    )
    points = mounts.mount_points(info)
    assert points[2] == "/st/run/kubelet/pods/x/volumes/a b"
    assert mounts.under(points, "/st/run") == [
        "/st/run/kubelet/pods/x/volumes/a b",
        "/st/run/kubelet",
        "/st/run/kubelet",
    ]


def test_cgroup_hierarchies():
    text = (
        "tmpfs /sys/fs/cgroup tmpfs rw 0 0\n"
        "cgroup /sys/fs/cgroup/cpu cgroup rw,cpu 0 0\n"
        "cgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n"
    )
    assert cgroups.hierarchies(text) == [
        ("/sys/fs/cgroup/cpu", "cgroup"),
        ("/sys/fs/cgroup/unified", "cgroup2"),
    ]
