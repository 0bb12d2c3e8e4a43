"""The managed Redis: one pod, no persistence (its contents are leases and indexes that rebuild)."""

from __future__ import annotations

from disagg.operator import constants as c
from disagg.operator.builders import common
from disagg.operator.spec import InferenceDeployment


def statefulset(idep: InferenceDeployment) -> dict:
    name = common.redis_name(idep)
    probe = {"tcpSocket": {"port": "redis"}, "periodSeconds": 5}
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
                    "securityContext": {"runAsNonRoot": True, "runAsUser": 999, "runAsGroup": 999},
                    "containers": [
                        {
                            "name": "redis",
                            "image": idep.spec.redis.image,
                            "args": ["--save", "", "--appendonly", "no", "--protected-mode", "no"],
                            "ports": [{"name": "redis", "containerPort": c.REDIS_PORT, "protocol": "TCP"}],
                            "readinessProbe": probe,
                            "livenessProbe": {**probe, "failureThreshold": 6},
                            "resources": {
                                "requests": {"cpu": "100m", "memory": "128Mi"},
                                "limits": {"memory": "1Gi"},
                            },
                            "securityContext": {
                                "allowPrivilegeEscalation": False,
                                "readOnlyRootFilesystem": True,
                                "capabilities": {"drop": ["ALL"]},
                            },
                            "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                        }
                    ],
                    "volumes": [{"name": "data", "emptyDir": {}}],
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
