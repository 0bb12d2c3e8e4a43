"""Where a worker finds its checkpoint: the model volume, its mount, and the init container that fills it."""

from __future__ import annotations

import posixpath

from disagg.operator.constants import MODEL_MOUNT
from disagg.operator.spec import InferenceDeployment

VOLUME = "model"


def model_dir(idep: InferenceDeployment) -> str:
    src = idep.spec.model.source
    if src.kind == "pvc":
        return (
            posixpath.normpath(posixpath.join(MODEL_MOUNT, src.path.lstrip("/"))) if src.path else MODEL_MOUNT
        )
    if src.kind == "hostPath":
        return MODEL_MOUNT
    return f"{MODEL_MOUNT}/model"  # downloaded or generated into a pod-local volume


def volume(idep: InferenceDeployment) -> dict:
    src = idep.spec.model.source
    if src.kind == "pvc":
        return {"name": VOLUME, "persistentVolumeClaim": {"claimName": src.claim_name, "readOnly": True}}
    if src.kind == "hostPath":
        return {"name": VOLUME, "hostPath": {"path": src.path, "type": "Directory"}}
    if src.kind == "huggingFace":
        return {"name": VOLUME, "emptyDir": {"sizeLimit": src.size_limit}}
    return {"name": VOLUME, "emptyDir": {}}


def mount(idep: InferenceDeployment) -> dict:
    read_only = idep.spec.model.source.kind in ("pvc", "hostPath")
    return {"name": VOLUME, "mountPath": MODEL_MOUNT, "readOnly": read_only}


def init_containers(idep: InferenceDeployment, security_context: dict) -> list[dict]:
    """The container that puts the checkpoint in place before the worker starts (none for pvc/hostPath)."""
    spec = idep.spec
    src = spec.model.source
    if src.kind in ("pvc", "hostPath"):
        return []
    base = {
        "image": spec.image.ref,
        "imagePullPolicy": spec.image.pull_policy,
        "volumeMounts": [{"name": VOLUME, "mountPath": MODEL_MOUNT}],
        "securityContext": security_context,
    }
    if src.kind == "generate":
        return [
            {
                **base,
                "name": "make-model",
                "command": ["disagg"],
                "args": ["make-model", model_dir(idep), "--preset", src.preset],
            }
        ]
    env = [{"name": "HF_HOME", "value": f"{MODEL_MOUNT}/.hf"}]
    if src.token is not None:
        env.append(
            {
                "name": "HF_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": src.token.name, "key": src.token.key}},
            }
        )
    return [
        {
            **base,
            "name": "download-model",
            "env": env,
            "command": ["hf"],
            "args": [
                "download",
                src.repo,
                "--revision",
                src.revision,
                "--local-dir",
                model_dir(idep),
                "--exclude",
                "*.pth",
                "--exclude",
                "original/*",
            ],
        }
    ]
