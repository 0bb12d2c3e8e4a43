"""What pods get from Secrets: the deployment's generated credentials, the external Redis password,
the gRPC TLS files. Only references: the operator never reads a Secret's data.

The generated Secret (`<name>-credentials`) holds the internal token every gRPC call and `/drain`
carry, and the managed Redis' password. The operator creates it once with random values and never
updates it (see `disagg.operator.credential_secret`); its owner reference lets it go with the
deployment.
"""

from __future__ import annotations

from disagg.operator.builders import common, hardening
from disagg.operator.spec import GrpcTLS, InferenceDeployment

INTERNAL_TOKEN_KEY = "internal-token"
REDIS_PASSWORD_KEY = "redis-password"
TLS_DIR = "/etc/disagg/grpc-tls"
TLS_VOLUME = "grpc-tls"
PEER_IDENTITY_ENV = "DISAGG_PEER_IDENTITY"  # worker/serving/auth.py reads it


def credentials_name(idep: InferenceDeployment) -> str:
    return f"{idep.name}-credentials"


def credentials_secret(idep: InferenceDeployment, *, internal_token: str, redis_password: str) -> dict:
    """The generated Secret, with values the caller drew (this module stays free of randomness)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": common.metadata(idep, credentials_name(idep), "credentials"),
        "type": "Opaque",
        "stringData": {INTERNAL_TOKEN_KEY: internal_token, REDIS_PASSWORD_KEY: redis_password},
    }


def _from_secret(env: str, name: str, key: str) -> dict:
    return {"name": env, "valueFrom": {"secretKeyRef": {"name": name, "key": key}}}


def internal_token_env(idep: InferenceDeployment) -> list[dict]:
    return [_from_secret("DISAGG_INTERNAL_TOKEN", credentials_name(idep), INTERNAL_TOKEN_KEY)]


def redis_password_env(idep: InferenceDeployment) -> list[dict]:
    """The Redis password beside the URL, never in it (URLs get printed): the generated one for the
    managed Redis, the user's Secret for an external one (none when it has no password)."""
    redis = idep.spec.redis
    if redis.managed:
        return [_from_secret("DISAGG_REDIS_PASSWORD", credentials_name(idep), REDIS_PASSWORD_KEY)]
    if redis.password is None:
        return []
    return [_from_secret("DISAGG_REDIS_PASSWORD", redis.password.name, redis.password.key)]


def tls_env(idep: InferenceDeployment) -> list[dict]:
    tls = idep.spec.grpc_tls
    if tls is None:
        return []
    env = [{"name": "DISAGG_GRPC_TLS_DIR", "value": TLS_DIR}]
    if tls.server_name:
        env.append({"name": "DISAGG_GRPC_TLS_SERVER_NAME", "value": tls.server_name})
    return env


def tls_volumes(idep: InferenceDeployment) -> list[dict]:
    tls = idep.spec.grpc_tls
    if tls is None:
        return []
    if tls.per_pod is not None:
        return [per_pod_certificate_volume(tls)]
    # 0440 with the pods' fsGroup: the key is readable by the serving process and no one else.
    return [{"name": TLS_VOLUME, "secret": {"secretName": tls.secret_name, "defaultMode": 0o440}}]


def per_pod_certificate_volume(tls: GrpcTLS) -> dict:
    """cert-manager's csi-driver: a key made on the node, never leaving it, and a certificate
    naming the pod (a worker's id is its pod's name), in the same file layout as a TLS Secret."""
    issuer = tls.per_pod
    attributes = {
        "csi.cert-manager.io/issuer-name": issuer.name,
        "csi.cert-manager.io/issuer-kind": issuer.kind,
        "csi.cert-manager.io/issuer-group": issuer.group,
        "csi.cert-manager.io/common-name": "${POD_NAME}",  # the driver's variable, not a shell's
        "csi.cert-manager.io/dns-names": tls.server_name,
        "csi.cert-manager.io/duration": issuer.duration,
        "csi.cert-manager.io/fs-group": str(hardening.USER),  # the key readable by the serving user
    }
    return {"name": TLS_VOLUME, "csi": {"driver": "csi.cert-manager.io", "readOnly": True,
                                        "volumeAttributes": attributes}}  # fmt: skip


def worker_identity_env(idep: InferenceDeployment) -> list[dict]:
    """With a certificate per pod, each worker acts only for itself (a worker setting: the router
    serves no gRPC)."""
    tls = idep.spec.grpc_tls
    if tls is None or tls.per_pod is None:
        return []
    return [{"name": PEER_IDENTITY_ENV, "value": "certificate"}]


def tls_mounts(idep: InferenceDeployment) -> list[dict]:
    if idep.spec.grpc_tls is None:
        return []
    return [{"name": TLS_VOLUME, "mountPath": TLS_DIR, "readOnly": True}]


def serving_env(idep: InferenceDeployment) -> list[dict]:
    """Every Secret-backed setting of a worker or router container."""
    return [*internal_token_env(idep), *redis_password_env(idep), *tls_env(idep)]
