"""The live children of every InferenceDeployment, kept from watch events instead of listed per reconcile.

Fed by the watches on every kind the operator owns (objects labelled as managed by it), by the
operator's own writes (the apply's answer, a delete) and, for a child not seen yet (the first
reconcile after a start, before the watch's initial listing arrived), by one GET. A stale event
never overwrites a newer object: resourceVersions are etcd revisions on the API servers we run
against, so the higher one is the later state; where they are not numbers the latest event wins.
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.operator import constants as c

UNKNOWN = object()  # never seen: ask the API server


@dataclass(frozen=True)
class Gone:
    """A child known to be absent, as of `resource_version` (its deletion, or a 404)."""

    resource_version: str = ""


Key = tuple[str, str, str]  # kind, namespace, name


def key(obj: dict) -> Key:
    meta = obj["metadata"]
    return obj["kind"], meta.get("namespace") or "", meta["name"]


def _version(entry) -> int | None:
    raw = (
        entry.resource_version
        if isinstance(entry, Gone)
        else (entry.get("metadata") or {}).get("resourceVersion", "")
    )
    return int(raw) if str(raw).isdigit() else None


def controller_uid(obj: dict) -> str | None:
    """The uid of the InferenceDeployment that controls `obj`, if one does."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if (
            ref.get("controller")
            and ref.get("kind") == c.KIND
            and str(ref.get("apiVersion", "")).startswith(f"{c.GROUP}/")
        ):
            return ref.get("uid")
    return None


class Children:
    def __init__(self):
        self._entries: dict[Key, dict | Gone] = {}

    def _newer(self, k: Key, incoming) -> bool:
        have = self._entries.get(k)
        if have is None:
            return True
        old, new = _version(have), _version(incoming)
        return old is None or new is None or new >= old

    def seen(self, obj: dict) -> None:
        """An object as the API server returned it (watch event, apply answer, GET)."""
        if self._newer(key(obj), obj):
            self._entries[key(obj)] = obj

    def deleted(self, obj: dict) -> None:
        """A DELETED watch event (the object as it was when it went)."""
        gone = Gone((obj.get("metadata") or {}).get("resourceVersion", ""))
        if self._newer(key(obj), gone):
            self._entries[key(obj)] = gone

    def absent(self, kind: str, namespace: str, name: str) -> None:
        """Known to be missing now (a 404, or this process deleted it)."""
        self._entries[kind, namespace, name] = Gone()

    def lookup(self, kind: str, namespace: str, name: str):
        """The live object, None when absent, or UNKNOWN."""
        entry = self._entries.get((kind, namespace, name), UNKNOWN)
        return None if isinstance(entry, Gone) else entry

    def owned_by(self, namespace: str, uid: str) -> list[dict]:
        """Every live child in `namespace` that the InferenceDeployment with `uid` controls."""
        return [
            obj
            for (_, ns, _), obj in self._entries.items()
            if ns == namespace and not isinstance(obj, Gone) and controller_uid(obj) == uid
        ]
