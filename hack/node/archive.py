"""The docker-archive format `ctr images import` reads: `manifest.json`, the image's `config.json`
and its layer tarballs. Pure: the two JSON documents, byte for byte reproducible."""

from __future__ import annotations

import json

from .dockerfile import ImageConfig

CONFIG_NAME = "config.json"
MANIFEST_NAME = "manifest.json"
LAYER_NAME = "layer.tar"


def _dump(value) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def config_document(config: ImageConfig, diff_ids: list[str], architecture: str = "amd64") -> bytes:
    """The image configuration: `diff_ids` are the `sha256:<hex>` digests of the uncompressed layers."""
    inner: dict = {"Env": [f"{k}={v}" for k, v in config.env], "WorkingDir": config.workdir}
    if config.entrypoint is not None:
        inner["Entrypoint"] = list(config.entrypoint)
    if config.cmd is not None:
        inner["Cmd"] = list(config.cmd)
    if config.user:
        inner["User"] = config.user
    if config.exposed:
        inner["ExposedPorts"] = {port: {} for port in config.exposed}
    return _dump(
        {
            "architecture": architecture,
            "os": "linux",
            "config": inner,
            "rootfs": {"type": "layers", "diff_ids": list(diff_ids)},
        }
    )


def manifest_document(repo_tags: list[str], layers: list[str] | None = None) -> bytes:
    """One image under every name in `repo_tags` (fully qualified: `docker.io/library/redis:7.4-alpine`)."""
    return _dump([{"Config": CONFIG_NAME, "RepoTags": list(repo_tags), "Layers": layers or [LAYER_NAME]}])
