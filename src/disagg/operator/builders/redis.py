"""The managed Redis: one pod, no persistence (its contents are leases and indexes that rebuild).

It requires the generated password (`requirepass`) and keeps protected mode on. The password
reaches redis-server through a config file an init container writes from the Secret-backed
environment with the shell's built-in printf: it appears in no command line, argument or pod spec.
"""

from __future__ import annotations

from disagg.operator import constants as c
from disagg.operator import footprints
from disagg.operator.builders import common, hardening, secrets
from disagg.operator.settings import Settings
from disagg.operator.spec import InferenceDeployment

USER = 999  # the redis user of the official image
AUTH_DIR = "/etc/redis-auth"
AUTH_FILE = f"{AUTH_DIR}/auth.conf"
PASSWORD_ENV = "REDIS_PASSWORD"
# umask 077: the file is the server's alone. printf is a shell builtin, so no process's argv holds it.
WRITE_CONFIG = f"umask 077 && printf 'requirepass %s\\n' \"${PASSWORD_ENV}\" > {AUTH_FILE}"


def server_args() -> list[str]:
    return [AUTH_FILE, "--save", "", "--appendonly", "no", "--protected-mode", "yes"]


def statefulset(idep: InferenceDeployment, settings: Settings = Settings()) -> dict:  # noqa: B008
    name = common.redis_name(idep)
    probe = {"tcpSocket": {"port": "redis"}, "periodSeconds": 5}
    password = {
        "name": PASSWORD_ENV,
        "valueFrom": {
            "secretKeyRef": {"name": secrets.credentials_name(idep), "key": secrets.REDIS_PASSWORD_KEY}
        },
    }
    auth_mount = {"name": "auth", "mountPath": AUTH_DIR}
    priority_class = idep.spec.redis.priority_class or settings.serving_priority_class
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": common.metadata(idep, name, "redis"),
        "spec": {
            "replicas": 1,
            "serviceName": name,
            "selector": {"matchLabels": common.selector_labels(idep, "redis")},
            "template": {
                "metadata": {"labels": common.labels(idep, "redis")},
                "spec": {
                    "serviceAccountName": common.service_account_name(idep),
                    "automountServiceAccountToken": False,
                    **({"priorityClassName": priority_class} if priority_class else {}),
                    "securityContext": hardening.pod(USER, fs_group=False),
                    "initContainers": [
                        {
                            "name": "auth-config",
                            "image": idep.spec.redis.image,
                            "command": ["sh", "-c", WRITE_CONFIG],
                            "env": [password],
                            "volumeMounts": [auth_mount],
                            "resources": footprints.for_init_container(idep.spec.redis.resources),
                            "securityContext": hardening.container(),
                        }
                    ],
                    "containers": [
                        {
                            "name": "redis",
                            "image": idep.spec.redis.image,
                            "command": ["redis-server"],
                            "args": server_args(),
                            "ports": [{"name": "redis", "containerPort": c.REDIS_PORT, "protocol": "TCP"}],
                            "readinessProbe": probe,
                            "livenessProbe": {**probe, "failureThreshold": 6},
                            "resources": idep.spec.redis.resources,
                            "securityContext": hardening.container(),
                            "volumeMounts": [
                                {"name": "data", "mountPath": "/data"},
                                {**auth_mount, "readOnly": True},
                            ],
                        }
                    ],
                    "volumes": [
                        {"name": "data", "emptyDir": {}},
                        # In memory: the password never lands on the node's disk.
                        {"name": "auth", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
                    ],
                },
            },
        },
    }


def service(idep: InferenceDeployment) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": common.metadata(idep, common.redis_name(idep), "redis"),
        "spec": {
            "selector": common.selector_labels(idep, "redis"),
            "ports": [{"name": "redis", "port": c.REDIS_PORT, "targetPort": "redis", "protocol": "TCP"}],
        },
    }
