"""The ConfigMap of settings shared by every pod of a deployment (read through envFrom)."""

from __future__ import annotations

from disagg.operator.builders import common
from disagg.operator.spec import InferenceDeployment

CONFIG_HASH_ANNOTATION = "disagg.dev/config-hash"


def data(idep: InferenceDeployment) -> dict[str, str]:
    spec = idep.spec
    return {
        "DISAGG_MODEL_NAME": spec.model.name,
        "DISAGG_KV_TRANSFER": spec.kv_transfer.backend,
        "DISAGG_PREFILL_SERVICE": f"{common.role_name(idep, 'prefill')}.{idep.namespace}.svc",
        "DISAGG_DECODE_SERVICE": f"{common.role_name(idep, 'decode')}.{idep.namespace}.svc",
        "DISAGG_ENDPOINT": common.endpoint(idep),
    }


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
