"""The ConfigMap of settings shared by every pod of a deployment (read through envFrom)."""

from __future__ import annotations

from disagg.operator.builders import common
from disagg.operator.spec import InferenceDeployment

CONFIG_HASH_ANNOTATION = "disagg.dev/config-hash"


def data(idep: InferenceDeployment) -> dict[str, str]:
    """Only variables both `disagg worker` and `disagg router` read, with the same meaning in each
    (a test parses every container with the real CLIs); per-role settings are flags."""
    return {"DISAGG_MODEL_NAME": idep.spec.model.name}


def configmap(idep: InferenceDeployment) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": common.metadata(idep, common.config_name(idep), "config"),
        "data": data(idep),
    }


def config_hash(idep: InferenceDeployment) -> str:
    """Put on pod templates: a changed ConfigMap then rolls the pods that read it at start."""
    return common.digest(data(idep))
