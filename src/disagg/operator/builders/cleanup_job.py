"""The deletion Job: `disagg cleanup` removes a deployment's keys from its external Redis.

An external Redis outlives the deployment and not all of its keys expire. The work needs the Redis
password, which the operator never holds, so it runs as a Job whose pod gets the password from the
user's Secret. The Job has no owner: it must outlive the InferenceDeployment it cleans up after,
and the TTL controller deletes it once finished. A managed Redis needs none (it is
garbage-collected with the other children).
"""

from __future__ import annotations

from disagg.operator import footprints
from disagg.operator.builders import common, hardening, secrets
from disagg.operator.spec import InferenceDeployment
from disagg.worker.serving.process_args import DeploymentArgs

TTL_AFTER_FINISHED_SECONDS = 600
DEADLINE_SECONDS = 300
BACKOFF_LIMIT = 3


def job_name(idep: InferenceDeployment) -> str:
    # The uid tells apart a deployment deleted and created again under the same name.
    return f"{idep.name}-cleanup-{idep.uid[:8]}".rstrip("-")


def command(idep: InferenceDeployment) -> list[str]:
    flag = DeploymentArgs.cli_flag  # `disagg cleanup` names the Redis and deployment as every process does
    return [
        "disagg",
        "cleanup",
        flag("redis_url"),
        common.redis_url(idep),
        flag("deployment"),
        idep.deployment_id,
    ]


def job(idep: InferenceDeployment) -> dict:
    labels = {**common.labels(idep, "cleanup")}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": job_name(idep), "namespace": idep.namespace, "labels": labels},
        "spec": {
            "ttlSecondsAfterFinished": TTL_AFTER_FINISHED_SECONDS,
            "activeDeadlineSeconds": DEADLINE_SECONDS,
            "backoffLimit": BACKOFF_LIMIT,
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "restartPolicy": "Never",
                    "automountServiceAccountToken": False,
                    "securityContext": hardening.pod(),
                    "containers": [
                        {
                            "name": "cleanup",
                            "image": idep.spec.image.ref,
                            "imagePullPolicy": idep.spec.image.pull_policy,
                            "command": command(idep),
                            "env": [*secrets.redis_password_env(idep), *hardening.scratch_env()],
                            "volumeMounts": hardening.scratch_mounts(),
                            "resources": footprints.CLEANUP_JOB,
                            "securityContext": hardening.container(),
                        }
                    ],
                    "volumes": hardening.scratch_volumes(),
                    **(
                        {"imagePullSecrets": common.pull_secrets(idep)}
                        if idep.spec.image.pull_secrets
                        else {}
                    ),
                },
            },
        },
    }
