"""Which fields the operator sets differ on the live object (pure).

The operator applies whole children with server-side apply; a live child is up to date when every
field the operator sets still holds the value it set, whatever else the API server or other
controllers added (defaults, status, their own fields). A field changed by hand (`kubectl edit`,
`kubectl set image`, `kubectl scale`) shows up here, and a forced apply restores it.
"""

from __future__ import annotations

from typing import Any


def _same_scalar(want: Any, have: Any) -> bool:
    if want == have:
        return True
    # Quantities and int-or-string fields come back as strings (cpu: 1 -> "1").
    return (
        isinstance(have, str)
        and not isinstance(want, bool)
        and isinstance(want, int | float)
        and (str(want) == have)
    )


def _empty(value: Any) -> bool:
    # The API server leaves zero values of optional fields out (readOnly: false, empty maps).
    return value is None or value is False or value in ({}, [], "", 0)


def _keyed(items: list) -> bool:
    # Lists of named objects (containers, env, ports, volumes) are merged by name, not by position.
    return bool(items) and all(isinstance(i, dict) and "name" in i for i in items)


def differences(desired: Any, live: Any, path: str = "") -> list[str]:
    """Paths (`spec.template.spec.containers[worker].image`) of the values `desired` sets that `live` lacks."""
    if isinstance(desired, dict):
        if not isinstance(live, dict):
            return [] if _empty(desired) and _empty(live) else [path or "<root>"]
        out = []
        for key, want in desired.items():
            sub = f"{path}.{key}" if path else key
            if key not in live:
                if not _empty(want):
                    out.append(sub)
                continue
            out += differences(want, live[key], sub)
        return out
    if isinstance(desired, list):
        if not isinstance(live, list):
            return [] if _empty(desired) and _empty(live) else [path]
        if _keyed(desired) and _keyed(live):
            by_name = {item["name"]: item for item in live}
            out = []
            for item in desired:
                sub = f"{path}[{item['name']}]"
                out += differences(item, by_name[item["name"]], sub) if item["name"] in by_name else [sub]
            return out
        if len(desired) != len(live):
            return [path]
        out = []
        for i, (want, have) in enumerate(zip(desired, live, strict=True)):
            out += differences(want, have, f"{path}[{i}]")
        return out
    return [] if _same_scalar(desired, live) else [path]
