"""The pure builders: every child of the examples, validated strictly against Kubernetes' own schemas."""

from __future__ import annotations

import copy
import sys

import kubernetes_validate
import pytest
from kube_emulator import load_example

from disagg.operator import constants as c
from disagg.operator import rollout
from disagg.operator import spec as specs
from disagg.operator import status as statuses
from disagg.operator.builders import build_children, common, workers
from disagg.operator.settings import Settings
from disagg.worker.cli.flags import Drain, MakeModel
from disagg.worker.engine.args import cli_flag
from disagg.worker.serving.process_args import WorkerProcessArgs

KUBE_VERSION = "1.35"
EXAMPLES = ("cpu-tiny.yaml", "gpu-llama3-8b.yaml")


def children(body: dict, **kwargs) -> dict[tuple[str, str], dict]:
    out = build_children(specs.parse(body), body, **kwargs)
    return {(m["kind"], m["metadata"]["name"]): m for m in out}


def worker(kids: dict, name: str, role: str) -> dict:
    return kids["StatefulSet", f"{name}-{role}"]["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("example", EXAMPLES)
def test_every_child_validates_strictly(example):
    body = load_example(example)
    kids = build_children(specs.parse(body), body, service_monitor_available=True)
    kinds = sorted({m["kind"] for m in kids})
    assert kinds == [
        "ConfigMap",
        "Deployment",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "Service",
        "ServiceAccount",
        "ServiceMonitor",
        "StatefulSet",
    ]
    for manifest in kids:
        if manifest["kind"] == "ServiceMonitor":
            continue  # a custom resource: Kubernetes ships no schema for it
        kubernetes_validate.validate(rollout.stamp(manifest), KUBE_VERSION, strict=True)


@pytest.mark.parametrize("example", EXAMPLES)
def test_role_identity_labels_and_owners(example):
    body = load_example(example, uid="u-42")
    name = body["metadata"]["name"]
    kids = children(body)
    for role in c.ROLES:
        sts = kids["StatefulSet", f"{name}-{role}"]
        for labels in (sts["metadata"]["labels"], sts["spec"]["template"]["metadata"]["labels"]):
            assert labels[c.LABEL_ROLE] == role
            assert labels[c.LABEL_DEPLOYMENT] == name
            assert labels[c.LABEL_INSTANCE] == name
        assert (
            sts["spec"]["selector"]["matchLabels"].items()
            <= sts["spec"]["template"]["metadata"]["labels"].items()
        )
        main = worker(kids, name, role)
        assert main["args"][:3] == ["worker", WorkerProcessArgs.cli_flag("role"), role]
        assert {"name": "DISAGG_ROLE", "value": role} in main["env"]
        assert {"name": "DISAGG_DEPLOYMENT", "value": f"default.{name}"} in main["env"]
        # /drain needs the internal credential: the hook runs `disagg drain`, which reads it
        hook = main["lifecycle"]["preStop"]["exec"]["command"]
        assert hook[:2] == ["disagg", "drain"] and hook[hook.index(Drain.URL) + 1].endswith(":9100/drain")
        assert main["readinessProbe"]["httpGet"]["path"] == "/health"
        assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in sts["spec"]["template"]["spec"][
            "volumes"
        ]
    for manifest in kids.values():
        (owner,) = manifest["metadata"]["ownerReferences"]
        assert owner == {
            "apiVersion": "disagg.dev/v1alpha1",
            "kind": "InferenceDeployment",
            "name": name,
            "uid": "u-42",
            "controller": True,
            "blockOwnerDeletion": True,
        }


def test_gpu_example_resources_rdma_ucx_and_model_download():
    body = load_example("gpu-llama3-8b.yaml")
    kids = children(body)
    decode = worker(kids, "llama3-8b", "decode")
    assert decode["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert decode["resources"]["limits"]["rdma/hca"] == 1
    assert decode["resources"]["requests"]["rdma/hca"] == 1
    assert decode["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    assert {"name": "UCX_TLS", "value": "rc,cuda_copy,cuda_ipc,tcp"} in decode["env"]
    pod = kids["StatefulSet", "llama3-8b-decode"]["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 900
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    (init,) = pod["initContainers"]
    assert init["args"][:2] == ["download", "meta-llama/Llama-3.1-8B-Instruct"]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}} in init[
        "env"
    ]
    assert {"name": "model", "emptyDir": {"sizeLimit": "40Gi"}} in pod["volumes"]
    # Both pools start at minReplicas until the autoscaler has decided.
    assert kids["StatefulSet", "llama3-8b-prefill"]["spec"]["replicas"] == 2
    assert kids["StatefulSet", "llama3-8b-decode"]["spec"]["replicas"] == 4
    router = kids["Deployment", "llama3-8b-router"]["spec"]["template"]["spec"]["containers"][0]
    assert router["args"][-2:] == ["--api-key-file", "/etc/disagg/api-keys/api-keys"]
    assert kids["Service", "llama3-8b"]["spec"]["type"] == "LoadBalancer"


def test_cpu_example_generates_the_tiny_model():
    kids = children(load_example("cpu-tiny.yaml"))
    pod = kids["StatefulSet", "tiny-prefill"]["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["args"] == ["make-model", "/models/model", MakeModel.PRESET, "tiny", MakeModel.SEED, "0"]
    args = pod["containers"][0]["args"]
    assert args[args.index(cli_flag("model")) + 1] == "/models/model"
    assert args[args.index(cli_flag("dtype")) + 1] == "float32"
    assert args[args.index(cli_flag("quantization")) + 1] == "auto"  # the CRD default, passed through
    assert args[args.index(cli_flag("kv_cache_dtype")) + 1] == "auto"
    assert (
        args[args.index(WorkerProcessArgs.cli_flag("redis_url")) + 1]
        == "redis://tiny-redis.default.svc:6379/0"
    )


def test_quantization_is_passed_to_the_workers():
    body = load_example("cpu-tiny.yaml")
    body["spec"]["model"]["quantization"] = "int8"
    kids = children(body)
    for role in ("prefill", "decode"):
        args = kids["StatefulSet", f"tiny-{role}"]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index(cli_flag("quantization")) + 1] == "int8"
    body["spec"]["model"]["quantization"] = "int4"
    with pytest.raises(specs.SpecError, match="spec.model.quantization"):
        children(body)


def test_kv_cache_dtype_is_passed_to_the_workers():
    body = load_example("cpu-tiny.yaml")
    body["spec"]["model"]["kvCacheDtype"] = "int8"
    kids = children(body)
    for role in ("prefill", "decode"):
        args = kids["StatefulSet", f"tiny-{role}"]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index(cli_flag("kv_cache_dtype")) + 1] == "int8"
    body["spec"]["model"]["kvCacheDtype"] = "int4"
    with pytest.raises(specs.SpecError, match="spec.model.kvCacheDtype"):
        children(body)


def test_autoscaled_pools_are_created_at_the_autoscalers_count_or_min(monkeypatch):
    body = load_example("gpu-llama3-8b.yaml")
    body["status"] = {
        "prefill": {"autoscaling": {"desiredReplicas": 5}},
        "decode": {"autoscaling": {"desiredReplicas": 99}},
    }
    kids = children(body)
    assert kids["StatefulSet", "llama3-8b-prefill"]["spec"]["replicas"] == 5
    assert kids["StatefulSet", "llama3-8b-decode"]["spec"]["replicas"] == 16  # clamped to maxReplicas

    body["spec"]["decode"]["autoscaling"]["mode"] = "hpa"
    del body["status"]["decode"]  # the autoscaler drops the status of a role it no longer scales
    idep = specs.parse(body)
    assert workers.statefulset(idep, "decode")["spec"]["replicas"] == 4  # minReplicas; then the HPA's
    monkeypatch.setitem(sys.modules, "disagg.operator.autoscaling.hpa", None)  # a build without HPA support
    with pytest.raises(RuntimeError, match=r"spec\.decode\.autoscaling\.mode is hpa"):
        build_children(idep, body)


def test_model_sources_mount_the_checkpoint_read_only():
    body = load_example("cpu-tiny.yaml")
    body["spec"]["model"]["source"] = {"pvc": {"claimName": "models", "path": "llama/8b"}}
    kids = children(body)
    pod = kids["StatefulSet", "tiny-decode"]["spec"]["template"]["spec"]
    assert "initContainers" not in pod
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in pod[
        "volumes"
    ]
    args = pod["containers"][0]["args"]
    assert args[args.index(cli_flag("model")) + 1] == "/models/llama/8b"
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in pod["containers"][0]["volumeMounts"]

    body["spec"]["model"]["source"] = {"hostPath": {"path": "/data/tiny"}}
    allowed = Settings(host_path_prefixes=("/data",))
    for outside in ("/data/../etc", "/database", "/"):
        escaped = {
            **body,
            "spec": {
                **body["spec"],
                "model": {**body["spec"]["model"], "source": {"hostPath": {"path": outside}}},
            },
        }
        with pytest.raises(specs.SpecError, match="hostPath.path"):
            children(escaped, settings=allowed)
    pod = children(body, settings=allowed)["StatefulSet", "tiny-decode"]["spec"]["template"]["spec"]
    assert {"name": "model", "hostPath": {"path": "/data/tiny", "type": "Directory"}} in pod["volumes"]


def test_external_redis_password_comes_from_a_secret():
    body = load_example("cpu-tiny.yaml")
    body["spec"]["redis"] = {
        "external": {"url": "redis://cache.infra.svc:6379/2", "passwordSecret": {"name": "redis-auth"}}
    }
    kids = children(body)
    assert ("StatefulSet", "tiny-redis") not in kids
    main = worker(kids, "tiny", "decode")
    args = main["args"]
    assert args[args.index(WorkerProcessArgs.cli_flag("redis_url")) + 1] == "redis://cache.infra.svc:6379/2"
    assert {
        "name": "DISAGG_REDIS_PASSWORD",
        "valueFrom": {"secretKeyRef": {"name": "redis-auth", "key": "password"}},
    } in main["env"]


def test_per_pod_certificates_give_each_worker_its_own_identity():
    body = load_example("cpu-tiny.yaml")
    body["spec"]["grpcTLS"] = {
        "perPodIssuer": {"name": "mesh-ca", "kind": "ClusterIssuer"},
        "serverName": "tiny.disagg",
    }
    kids = children(body)
    router = kids["Deployment", "tiny-router"]["spec"]["template"]["spec"]
    for pod in (
        kids["StatefulSet", f"tiny-{role}"]["spec"]["template"]["spec"] for role in ("prefill", "decode")
    ):
        main = pod["containers"][0]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "grpc-tls"]
        assert volume["csi"]["driver"] == "csi.cert-manager.io" and volume["csi"]["readOnly"]
        attributes = volume["csi"]["volumeAttributes"]
        # the certificate names the pod, and the worker's id is its pod's name
        assert attributes["csi.cert-manager.io/common-name"] == "${POD_NAME}"
        assert main["args"][main["args"].index(WorkerProcessArgs.cli_flag("worker_id")) + 1] == "$(POD_NAME)"
        assert attributes["csi.cert-manager.io/issuer-name"] == "mesh-ca"
        assert attributes["csi.cert-manager.io/issuer-kind"] == "ClusterIssuer"
        assert attributes["csi.cert-manager.io/dns-names"] == "tiny.disagg"
        assert attributes["csi.cert-manager.io/duration"] == "24h"
        assert attributes["csi.cert-manager.io/fs-group"] == str(pod["securityContext"]["fsGroup"])
        assert {"name": "DISAGG_PEER_IDENTITY", "value": "certificate"} in main["env"]
        assert {"name": "DISAGG_GRPC_TLS_SERVER_NAME", "value": "tiny.disagg"} in main["env"]
    # the router presents a certificate of its own too, and has no worker setting
    (volume,) = [v for v in router["volumes"] if v["name"] == "grpc-tls"]
    assert volume["csi"]["volumeAttributes"]["csi.cert-manager.io/common-name"] == "${POD_NAME}"
    assert all(e["name"] != "DISAGG_PEER_IDENTITY" for e in router["containers"][0]["env"])
    # one certificate for the whole deployment: no per-worker identity
    body["spec"]["grpcTLS"] = {"secretName": "grpc-tls"}
    main = worker(children(body), "tiny", "decode")
    assert all(e["name"] != "DISAGG_PEER_IDENTITY" for e in main["env"])


@pytest.mark.parametrize(
    ("mutate", "path"),
    [
        (
            lambda s: s["decode"].update(env=[{"name": "DISAGG_ROLE", "value": "prefill"}]),
            "spec.decode.env[0].name",
        ),
        (
            lambda s: s["decode"].update(env=[{"name": "DISAGG_PEER_IDENTITY", "value": "token"}]),
            "spec.decode.env[0].name",
        ),
        (
            lambda s: s["prefill"].update(tensorParallelSize=2, resources={"limits": {"nvidia.com/gpu": 1}}),
            "spec.prefill.resources.limits",
        ),
        (lambda s: s["model"].update(source={}), "spec.model.source"),
        (lambda s: s["model"].update(dtype="fp8"), "spec.model.dtype"),
        (lambda s: s["decode"].update(kvCache={"memoryFraction": 1.5}), "spec.decode.kvCache.memoryFraction"),
        (lambda s: s.pop("prefill"), "spec.prefill"),
        (lambda s: s["router"].update(prefillOverflow=-1), "spec.router.prefillOverflow"),
        (lambda s: s["router"].update(prefillOverflow="2"), "spec.router.prefillOverflow"),
        # a CPU worker's KV cache is sized from its pod's memory limit: there must be one
        (
            lambda s: s["prefill"].update(resources={"requests": {"cpu": 1}}),
            "spec.prefill.resources.limits.memory",
        ),
        # hostPath sources are off unless the operator's installer allows a prefix
        (
            lambda s: s["model"].update(source={"hostPath": {"path": "/etc"}}),
            "spec.model.source.hostPath.path",
        ),
        # a draft model lives beside the model on its volume: a generated model has no such volume
        (
            lambda s: s.update(speculativeDecoding={"method": "draft", "draftModelPath": "draft"}),
            "spec.speculativeDecoding.draftModelPath",
        ),
        (
            lambda s: s.update(speculativeDecoding={"method": "draft"}),
            "spec.speculativeDecoding.draftModelPath",
        ),
        (
            lambda s: s.update(speculativeDecoding={"method": "ngram", "draftModelPath": "draft"}),
            "spec.speculativeDecoding.draftModelPath",
        ),
    ],
)
def test_unbuildable_specs_name_the_field(mutate, path):
    body = load_example("cpu-tiny.yaml")
    mutate(body["spec"])
    with pytest.raises(specs.SpecError) as err:
        build_children(specs.parse(body), body)
    assert err.value.path.startswith(path), str(err.value)


