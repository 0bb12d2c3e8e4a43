"""Names, labels, owner references and shared settings every child of an InferenceDeployment uses."""

from __future__ import annotations

import hashlib
import json

from disagg.operator import constants as c
from disagg.operator.spec import InferenceDeployment

RESERVED_ENV = (
    "DISAGG_ROLE",
    "DISAGG_DEPLOYMENT",
    "POD_NAME",
    "POD_IP",
    # Credentials: a user's env entry could otherwise swap in a token or password of its choosing.
    "DISAGG_INTERNAL_TOKEN",
    "DISAGG_INTERNAL_TOKEN_FILE",
    "DISAGG_REDIS_PASSWORD",
    "DISAGG_REDIS_PASSWORD_FILE",
    "DISAGG_GRPC_TLS_DIR",
    "DISAGG_PEER_IDENTITY",
    "DISAGG_INSECURE_INTERNAL",
)


def role_name(idep: InferenceDeployment, role: str) -> str:
    """Name of a role's StatefulSet, its headless Service and its PodDisruptionBudget."""
    return f"{idep.name}-{role}"


def router_name(idep: InferenceDeployment) -> str:
    return f"{idep.name}-router"


def api_service_name(idep: InferenceDeployment) -> str:
    # The API Service carries the deployment's own name: that is what users type.
    return idep.name


def redis_name(idep: InferenceDeployment) -> str:
    return f"{idep.name}-redis"


def config_name(idep: InferenceDeployment) -> str:
    return f"{idep.name}-config"


def service_account_name(idep: InferenceDeployment) -> str:
    return idep.name


def endpoint(idep: InferenceDeployment) -> str:
    return f"http://{api_service_name(idep)}.{idep.namespace}.svc:{idep.spec.router.port}/v1"


def redis_url(idep: InferenceDeployment) -> str:
    """The URL workers and the router get, without a password (see `secrets.redis_password_env`)."""
    redis = idep.spec.redis
    if redis.managed:
        return f"redis://{redis_name(idep)}.{idep.namespace}.svc:{c.REDIS_PORT}/0"
    return redis.url


def selector_labels(idep: InferenceDeployment, component: str) -> dict[str, str]:
    """The immutable subset used in selectors: never add to it (StatefulSet selectors cannot change)."""
    return {c.LABEL_INSTANCE: idep.name, c.LABEL_COMPONENT: component}


def labels(idep: InferenceDeployment, component: str) -> dict[str, str]:
    out = {
        c.LABEL_NAME: "disagg",
        **selector_labels(idep, component),
        c.LABEL_PART_OF: "disagg",
        c.LABEL_MANAGED_BY: c.FIELD_MANAGER,
        c.LABEL_DEPLOYMENT: idep.name,
    }
    if component in (*c.ROLES, "router"):
        # The role label is how the autoscaler finds the pods whose /metrics it reads.
        out[c.LABEL_ROLE] = component
    return out


def owner_reference(idep: InferenceDeployment) -> dict:
    return {
        "apiVersion": c.API_VERSION,
        "kind": c.KIND,
        "name": idep.name,
        "uid": idep.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def metadata(idep: InferenceDeployment, name: str, component: str) -> dict:
    return {
        "name": name,
        "namespace": idep.namespace,
        "labels": labels(idep, component),
        "ownerReferences": [owner_reference(idep)],
    }


def digest(data: object) -> str:
    """A short stable hash of JSON-able data, put in pod annotations so pods roll when it changes."""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def pull_secrets(idep: InferenceDeployment) -> list[dict]:
    return [{"name": name} for name in idep.spec.image.pull_secrets]
