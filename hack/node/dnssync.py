"""Keeps dnsmasq's hosts file equal to the cluster's Services and EndpointSlices: polls the API,
rewrites the file when it changed and signals dnsmasq (SIGHUP re-reads it). Runs as a process of
its own for as long as the rig is up."""

from __future__ import annotations

import os
import signal
import sys
import time

from . import dnshosts, proc
from .api import Api
from .layout import Layout
from .settings import Config

INTERVAL = 1.0


def render(api: Api, cfg: Config) -> str:
    services = api.items("/api/v1/services")
    slices = api.items("/apis/discovery.k8s.io/v1/endpointslices")
    return dnshosts.render(services, slices, cfg.cluster_domain)


def write_if_changed(path, text: str) -> bool:
    try:
        if path.read_text() == text:
            return False
    except FileNotFoundError:
        pass
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return True


def reload_dnsmasq(layout: Layout) -> None:
    pid = proc.pid_of(layout, "dnsmasq")
    if pid is not None:
        os.kill(pid, signal.SIGHUP)


def run_forever(cfg: Config, layout: Layout, api: Api) -> None:
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    while not stop:
        try:
            if write_if_changed(layout.dns_hosts, render(api, cfg)):
                reload_dnsmasq(layout)
        except Exception as exc:  # noqa: BLE001 - the API restarting: try again next round
            print(f"dns-sync: {exc}", file=sys.stderr, flush=True)
        time.sleep(INTERVAL)
