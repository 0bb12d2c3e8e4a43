"""What pip inside an image build may use of the host's pip setup: its find-links folders and
indexes. Local ones are bind-mounted read-only at the same path for the build only; the
environment that names them goes to RUN steps only, never into the image. Pure."""

from __future__ import annotations

import dataclasses
import posixpath
from urllib.parse import urlparse

# pip setting -> the environment variable a RUN step gets
KEYS = {
    "find-links": "PIP_FIND_LINKS",
    "index-url": "PIP_INDEX_URL",
    "extra-index-url": "PIP_EXTRA_INDEX_URL",
}


@dataclasses.dataclass(frozen=True)
class PipAccess:
    env: dict[str, str]
    mounts: tuple[str, ...]  # host folders to bind read-only at the same path
    local_indexes: tuple[str, ...]  # file:// index URLs


def parse_config_list(text: str) -> dict[str, str]:
    """`pip config list` output (`global.find-links='/opt/wheels'`, `:env:.find-links=...`) ->
    {setting: value}; a later scope (the environment's) wins."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        name, found, value = line.partition("=")
        if not found:
            continue
        key = name.rsplit(".", 1)[-1]
        out[key] = value.strip().strip("'\"")
    return out


def _local_path(item: str) -> str | None:
    if item.startswith("/"):
        return item
    url = urlparse(item)
    if url.scheme == "file":
        return url.path
    return None


def _mount_root(path: str, index: bool) -> str:
    """An index's `simple/` pages link to files beside it (`../../files/...`): mount its parent."""
    path = posixpath.normpath(path)
    if index and posixpath.basename(path) == "simple":
        return posixpath.dirname(path)
    return path


def access(settings: dict[str, str], environ: dict[str, str]) -> PipAccess:
    """`settings` from `pip config list`; PIP_* variables of `environ` override them."""
    env: dict[str, str] = {}
    mounts: list[str] = []
    indexes: list[str] = []
    for key, var in KEYS.items():
        value = environ.get(var, settings.get(key, ""))
        items = value.split()
        if not items:
            continue
        env[var] = " ".join(items)
        for item in items:
            path = _local_path(item)
            if path is None:
                continue
            if key != "find-links":
                indexes.append(item if "://" in item else f"file://{item}")
            root = _mount_root(path, index=key != "find-links")
            if root not in mounts:
                mounts.append(root)
    # a folder inside another mounted one needs no mount of its own
    kept = [m for m in mounts if not any(m != o and m.startswith(o.rstrip("/") + "/") for o in mounts)]
    return PipAccess(env, tuple(kept), tuple(indexes))
