"""Server-side apply's field ownership, as a real API server keeps it in `metadata.managedFields`.

Enough of it for the emulator to catch what matters to the operator: who owns which leaf field
(lists count as one field, as `atomic` lists do), apply conflicts and `force`, the removal of a
field its only manager stops applying, and updates (merge patches) taking over what they change.
"""

from __future__ import annotations

import copy
from typing import Any

Path = tuple[str, ...]
# Identity and bookkeeping: nobody owns these.
UNOWNED = {("apiVersion",), ("kind",), ("status",)} | {
    ("metadata", k) for k in ("name", "namespace", "uid", "resourceVersion", "generation", "managedFields")
}


class Conflict(Exception):
    """An apply would change a field another manager owns (and was not forced)."""


def leaves(obj: dict, prefix: Path = ()) -> dict[Path, Any]:
    out: dict[Path, Any] = {}
    for key, value in obj.items():
        path = (*prefix, key)
        if path[:1] in UNOWNED or path[:2] in UNOWNED:
            continue
        if isinstance(value, dict) and value:
            out.update(leaves(value, path))
        else:
            out[path] = value
    return out


def to_fields(paths) -> dict:
    root: dict = {}
    for path in sorted(paths):
        node = root
        for key in path:
            node = node.setdefault(f"f:{key}", {})
    return root


def from_fields(fields: dict, prefix: Path = ()) -> set[Path]:
    out: set[Path] = set()
    for key, sub in fields.items():
        path = (*prefix, key.removeprefix("f:"))
        out |= from_fields(sub, path) if sub else {path}
    return out


def entries(obj: dict) -> dict[tuple[str, str], set[Path]]:
    return {
        (e["manager"], e["operation"]): from_fields(e.get("fieldsV1") or {})
        for e in (obj.get("metadata") or {}).get("managedFields") or []
    }


def managed_fields(owned: dict[tuple[str, str], set[Path]], api_version: str) -> list[dict]:
    return [
        {
            "manager": manager,
            "operation": operation,
            "apiVersion": api_version,
            "fieldsType": "FieldsV1",
            "fieldsV1": to_fields(paths),
        }
        for (manager, operation), paths in owned.items()
        if paths
    ]


def _set(obj: dict, path: Path, value) -> None:
    for key in path[:-1]:
        obj = obj.setdefault(key, {})
    obj[path[-1]] = value


def apply_patch(live: dict, body: dict, manager: str, *, force: bool, defaults: dict[Path, Any]) -> dict:
    """The merge patch (None deletes) that applying `body` as `manager` makes of `live`."""
    owned = entries(live)
    applied = leaves(body)
    current = leaves(live)
    conflicts = []
    for (other, operation), paths in owned.items():
        if (other, operation) == (manager, "Apply"):
            continue
        for path in paths & applied.keys():
            if current.get(path) != applied[path]:
                if not force:
                    conflicts.append(f"{'.'.join(path)} (owned by {other})")
                else:
                    paths.discard(path)  # forced: the other manager loses the field
    if conflicts:
        raise Conflict("Apply failed with conflicts: " + ", ".join(conflicts))
    mine = owned.get((manager, "Apply"), set())
    kept_by_others = set().union(*(p for k, p in owned.items() if k != (manager, "Apply")))
    patch = copy.deepcopy(body)
    for path in mine - applied.keys() - kept_by_others:
        _set(patch, path, defaults.get(path))  # removed; the server's default takes its place
    for path, value in defaults.items():
        if path not in current and path not in applied:
            _set(patch, path, value)
    owned[(manager, "Apply")] = set(applied)
    patch.setdefault("metadata", {})["managedFields"] = managed_fields(owned, body.get("apiVersion", ""))
    return patch


def update_ownership(live: dict, patch: dict, manager: str) -> None:
    """Record, in `patch`, that `manager` now owns what its merge patch changes (others lose it)."""
    owned = entries(live)
    current = leaves(live)
    changed = {p for p, v in leaves(patch).items() if v is not None and current.get(p) != v}
    cleared = {p for p, v in leaves(patch).items() if v is None}
    if not changed and not cleared:
        return
    for key in owned:
        owned[key] -= changed | cleared
    owned.setdefault((manager, "Update"), set()).update(changed)
    patch.setdefault("metadata", {})["managedFields"] = managed_fields(owned, live.get("apiVersion", ""))