def test_builders_are_deterministic_and_the_stamp_ignores_replicas():
    body = load_example("gpu-llama3-8b.yaml")
    first, second = children(body), children(copy.deepcopy(body))
    assert first == second
    sts = first["StatefulSet", "llama3-8b-decode"]
    scaled = copy.deepcopy(sts)
    scaled["spec"]["replicas"] = 9
    assert rollout.applied_hash(rollout.stamp(sts)) == rollout.applied_hash(rollout.stamp(scaled))
    changed = copy.deepcopy(sts)
    changed["spec"]["template"]["spec"]["containers"][0]["image"] = "other:1"
    assert rollout.applied_hash(rollout.stamp(sts)) != rollout.applied_hash(rollout.stamp(changed))


def _live(manifest: dict, *, ready: int, updated: int, generation: int = 1, observed: int = 1) -> dict:
    live = copy.deepcopy(manifest)
    live["metadata"]["generation"] = generation
    live["status"] = {"observedGeneration": observed, "readyReplicas": ready, "updatedReplicas": updated}
    return live


def test_rollout_holds_prefill_until_decode_has_rolled_out():
    body = load_example("cpu-tiny.yaml")
    old = [rollout.stamp(m) for m in build_children(specs.parse(body), body)]
    body["spec"]["image"]["tag"] = "next"
    new = [rollout.stamp(m) for m in build_children(specs.parse(body), body)]
    decode, prefill = ("StatefulSet", "tiny-decode"), ("StatefulSet", "tiny-prefill")
    observed = {(m["kind"], m["metadata"]["name"]): _live(m, ready=1, updated=1) for m in old}

    plan = rollout.plan(new, observed, decode, prefill)
    applied = {(m["kind"], m["metadata"]["name"]) for m in plan.apply}
    assert decode in applied and prefill not in applied
    assert [m["metadata"]["name"] for m in plan.held] == ["tiny-prefill"]

    by_key = {(m["kind"], m["metadata"]["name"]): m for m in new}
    observed[decode] = _live(by_key[decode], ready=1, updated=0, generation=2, observed=1)  # still rolling
    assert prefill not in {
        (m["kind"], m["metadata"]["name"]) for m in rollout.plan(new, observed, decode, prefill).apply
    }
    observed[decode] = _live(by_key[decode], ready=1, updated=1, generation=2, observed=2)
    plan = rollout.plan(new, observed, decode, prefill)
    assert prefill in {(m["kind"], m["metadata"]["name"]) for m in plan.apply}
    assert not plan.held

    # Everything current: nothing to write.
    observed = {k: _live(m, ready=1, updated=1) for k, m in by_key.items()}
    assert rollout.plan(new, observed, decode, prefill).apply == []


