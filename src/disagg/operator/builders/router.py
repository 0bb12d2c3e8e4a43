"""The OpenAI-compatible router: a Deployment and the Service that is the deployment's endpoint."""

from __future__ import annotations

from disagg.operator import footprints
from disagg.operator.builders import common, config, hardening, model, secrets, workers
from disagg.operator.settings import Settings
from disagg.operator.spec import InferenceDeployment
from disagg.worker.router.args import RouterArgs, RouterProcessArgs

API_KEYS_DIR = "/etc/disagg/api-keys"
SHUTDOWN_DELAY_SECONDS = 5  # see the container's preStop
HEALTH_PATH = "/health"  # 200 once a decode worker is known, else 503: readiness only
LIVE_PATH = "/metrics"  # answers whenever the server runs, whether or not workers are up yet


def _args(idep: InferenceDeployment) -> list[str]:
    router = idep.spec.router
    flag = RouterProcessArgs.cli_flag
    args = [
        "router",
        flag("host"),
        workers.BIND_ALL,
        flag("port"),
        str(router.port),
        flag("redis_url"),
        common.redis_url(idep),
        flag("deployment"),
        idep.deployment_id,
        flag("model"),
        model.model_dir(idep),
        flag("model_name"),
        idep.spec.model.name,
        # The router hashes prompts into blocks for the prefix index: the workers' block size.
        RouterArgs.cli_flag("block_size"),
        str(idep.spec.decode.block_size),
    ]
    if idep.spec.model.max_model_length is not None:
        args += [RouterArgs.cli_flag("max_model_len"), str(idep.spec.model.max_model_length)]
    if router.prefill_overflow is not None:
        args += [RouterArgs.cli_flag("prefill_overflow"), f"{router.prefill_overflow:g}"]
    if router.api_key is not None:
        args += [flag("api_key_file"), f"{API_KEYS_DIR}/{router.api_key.key}"]
    return args


def deployment(idep: InferenceDeployment, settings: Settings = Settings()) -> dict:  # noqa: B008
    spec = idep.spec
    router = spec.router
    health = {"path": HEALTH_PATH, "port": "http"}
    container = {
        "name": "router",
        "image": spec.image.ref,
        "imagePullPolicy": spec.image.pull_policy,
        "command": ["disagg"],
        "args": _args(idep),
        "env": [*secrets.serving_env(idep), *hardening.scratch_env()],
        "envFrom": [{"configMapRef": {"name": common.config_name(idep)}}],
        "ports": [{"name": "http", "containerPort": router.port, "protocol": "TCP"}],
        "readinessProbe": {"httpGet": health, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {
            "httpGet": {"path": LIVE_PATH, "port": "http"},
            "periodSeconds": 10,
            "failureThreshold": 6,
        },
        "volumeMounts": [
            *hardening.scratch_mounts(),
            model.mount(idep, read_only=True),
            *secrets.tls_mounts(idep),
        ],
        # A terminating router keeps listening while its endpoint leaves every node's Service
        # rules; stopping at once refuses the connections still routed to it (a rollout's errors).
        "lifecycle": {"preStop": {"sleep": {"seconds": SHUTDOWN_DELAY_SECONDS}}},
        "resources": router.resources,
        "securityContext": hardening.container(),
    }
    volumes = [
        *hardening.scratch_volumes(),
        model.volume(idep, tokenizer_only=True),
        *secrets.tls_volumes(idep),
    ]
    if router.api_key is not None:
        container["volumeMounts"].append({"name": "api-keys", "mountPath": API_KEYS_DIR, "readOnly": True})
        volumes.append({"name": "api-keys", "secret": {"secretName": router.api_key.name}})
    pod_spec = {
        "serviceAccountName": common.service_account_name(idep),
        "automountServiceAccountToken": False,
        "securityContext": hardening.pod(),
        "initContainers": [
            {**init, "resources": footprints.for_init_container(router.resources)}
            for init in model.init_containers(idep, tokenizer_only=True)
        ],
        "containers": [container],
        "volumes": volumes,
    }
    if not pod_spec["initContainers"]:
        del pod_spec["initContainers"]
    if spec.image.pull_secrets:
        pod_spec["imagePullSecrets"] = common.pull_secrets(idep)
    priority_class = router.priority_class or settings.serving_priority_class
    if priority_class:
        pod_spec["priorityClassName"] = priority_class
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": common.metadata(idep, common.router_name(idep), "router"),
        "spec": {
            "replicas": router.replicas,
            "selector": {"matchLabels": common.selector_labels(idep, "router")},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {
                    "labels": common.labels(idep, "router"),
                    "annotations": {config.CONFIG_HASH_ANNOTATION: config.config_hash(idep)},
                },
                "spec": pod_spec,
            },
        },
    }


def service(idep: InferenceDeployment) -> dict:
    router = idep.spec.router
    meta = common.metadata(idep, common.api_service_name(idep), "router")
    if router.service_annotations:
        meta["annotations"] = dict(router.service_annotations)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "type": router.service_type,
            "selector": common.selector_labels(idep, "router"),
            "ports": [{"name": "http", "port": router.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }
