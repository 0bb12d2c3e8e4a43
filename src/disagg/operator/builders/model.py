"""Where a pod finds its checkpoint: the model volume, its mount, and the init container that fills it.

Workers get the whole checkpoint. The router needs only the tokenizer, chat template and
config.json: it mounts the same PVC or host path, or downloads just those files; a generated
model is made in full (it is small, and the tokenizer comes from the same seeded recipe).
"""

from __future__ import annotations

import posixpath

from disagg.operator.builders import hardening
from disagg.operator.constants import MODEL_MOUNT
from disagg.operator.spec import InferenceDeployment
from disagg.worker.cli.flags import MakeModel

VOLUME = "model"
# `make-model` is deterministic for a preset and seed: every pod writes byte-identical files.
GENERATE_SEED = 0
# What the router reads from a Hugging Face checkpoint (the tokenizer module and context length).
TOKENIZER_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
TOKENIZER_SIZE_LIMIT = "1Gi"


def model_dir(idep: InferenceDeployment) -> str:
    src = idep.spec.model.source
    if src.kind == "pvc":
        return (
            posixpath.normpath(posixpath.join(MODEL_MOUNT, src.path.lstrip("/"))) if src.path else MODEL_MOUNT
        )
    if src.kind == "hostPath":
        return MODEL_MOUNT
    return f"{MODEL_MOUNT}/model"  # downloaded or generated into a pod-local volume


def volume(idep: InferenceDeployment, tokenizer_only: bool = False) -> dict:
    src = idep.spec.model.source
    if src.kind == "pvc":
        return {"name": VOLUME, "persistentVolumeClaim": {"claimName": src.claim_name, "readOnly": True}}
    if src.kind == "hostPath":
        return {"name": VOLUME, "hostPath": {"path": src.path, "type": "Directory"}}
    if src.kind == "huggingFace":
        return {
            "name": VOLUME,
            "emptyDir": {"sizeLimit": TOKENIZER_SIZE_LIMIT if tokenizer_only else src.size_limit},
        }
    return {"name": VOLUME, "emptyDir": {}}


def mount(idep: InferenceDeployment, read_only: bool | None = None) -> dict:
    """The serving container's mount; read-only for shared sources (and wherever the caller asks)."""
    if read_only is None:
        read_only = idep.spec.model.source.kind in ("pvc", "hostPath")
    return {"name": VOLUME, "mountPath": MODEL_MOUNT, "readOnly": read_only}


def make_model_args(idep: InferenceDeployment) -> list[str]:
    src = idep.spec.model.source
    return ["make-model", model_dir(idep), MakeModel.PRESET, src.preset, MakeModel.SEED, str(GENERATE_SEED)]


def init_containers(idep: InferenceDeployment, tokenizer_only: bool = False) -> list[dict]:
    """The container that puts the checkpoint in place before the pod starts (none for pvc/hostPath).

    With `tokenizer_only` a Hugging Face download fetches just the router's files.
    """
    spec = idep.spec
    src = spec.model.source
    if src.kind in ("pvc", "hostPath"):
        return []
    base = {
        "image": spec.image.ref,
        "imagePullPolicy": spec.image.pull_policy,
        # The pod's /tmp volume as well: the root file system is read-only.
        "volumeMounts": [{"name": VOLUME, "mountPath": MODEL_MOUNT}, *hardening.scratch_mounts()],
        "securityContext": hardening.container(),
    }
    if src.kind == "generate":
        return [
            {
                **base,
                "name": "make-model",
                "env": hardening.scratch_env(),
                "command": ["disagg"],
                "args": make_model_args(idep),
            }
        ]
    env = [*hardening.scratch_env(), {"name": "HF_HOME", "value": f"{MODEL_MOUNT}/.hf"}]
    if src.token is not None:
        env.append(
            {
                "name": "HF_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": src.token.name, "key": src.token.key}},
            }
        )
    args = ["download", src.repo, "--revision", src.revision, "--local-dir", model_dir(idep)]
    if tokenizer_only:
        for name in TOKENIZER_FILES:
            args += ["--include", name]
    else:
        args += ["--exclude", "*.pth", "--exclude", "original/*"]
    return [{**base, "name": "download-model", "env": env, "command": ["hf"], "args": args}]