def test_first_creation_applies_both_pools_at_once():
    body = load_example("cpu-tiny.yaml")
    new = [rollout.stamp(m) for m in build_children(specs.parse(body), body)]
    plan = rollout.plan(new, {}, ("StatefulSet", "tiny-decode"), ("StatefulSet", "tiny-prefill"))
    assert len(plan.apply) == len(new) and not plan.held


def test_status_is_ready_only_when_every_role_is_rolled_out_and_keeps_transition_times():
    body = load_example("cpu-tiny.yaml")
    idep = specs.parse(body)
    kids = {(m["kind"], m["metadata"]["name"]): rollout.stamp(m) for m in build_children(idep, body)}
    desired = {
        "decode": kids["StatefulSet", "tiny-decode"],
        "prefill": kids["StatefulSet", "tiny-prefill"],
        "router": kids["Deployment", "tiny-router"],
    }
    ready = {n: _live(m, ready=1, updated=1) for n, m in desired.items()}
    args = dict(generation=1, endpoint=common.endpoint(idep), desired=desired, held=[])

    status = statuses.compute(observed=ready, timestamp="t1", **args)
    conds = {x["type"]: x for x in status["conditions"]}
    assert (conds["Ready"]["status"], conds["Progressing"]["status"], conds["Degraded"]["status"]) == (
        "True",
        "False",
        "False",
    )
    assert status["decode"] == {"ready": "1/1", "replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}

    again = statuses.compute(observed=ready, previous=status["conditions"], timestamp="t2", **args)
    assert again == status  # nothing changed: not even the transition times
    assert not statuses.changed(status, again)

    rolling = dict(ready, prefill=_live(desired["prefill"], ready=1, updated=0, generation=2, observed=2))
    later = statuses.compute(observed=rolling, previous=status["conditions"], timestamp="t3", **args)
    conds = {x["type"]: x for x in later["conditions"]}
    assert conds["Ready"]["status"] == "False" and conds["Ready"]["lastTransitionTime"] == "t3"
    assert conds["Ready"]["reason"] == "RolloutInProgress" and "prefill" in conds["Ready"]["message"]
    assert conds["Progressing"]["status"] == "True"
    assert statuses.changed(status, later)


def test_hpa_mode_adds_the_autoscalers_hpa_among_the_children():
    body = load_example("gpu-llama3-8b.yaml")
    body["spec"]["prefill"]["autoscaling"]["mode"] = "hpa"
    kids = children(body)
    hpa = kids["HorizontalPodAutoscaler", "llama3-8b-prefill"]
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "name": "llama3-8b-prefill",
    }
    assert kids["StatefulSet", "llama3-8b-prefill"]["spec"]["replicas"] == hpa["spec"]["minReplicas"]
    assert ("HorizontalPodAutoscaler", "llama3-8b-decode") not in kids
    kubernetes_validate.validate(rollout.stamp(hpa), KUBE_VERSION, strict=True)


