"""The node's network: a namespace, a veth pair into it, the node's address inside, and two host
routes (pods and Services via the node). Deleting the namespace takes the veth, the bridge, every
iptables rule and the host routes with it."""

from __future__ import annotations

import ipaddress
import json
import os

from . import mounts, proc
from .settings import Config


def netns_exists(cfg: Config) -> bool:
    return os.path.exists(cfg.netns_path)


def _link_exists(name: str) -> bool:
    return proc.run(["ip", "link", "show", "dev", name], check=False).returncode == 0


def host_routes(cfg: Config) -> list[str]:
    return [cfg.pod_cidr, cfg.service_cidr]


def conflicts(cfg: Config) -> list[str]:
    """Host routes and addresses that overlap the rig's ranges (other than the rig's own)."""
    ours = {cfg.host_veth}
    nets = [ipaddress.ip_network(n) for n in (cfg.link_cidr, cfg.pod_cidr, cfg.service_cidr)]
    found = []
    for route in json.loads(proc.output(["ip", "-j", "-4", "route", "show"]) or "[]"):
        dst = route.get("dst")
        if dst in (None, "default") or route.get("dev") in ours:
            continue
        net = ipaddress.ip_network(dst if "/" in dst else f"{dst}/32", strict=False)
        if any(net.overlaps(n) for n in nets):
            found.append(f"route {dst} dev {route.get('dev')}")
    return found


def up(cfg: Config) -> None:
    ns = cfg.netns
    if not netns_exists(cfg):
        proc.run(["ip", "netns", "add", ns])
    if not _link_exists(cfg.host_veth):
        proc.run(["ip", "link", "add", cfg.host_veth, "type", "veth", "peer", "name", cfg.node_veth])
        proc.run(["ip", "link", "set", cfg.node_veth, "netns", ns])
        proc.run(["ip", "addr", "add", f"{cfg.host_ip}/{cfg.link_prefix}", "dev", cfg.host_veth])
        proc.run(["ip", "link", "set", cfg.host_veth, "up"])
        inside = [
            ["ip", "addr", "add", f"{cfg.node_ip}/{cfg.link_prefix}", "dev", cfg.node_veth],
            ["ip", "link", "set", cfg.node_veth, "up"],
            ["ip", "link", "set", "lo", "up"],
        ]
        for argv in inside:
            proc.run(proc.in_netns(ns, argv))
    # the namespace's own sysctls (not the host's): forwarding between the veth and the bridge,
    # and bridged pod traffic through iptables (a pod reaching a Service served on its own bridge)
    for key, value in (("net/ipv4/ip_forward", "1"), ("net/bridge/bridge-nf-call-iptables", "1")):
        proc.run(
            proc.in_netns(ns, ["sh", "-c", f"[ ! -e /proc/sys/{key} ] || echo {value} > /proc/sys/{key}"])
        )
    for net in host_routes(cfg):
        proc.run(["ip", "route", "replace", net, "via", cfg.node_ip, "dev", cfg.host_veth])


def down(cfg: Config) -> None:
    if netns_exists(cfg):
        # processes still inside (a crashed start) keep it alive: the caller stopped them all
        proc.run(["ip", "netns", "del", cfg.netns], check=False)
    mounts.unmount_under(cfg.netns_path)  # a stale nsfs bind after a failed `ip netns del`
    if os.path.exists(cfg.netns_path):
        os.unlink(cfg.netns_path)
    if _link_exists(cfg.host_veth):
        proc.run(["ip", "link", "del", cfg.host_veth], check=False)
    for net in host_routes(cfg):
        # gone with the veth; a route left from an older run would name the node's address
        proc.run(["ip", "route", "del", net, "via", cfg.node_ip], check=False)


def release_run_netns(missing_before: bool) -> None:
    """`ip netns add` turned /run/netns into a shared bind mount of itself: undone when /run/netns
    did not exist before `up` and no namespace is left in it."""
    if not missing_before or not os.path.isdir("/run/netns") or os.listdir("/run/netns"):
        return
    mounts.unmount_under("/run/netns")
    os.rmdir("/run/netns")
