"""tensorParallelSize per role: the worker pod a role with several ranks gets (the flag, one GPU per
rank, a /dev/shm sized for the ranks), and the refusals that name the field: GPU counts that do not
match, more ranks than a node holds, and prefill/decode roles over the gRPC KV fallback."""

from __future__ import annotations

import kubernetes_validate
import pytest
from kube_emulator import load_example

from disagg.operator import rollout
from disagg.operator import spec as specs
from disagg.operator.builders import build_children, workers
from disagg.operator.settings import Settings
from disagg.worker import cli
from disagg.worker.engine.args import cli_flag

KUBE_VERSION = "1.35"


def _role_pod(example: str, role: str, **role_spec) -> tuple[dict, dict]:
    """The role's StatefulSet and its worker container, built with `role_spec` merged in."""
    body = load_example(example)
    body["spec"][role].update(role_spec)
    sts = workers.statefulset(specs.parse(body), role)
    kubernetes_validate.validate(rollout.stamp(sts), KUBE_VERSION, strict=True)
    return sts, sts["spec"]["template"]["spec"]["containers"][0]


def _worker_args(container: dict):
    argv = [a.replace("$(POD_NAME)", "pod-0").replace("$(POD_IP)", "10.0.0.1") for a in container["args"]]
    _module, args = cli.parse(argv)
    return args


def _shm(sts: dict) -> dict:
    (vol,) = [v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == workers.SHM_VOLUME]
    return vol


def test_a_gpu_role_gets_one_gpu_per_rank_the_flag_and_shared_memory_for_its_ranks():
    gpus = {"requests": {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": 4},
            "limits": {"memory": "96Gi", "nvidia.com/gpu": 4}}  # fmt: skip
    sts, container = _role_pod("gpu-llama3-8b.yaml", "prefill", tensorParallelSize=4, resources=gpus)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 4
    args = _worker_args(container)
    assert args.tensor_parallel_size == 4 and args.device == "cuda" and args.role == "prefill"
    assert _shm(sts) == {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "4Gi"}}


def test_gpus_given_only_as_a_request_become_the_limit_too():
    gpus = {"requests": {"nvidia.com/gpu": 2}, "limits": {"memory": "96Gi"}}
    _sts, container = _role_pod("gpu-llama3-8b.yaml", "decode", tensorParallelSize=2, resources=gpus)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2


def test_a_cpu_role_runs_its_ranks_without_gpus():
    sts, container = _role_pod("cpu-tiny.yaml", "decode", tensorParallelSize=2)
    assert "nvidia.com/gpu" not in str(container.get("resources"))
    args = _worker_args(container)
    assert args.tensor_parallel_size == 2 and args.device == "cpu"
    assert _shm(sts)["emptyDir"]["sizeLimit"] == "2Gi"


def test_one_rank_pods_are_unchanged():
    sts, container = _role_pod("gpu-llama3-8b.yaml", "decode")
    assert cli_flag("tensor_parallel_size") not in container["args"]
    assert _shm(sts) == {"name": "dshm", "emptyDir": {"medium": "Memory"}}


@pytest.mark.parametrize(("count", "problem"), [(1, "need at least that many GPUs"), (8, "must equal")])
def test_a_gpu_count_other_than_the_rank_count_is_refused_naming_the_limit(count, problem):
    gpus = {"limits": {"memory": "96Gi", "nvidia.com/gpu": count}}
    with pytest.raises(specs.SpecError, match=problem) as err:
        _role_pod("gpu-llama3-8b.yaml", "prefill", tensorParallelSize=2, resources=gpus)
    assert err.value.path == "spec.prefill.resources.limits.nvidia.com/gpu"


def _body(role: str, tp: int, gpus: int | None) -> dict:
    body = load_example("gpu-llama3-8b.yaml")
    if gpus is not None:
        body["spec"][role]["resources"] = {"limits": {"memory": "96Gi", "nvidia.com/gpu": gpus}}
    body["spec"][role]["tensorParallelSize"] = tp
    return body


def test_more_ranks_than_a_node_holds_are_refused_naming_the_field():
    body = _body("decode", 8, 8)
    with pytest.raises(specs.SpecError, match="at most 4 GPUs") as err:
        build_children(specs.parse(body), body, settings=Settings(gpus_per_node=4))
    assert err.value.path == "spec.decode.tensorParallelSize"
    assert "LeaderWorkerSet" in str(err.value)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_tensor_parallel_prefill_and_decode_build_over_nixl_and_are_refused_over_grpc(role):
    body = _body(role, 2, 2)
    children = build_children(specs.parse(body), body)
    (sts,) = [c for c in children if c["kind"] == "StatefulSet" and c["metadata"]["name"].endswith(role)]
    args = _worker_args(sts["spec"]["template"]["spec"]["containers"][0])
    assert (args.tensor_parallel_size, args.role, args.kv_transfer) == (2, role, "nixl")
    body["spec"]["kvTransfer"] = {"backend": "grpc"}
    with pytest.raises(specs.SpecError, match="over nixl only") as err:
        build_children(specs.parse(body), body)
    assert err.value.path == "spec.kvTransfer.backend"


def test_the_operator_flag_sets_the_node_size():
    import argparse

    from disagg.operator.main import add_arguments, settings_from

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert settings_from(parser.parse_args(["--gpus-per-node", "4"])).gpus_per_node == 4
    with pytest.raises(SystemExit, match="--gpus-per-node must be at least 1"):
        settings_from(parser.parse_args(["--gpus-per-node", "0"]))