def test_prefill_placement_reaches_the_decode_workers_only():
    from disagg.worker.serving.args import ServingArgs

    body = load_example("cpu-tiny.yaml")
    decode = worker(children(body), "tiny", "decode")["args"]
    flag = ServingArgs.cli_flag("prefill_placement")
    threshold = ServingArgs.cli_flag("disagg_threshold")
    # the CRD's defaults are the worker's
    assert decode[decode.index(flag) + 1] == ServingArgs.prefill_placement
    assert decode[decode.index(threshold) + 1] == str(ServingArgs.disagg_threshold)
    body["spec"]["kvTransfer"].update(prefillPlacement="threshold", disaggThreshold=16)
    kids = children(body)
    decode = worker(kids, "tiny", "decode")["args"]
    assert decode[decode.index(flag) + 1] == "threshold" and decode[decode.index(threshold) + 1] == "16"
    assert flag not in worker(kids, "tiny", "prefill")["args"]  # prefill workers do not decide


def test_a_terminating_router_keeps_listening_until_its_endpoint_is_gone():
    from disagg.operator.builders.router import SHUTDOWN_DELAY_SECONDS

    kids = children(load_example("cpu-tiny.yaml"))
    (router,) = kids["Deployment", "tiny-router"]["spec"]["template"]["spec"]["containers"]
    assert router["lifecycle"]["preStop"] == {"sleep": {"seconds": SHUTDOWN_DELAY_SECONDS}}
    assert SHUTDOWN_DELAY_SECONDS > 0


