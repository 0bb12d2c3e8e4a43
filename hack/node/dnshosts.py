"""The cluster's DNS names as a hosts file for dnsmasq, from Services and EndpointSlices (what
CoreDNS's kubernetes plugin answers for A records). Pure."""

from __future__ import annotations

SERVICE_NAME_LABEL = "kubernetes.io/service-name"


def records(services: list[dict], slices: list[dict], domain: str) -> list[tuple[str, str]]:
    """(address, name) pairs:
    - a Service with a ClusterIP: `<svc>.<ns>.svc.<domain>` -> the ClusterIP;
    - a headless Service: the same name -> each ready endpoint's address (every endpoint's with
      publishNotReadyAddresses), and `<hostname>.<svc>.<ns>.svc.<domain>` for endpoints with a
      hostname (a StatefulSet's pods)."""
    out: set[tuple[str, str]] = set()
    headless: dict[tuple[str, str], bool] = {}  # (ns, name) -> publishNotReadyAddresses
    for svc in services:
        meta, spec = svc.get("metadata", {}), svc.get("spec", {})
        ns, name = meta.get("namespace", "default"), meta.get("name")
        if not name or spec.get("type") == "ExternalName":
            continue
        fqdn = f"{name}.{ns}.svc.{domain}"
        ips = spec.get("clusterIPs") or [spec.get("clusterIP")]
        if ips == ["None"]:
            headless[(ns, name)] = bool(spec.get("publishNotReadyAddresses"))
            continue
        for ip in ips:
            if ip and ip != "None" and ":" not in ip:
                out.add((ip, fqdn))
    for es in slices:
        if es.get("addressType", "IPv4") != "IPv4":
            continue
        meta = es.get("metadata", {})
        ns, svc_name = meta.get("namespace", "default"), (meta.get("labels") or {}).get(SERVICE_NAME_LABEL)
        if (ns, svc_name) not in headless:
            continue
        publish_not_ready = headless[(ns, svc_name)]
        fqdn = f"{svc_name}.{ns}.svc.{domain}"
        for ep in es.get("endpoints") or []:
            ready = (ep.get("conditions") or {}).get("ready")
            if not (publish_not_ready or ready is None or ready):
                continue
            for addr in ep.get("addresses") or []:
                out.add((addr, fqdn))
                if ep.get("hostname"):
                    out.add((addr, f"{ep['hostname']}.{fqdn}"))
    return sorted(out, key=lambda r: (r[1], r[0]))


def render(services: list[dict], slices: list[dict], domain: str) -> str:
    return "".join(f"{ip} {name}\n" for ip, name in records(services, slices, domain))
