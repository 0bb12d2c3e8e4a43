"""The images the node runs, each under the names the chart, the example and the operator use, and
the key of each build: a hash of everything that goes into it, so an unchanged image is reused and
a change to its Dockerfile or to a file it copies rebuilds it. Pure."""

from __future__ import annotations

import dataclasses
import hashlib
import json

# Bumped when the builder changes what it makes from the same inputs.
BUILDER_VERSION = "1"


@dataclasses.dataclass(frozen=True)
class ImageSpec:
    name: str
    dockerfile: str | None  # None: made by the rig itself (the pause image)
    refs: tuple[str, ...]


WORKER_CPU = ImageSpec(
    "worker-cpu", "docker/worker-cpu.Dockerfile", ("ghcr.io/disagg/disagg-worker:0.1.0-cpu",)
)
OPERATOR = ImageSpec("operator", "docker/operator.Dockerfile", ("ghcr.io/disagg/disagg-operator:0.1.0",))
# the operator's managed Redis (spec.redis.managed.image defaults to redis:7.4-alpine)
REDIS = ImageSpec("redis", "docker/redis.Dockerfile", ("docker.io/library/redis:7.4-alpine",))
# containerd's sandbox image; the pause program from Kubernetes' build/pause/linux/pause.c
PAUSE = ImageSpec("pause", None, ("registry.k8s.io/pause:3.10",))
ALL = (WORKER_CPU, OPERATOR, REDIS, PAUSE)  # the longest build first: it starts while the others run


def by_name(name: str) -> ImageSpec:
    for spec in ALL:
        if spec.name == name:
            return spec
    raise KeyError(f"no image {name!r} (images: {', '.join(s.name for s in ALL)})")


def file_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def build_key(
    recipe: str, build_args: dict[str, str], base_key: str, files: list[tuple[str, int, str]]
) -> str:
    """`recipe`: the Dockerfile's text (or the pause program's source); `files`: (path, mode,
    sha256 of content) of every file the build copies in."""
    h = hashlib.sha256()
    doc = {
        "builder": BUILDER_VERSION,
        "recipe": recipe,
        "args": sorted(build_args.items()),
        "base": base_key,
        "files": sorted(files),
    }
    h.update(json.dumps(doc, sort_keys=True).encode())
    return h.hexdigest()


def base_key(suite: str, variant: str, entries: list[str], options: list[str]) -> str:
    doc = {
        "builder": BUILDER_VERSION,
        "suite": suite,
        "variant": variant,
        "entries": entries,
        "options": options,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def step_key(previous: str, step: object, files: list[tuple[str, int, str]] = ()) -> str:
    """The key of the root filesystem after one more step (`repr` of a frozen plan step)."""
    h = hashlib.sha256(previous.encode())
    h.update(repr(step).encode())
    for entry in sorted(files):
        h.update(repr(entry).encode())
    return h.hexdigest()