def _flag(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


@pytest.mark.parametrize("storage_class", [None, "local-nvme"])
def test_kv_tiers_reach_the_workers_with_their_volume(storage_class):
    body = load_example("cpu-tiny.yaml")
    disk = {"size": "10Gi"} if storage_class is None else {"size": "10Gi", "storageClassName": storage_class}
    body["spec"]["decode"]["kvCache"].update(host={"memory": "512Mi"}, disk=disk)
    name = body["metadata"]["name"]
    kids = children(body)
    args = worker(kids, name, "decode")["args"]
    assert _flag(args, cli_flag("kv_host_cache_memory")) == str(512 << 20)
    assert _flag(args, cli_flag("kv_disk_cache_dir")) == workers.KV_DISK_MOUNT
    assert _flag(args, cli_flag("kv_disk_cache_size")) == str(int(10 * 2**30 * workers.KV_DISK_FILL))
    assert cli_flag("kv_host_cache_memory") not in worker(kids, name, "prefill")["args"]
    sts = kids["StatefulSet", f"{name}-decode"]
    pod = sts["spec"]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert mounts[workers.KV_DISK_VOLUME] == workers.KV_DISK_MOUNT
    volumes = {v["name"]: v for v in pod["volumes"]}
    if storage_class is None:
        assert volumes[workers.KV_DISK_VOLUME]["emptyDir"] == {"sizeLimit": "10Gi"}
        assert "volumeClaimTemplates" not in sts["spec"]
    else:
        assert workers.KV_DISK_VOLUME not in volumes
        (claim,) = sts["spec"]["volumeClaimTemplates"]
        assert claim["metadata"]["name"] == workers.KV_DISK_VOLUME
        assert claim["spec"]["storageClassName"] == storage_class
        assert claim["spec"]["resources"]["requests"]["storage"] == "10Gi"
    kubernetes_validate.validate(rollout.stamp(sts), KUBE_VERSION, strict=True)


@pytest.mark.parametrize(
    ("host", "role_change", "field"),
    [
        ("2Gi", {}, "spec.decode.kvCache.host.memory"),  # the pod's whole memory limit
        ("1Gi", {"tensorParallelSize": 2}, "spec.decode.kvCache.host"),
        ("lots", {}, "spec.decode.kvCache.host.memory"),
    ],
)
def test_kv_tiers_a_worker_cannot_run_are_refused_naming_the_field(host, role_change, field):
    body = load_example("cpu-tiny.yaml")
    body["spec"]["decode"]["kvCache"]["host"] = {"memory": host}
    body["spec"]["decode"].update(role_change)
    with pytest.raises(specs.SpecError) as err:
        children(body)
    assert err.value.path == field


def test_quantities_read_as_bytes():
    assert specs.quantity_bytes("1Gi", "f") == 2**30
    assert specs.quantity_bytes("1.5Mi", "f") == 3 * 2**19
    assert specs.quantity_bytes("2G", "f") == 2 * 10**9
    assert specs.quantity_bytes("4096", "f") == 4096
    for bad in ("", "Gi", "1Xi", "-1Gi", "one"):
        with pytest.raises(specs.SpecError):
            specs.quantity_bytes(bad, "f")


def _pod_specs(kids) -> list[tuple[str, dict]]:
    out = []
    for m in kids:
        spec = m.get("spec") or {}
        template = (spec.get("jobTemplate") or {}).get("spec", spec).get("template")
        if template:
            out.append((f"{m['kind']} {m['metadata']['name']}", template["spec"]))
    return out


@pytest.mark.parametrize("example", EXAMPLES)
def test_every_container_of_every_pod_requests_cpu_and_memory_and_bounds_memory(example):
    """No pod the operator creates is BestEffort (the first to wait for a CPU and to be evicted):
    each container, init containers included, requests CPU and memory and has a memory limit."""
    from disagg.operator.builders import cleanup_job

    body = load_example(example)
    idep = specs.parse(body)
    kids = [*build_children(idep, body), cleanup_job.job(idep)]
    pods = _pod_specs(kids)
    assert {name.split()[0] for name, _ in pods} == {"StatefulSet", "Deployment", "Job"}
    for name, pod in pods:
        for ctr in [*pod.get("initContainers", []), *pod["containers"]]:
            res = ctr.get("resources") or {}
            assert {"cpu", "memory"} <= set(res.get("requests") or {}), (name, ctr["name"], res)
            assert "memory" in (res.get("limits") or {}), (name, ctr["name"], res)


def test_the_router_and_redis_run_under_the_serving_priority_class_unless_their_spec_names_one():
    body = load_example("cpu-tiny.yaml")
    settings = Settings(serving_priority_class="disagg-serving")
    kids = children(body, settings=settings)
    pod = lambda kind, name: kids[kind, name]["spec"]["template"]["spec"]  # noqa: E731
    assert pod("Deployment", "tiny-router")["priorityClassName"] == "disagg-serving"
    assert pod("StatefulSet", "tiny-redis")["priorityClassName"] == "disagg-serving"
    assert "priorityClassName" not in pod("StatefulSet", "tiny-decode")  # workers yield first
    assert "priorityClassName" not in children(body)["Deployment", "tiny-router"]["spec"]["template"]["spec"]

    body["spec"]["router"]["priorityClassName"] = "edge"
    body["spec"]["redis"] = {
        "managed": {
            "priorityClassName": "state",
            "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
        }
    }
    body["spec"]["decode"]["priorityClassName"] = "batch"
    kids = children(body, settings=settings)
    assert pod("Deployment", "tiny-router")["priorityClassName"] == "edge"
    redis = pod("StatefulSet", "tiny-redis")
    assert redis["priorityClassName"] == "state"
    assert redis["containers"][0]["resources"]["requests"] == {"cpu": "1", "memory": "1Gi"}
    assert redis["initContainers"][0]["resources"]["limits"] == {"memory": "2Gi"}
    assert pod("StatefulSet", "tiny-decode")["priorityClassName"] == "batch"


def test_the_router_defaults_are_what_the_crd_describes():
    """The CRD's description of `resources` states the router's and Redis' defaults (footprints)."""
    from test_operator_crd import SCHEMA

    from disagg.operator import footprints

    text = " ".join(
        SCHEMA["properties"]["spec"]["properties"]["router"]["properties"]["resources"]["description"].split()
    )
    for what in (footprints.ROUTER, footprints.REDIS):
        req, lim = what["requests"], what["limits"]
        assert f"cpu {req['cpu']} and memory {req['memory']} with a {lim['memory']} memory limit" in text, (
            text
        )
    assert specs.parse(load_example("cpu-tiny.yaml")).spec.router.resources == footprints.ROUTER
