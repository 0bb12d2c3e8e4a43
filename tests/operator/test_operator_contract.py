"""The operator's pods run the real product.

Every worker and router container the operator builds (for every example and a few variants) is
parsed by the real `disagg` sub-command parsers with the container's environment applied the
way the kubelet applies it (ConfigMap, downward API, Secrets, `$(VAR)` expansion); the settings
that come out must agree with the probes, Services, volumes and with each other. The probe and
preStop paths are requested from the real HTTP servers, the generated-model init container is run,
the managed Redis runs from its pod spec, and the deletion Job's Redis cleanup is checked against
keys written by the workers' own `KVState`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import aiohttp
import pytest
import redis
import yaml
from aiohttp.test_utils import TestServer
from kube_emulator import ROOT, load_example

from disagg.operator import spec as specs
from disagg.operator.builders import build_children, model, workers
from disagg.operator.settings import Settings
from disagg.worker import cli
from disagg.worker.cli.flags import Drain
from disagg.worker.engine.args import cli_flag
from disagg.worker.kv_state import KVState, WorkerInfo
from disagg.worker.kv_state.keys import Keys
from disagg.worker.serving.process_args import WorkerProcessArgs

EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.yaml"))
POD_NAME = "pod-0"
POD_IP = "10.1.2.3"
# Characters that break a URL when spliced into one unquoted.
SECRET_VALUE = "p@ss/w%rd:1"
API_KEY = "sk-test"


# ---- the examples and variants -------------------------------------------------------------------


def _external_redis(spec: dict) -> None:
    spec["redis"] = {
        "external": {"url": "redis://cache.infra.svc:6379/2", "passwordSecret": {"name": "auth"}}
    }


def _pvc(spec: dict) -> None:
    spec["model"]["source"] = {"pvc": {"claimName": "models", "path": "llama/8b"}}


def _host_path(spec: dict) -> None:
    spec["model"]["source"] = {"hostPath": {"path": "/data/tiny"}}


# What an installer that allows host paths under /data runs the operator with.
SETTINGS = Settings(host_path_prefixes=("/data",))


def _api_key_and_auto_dtype(spec: dict) -> None:
    spec["router"]["apiKeySecret"] = {"name": "keys", "key": "list"}
    spec["model"]["dtype"] = "auto"
    spec["model"].pop("maxModelLength", None)


def _prefill_overflow(spec: dict) -> None:
    spec["router"]["prefillOverflow"] = 1.5


def _grpc_transfer_and_small_blocks(spec: dict) -> None:
    spec["kvTransfer"] = {"backend": "grpc"}
    for role in ("prefill", "decode"):
        spec[role]["kvCache"] = {"blockSize": 32, "memoryFraction": 0.5}


def _speculative_draft(spec: dict) -> None:
    spec["model"]["source"] = {"hostPath": {"path": "/data/models"}}
    spec["speculativeDecoding"] = {"method": "draft", "numTokens": 3, "draftModelPath": "tiny-draft"}


def _kv_tiers(spec: dict) -> None:
    spec["decode"]["kvCache"].update(host={"memory": "512Mi"}, disk={"size": "4Gi"})


VARIANTS = {
    "speculative-draft": _speculative_draft,
    "kv-tiers": _kv_tiers,
    "external-redis": _external_redis,
    "pvc": _pvc,
    "host-path": _host_path,
    "api-key-auto-dtype": _api_key_and_auto_dtype,
    "grpc-transfer": _grpc_transfer_and_small_blocks,
    "prefill-overflow": _prefill_overflow,
}
CASES = [(example, None) for example in EXAMPLES] + [("cpu-tiny.yaml", v) for v in VARIANTS]


def _body(example: str, variant: str | None) -> dict:
    body = load_example(example)
    if variant:
        VARIANTS[variant](body["spec"])
    return body


def _children(body: dict) -> dict[tuple[str, str], dict]:
    kids = build_children(specs.parse(body), body, settings=SETTINGS)
    return {(m["kind"], m["metadata"]["name"]): m for m in kids}


# ---- what the kubelet does to a container before it runs -------------------------------------------


def _expand(text: str, env: dict[str, str]) -> str:
    # Kubernetes' $(VAR) expansion: known names are replaced, unknown references stay as written.
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), text)


def container_env(
    container: dict, kids: dict, pod_name: str = POD_NAME, pod_ip: str = POD_IP
) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        name = source["configMapRef"]["name"]
        env.update(kids["ConfigMap", name]["data"])
    fields = {"metadata.name": pod_name, "status.podIP": pod_ip}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = _expand(item["value"], env)
            continue
        ref = item["valueFrom"]
        if "fieldRef" in ref:
            env[item["name"]] = fields[ref["fieldRef"]["fieldPath"]]
        else:
            assert "secretKeyRef" in ref, item
            env[item["name"]] = SECRET_VALUE
    return env


INTERNAL_TOKEN_ENV = "DISAGG_INTERNAL_TOKEN"
INTERNAL_HEADERS = {"Authorization": f"Bearer {SECRET_VALUE}"}


class RecordingEnviron(dict):
    """os.environ for the CLI under test: only the container's variables, and a record of reads."""

    def __init__(self, values: dict[str, str]):
        super().__init__(values)
        self.read: set[str] = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)


@contextlib.contextmanager
def container_environ(env: dict[str, str]):
    saved = os.environ
    recording = RecordingEnviron(env)
    # Replaced, not cleared: the CLIs only look names up, and the real environment stays intact.
    os.environ = recording  # noqa: B003
    try:
        yield recording
    finally:
        os.environ = saved  # noqa: B003


def parse_container(container: dict, kids: dict) -> tuple[argparse.Namespace, dict, RecordingEnviron]:
    """The container's command line as `disagg` parses it in the pod (the CLI's own dispatch)."""
    assert container["command"] == ["disagg"]
    env = container_env(container, kids)
    argv = [_expand(a, env) for a in container["args"]]
    assert not any("$(" in a for a in argv), f"unresolved variable in {argv}"
    assert argv[0] in cli.COMMANDS, f"`disagg {argv[0]}` is not a command of the CLI"
    with container_environ(env) as recording:
        _module, args = cli.parse(argv)
    return args, env, recording


def _port(container: dict, name: str) -> int:
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == name]
    return port


def _service_target(service: dict, port_name: str) -> str:
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == port_name]
    return port["targetPort"]


def _mounted_volume(pod: dict, container: dict, path: str) -> dict:
    """The pod volume that holds `path` in the container (the longest mount prefix)."""
    mounts = [
        m for m in container["volumeMounts"] if (path + "/").startswith(m["mountPath"].rstrip("/") + "/")
    ]
    assert mounts, f"{path} is on no volume of {container['name']}"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return volume


def _probe_paths(container: dict) -> dict[str, tuple[str, str]]:
    out = {}
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        if kind in container:
            http = container[kind]["httpGet"]
            out[kind] = (http["path"], http["port"])
    if "exec" in container.get("lifecycle", {}).get("preStop", {}):  # the router's is a plain sleep
        url = urllib.parse.urlsplit(_prestop(container)[1].url)
        assert url.hostname == "127.0.0.1"  # the hook runs inside the pod
        (name,) = [p["name"] for p in container["ports"] if p["containerPort"] == url.port]
        out["preStop"] = (url.path, name)
    return out


def _prestop(container: dict, env: dict | None = None):
    """The preStop exec hook as the real `disagg` CLI parses it (in the container's environment)."""
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "disagg"
    with container_environ(env or {}):
        return cli.parse(command[1:])


def _checkpoint(path: Path, dtype: str = "float32") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(f'{{"torch_dtype": "{dtype}", "max_position_embeddings": 4096}}')
    return path


def _worker_config(args, tmp_path: Path, env: dict, dtype: str = "bfloat16"):
    """`config_from_args` in the pod, with the mounted checkpoint stood in for by a local one."""
    from disagg.worker.cli import worker as worker_cmd

    args.model = str(_checkpoint(tmp_path / "ckpt", dtype))
    with container_environ(env) as recording:
        cfg = worker_cmd.config_from_args(args)
    return cfg, recording


def _disagg_env(container: dict) -> set[str]:
    return {e["name"] for e in container.get("env", []) if e["name"].startswith("DISAGG_")}


# ---- the worker pods ------------------------------------------------------------------------------


@pytest.mark.parametrize(("example", "variant"), CASES)
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_worker_containers_parse_with_the_real_cli(example, variant, role, tmp_path):
    body = _body(example, variant)
    idep = specs.parse(body)
    r = idep.spec.role(role)
    kids = _children(body)
    sts = kids["StatefulSet", f"{idep.name}-{role}"]
    pod = sts["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args, env, recording = parse_container(container, kids)

    # Identity: the flag, the label and the variable say the same role.
    assert args.role == role == sts["spec"]["template"]["metadata"]["labels"]["disagg.dev/role"]
    assert args.worker_id == POD_NAME and args.advertise_host == POD_IP
    assert args.deployment == idep.deployment_id
    assert args.model_name == idep.spec.model.name

    # Ports: what the worker binds is what the container, its headless Service and the probes name.
    service = kids["Service", f"{idep.name}-{role}"]
    assert sts["spec"]["serviceName"] == service["metadata"]["name"]
    assert args.port == _port(container, "grpc") and _service_target(service, "grpc") == "grpc"
    assert (
        args.metrics_port == _port(container, "metrics") and _service_target(service, "metrics") == "metrics"
    )
    probes = _probe_paths(container)
    assert probes == {
        "startupProbe": (workers.HEALTH_PATH, "metrics"),
        "readinessProbe": (workers.HEALTH_PATH, "metrics"),
        "livenessProbe": (workers.LIVE_PATH, "metrics"),
        "preStop": (workers.DRAIN_PATH, "metrics"),
    }

    # The checkpoint directory is on the model volume, filled by the init container when there is one.
    assert args.model == model.model_dir(idep)
    volume = _mounted_volume(pod, container, args.model)
    assert volume["name"] == model.VOLUME
    source = idep.spec.model.source
    if source.kind == "pvc":
        assert volume["persistentVolumeClaim"]["claimName"] == source.claim_name
    elif source.kind == "hostPath":
        assert volume["hostPath"]["path"] == source.path
    else:
        (init,) = pod["initContainers"]
        target = (
            init["args"][1]
            if source.kind == "generate"
            else init["args"][init["args"].index("--local-dir") + 1]
        )
        assert target == args.model
        assert _mounted_volume(pod, init, target)["name"] == model.VOLUME

    # Engine and KV settings mean what the CRD says.
    assert args.kv_transfer == idep.spec.kv_transfer.backend
    assert args.block_size == r.block_size
    assert args.gpu_memory_utilization == pytest.approx(r.memory_fraction)
    assert args.max_model_len == idep.spec.model.max_model_length
    spec_decoding = idep.spec.speculative
    if spec_decoding is None or role == "prefill":  # prefill workers never decode
        assert args.speculative_method is None and args.speculative_draft_model is None
    else:
        assert args.speculative_method == spec_decoding.method
        assert args.num_speculative_tokens == spec_decoding.num_tokens
        if spec_decoding.draft_path:
            assert args.speculative_draft_model == f"{model.MODEL_MOUNT}/{spec_decoding.draft_path}"
            assert _mounted_volume(pod, container, args.speculative_draft_model)["name"] == model.VOLUME
    assert args.device == ("cuda" if "nvidia.com/gpu" in (r.resources.get("limits") or {}) else "cpu")
    assert args.kv_host_cache_memory == r.kv_host_bytes
    if r.kv_disk is None:
        assert args.kv_disk_cache_dir is None
    else:  # on its own writable volume, the tier kept below the volume's size
        assert _mounted_volume(pod, container, args.kv_disk_cache_dir)["name"] == workers.KV_DISK_VOLUME
        assert args.kv_disk_cache_size < r.kv_disk.size_bytes
    grace = pod["terminationGracePeriodSeconds"]
    assert grace == r.termination_grace_seconds
    assert 0 < args.drain_timeout < grace, "the preStop drain must end before the kubelet kills the pod"
    if idep.spec.kv_transfer.ucx_transports:
        assert env["UCX_TLS"] == ",".join(idep.spec.kv_transfer.ucx_transports)

    cfg, read_later = _worker_config(args, tmp_path, env)
    assert cfg.engine.dtype == (idep.spec.model.dtype if idep.spec.model.dtype != "auto" else "bfloat16")
    assert cfg.serving.drain_timeout == args.drain_timeout
    assert cfg.engine.gpu_memory_utilization == pytest.approx(r.memory_fraction)
    assert cfg.worker_id == POD_NAME and cfg.role == role
    _check_redis_url(cfg.redis_url, idep, kids, cfg.redis_password)

    # The native-kernel cache is a writable, pod-private volume (the root file system is read-only).
    from disagg.kernels import native_build

    with container_environ(env) as kernel_reads:
        cache = str(native_build._cache_dirs()[0])
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert "emptyDir" in _mounted_volume(pod, container, cache), cache
    assert "emptyDir" in _mounted_volume(pod, container, env["HOME"])

    # Every DISAGG_* variable the operator sets is one the worker reads.
    container_vars = _disagg_env(container) | {k for k in env if k.startswith("DISAGG_")}
    unread = container_vars - recording.read - read_later.read - kernel_reads.read
    assert not unread, f"the worker ignores {sorted(unread)}"


def _check_redis_url(url: str, idep, kids: dict, password: str | None) -> None:
    """The URL reaches this deployment's Redis, with the Secret's password intact (it travels
    beside the URL, never inside it: URLs get printed)."""
    assert urllib.parse.urlsplit(url).password is None
    client = redis.Redis.from_url(url, **({"password": password} if password else {}))
    try:
        kwargs = client.connection_pool.connection_kwargs
    finally:
        client.close()
    if idep.spec.redis.managed:
        svc = kids["Service", f"{idep.name}-redis"]
        assert kwargs["host"] == f"{svc['metadata']['name']}.{idep.namespace}.svc"
        assert kwargs["port"] == svc["spec"]["ports"][0]["port"]
        # the managed Redis requires the generated password (the Secret's value, here SECRET_VALUE)
        assert kwargs["password"] == SECRET_VALUE
    else:
        expected = urllib.parse.urlsplit(idep.spec.redis.url)
        assert (kwargs["host"], kwargs["port"]) == (expected.hostname, expected.port)
        assert kwargs["password"] == SECRET_VALUE


@pytest.mark.parametrize(
    ("mutate", "path"),
    [
        (
            lambda s: (
                s["decode"].update(tensorParallelSize=2),
                s.setdefault("kvTransfer", {}).update(backend="grpc"),
            ),
            "spec.kvTransfer.backend",
        ),
        (lambda s: s["prefill"].update(kvCache={"blockSize": 32}), "spec.prefill.kvCache.blockSize"),
    ],
)
def test_settings_the_worker_cannot_run_are_refused_naming_the_field(mutate, path):
    body = load_example("cpu-tiny.yaml")
    mutate(body["spec"])
    with pytest.raises(specs.SpecError) as err:
        build_children(specs.parse(body), body)
    assert err.value.path == path, str(err.value)


def test_drain_timeout_leaves_time_to_stop():
    for grace in (1, 2, 10, 30, 60, 900):
        drain = workers.drain_timeout(grace)
        assert 0 < drain < grace
    assert workers.drain_timeout(900) == 890


async def test_worker_serves_its_probe_and_prestop_paths(tmp_path):
    """The paths the kubelet calls answer on the worker's real metrics server (not 404)."""
    from disagg.worker.serving.main import WorkerProcess

    body = load_example("cpu-tiny.yaml")
    kids = _children(body)
    (container,) = kids["StatefulSet", "tiny-decode"]["spec"]["template"]["spec"]["containers"]
    args, env, _ = parse_container(container, kids)
    args.metrics_port = 0
    cfg, _ = _worker_config(args, tmp_path, env)
    proc = WorkerProcess(cfg)
    await proc._start_http()
    try:
        status = {}
        async with aiohttp.ClientSession() as http:
            for kind, (path, port) in _probe_paths(container).items():
                assert port == "metrics"
                if kind == "preStop":
                    continue  # run below, as the kubelet runs it
                async with http.get(f"http://127.0.0.1:{proc.metrics_port}{path}") as resp:
                    status[kind] = resp.status
            async with http.get(f"http://127.0.0.1:{proc.metrics_port}/metrics") as resp:
                assert resp.status == 200
            # /drain refuses a caller without the credential ...
            async with http.get(f"http://127.0.0.1:{proc.metrics_port}{workers.DRAIN_PATH}") as resp:
                assert resp.status == 401
        # ... and the hook's own command, in the container's environment, carries it.
        module, hook = _prestop(container, env)
        hook.url = hook.url.replace(f":{_port(container, 'metrics')}/", f":{proc.metrics_port}/")
        with container_environ(env):
            status["preStop"] = await asyncio.to_thread(module.run, hook)
    finally:
        await proc.http.cleanup()
    # Not loaded yet: not ready, but alive (a restart would not help); the drain answers at once.
    assert status == {"startupProbe": 503, "readinessProbe": 503, "livenessProbe": 200, "preStop": 0}


# ---- the generated model ----------------------------------------------------------------------------


def test_every_pod_generates_the_same_model():
    body = load_example("cpu-tiny.yaml")
    idep = specs.parse(body)
    kids = _children(body)
    pods = [kids["StatefulSet", f"tiny-{r}"]["spec"]["template"]["spec"] for r in ("prefill", "decode")]
    pods.append(kids["Deployment", "tiny-router"]["spec"]["template"]["spec"])
    inits = [pod["initContainers"] for pod in pods]
    assert all(len(i) == 1 for i in inits)
    (first,) = inits[0]
    for (init,) in inits:
        assert init["command"] == first["command"] == ["disagg"]
        assert init["args"] == first["args"] == model.make_model_args(idep)
        assert init["image"] == idep.spec.image.ref
    _module, parsed = cli.parse(first["args"])
    assert (parsed.dir, parsed.preset, parsed.seed) == (model.model_dir(idep), "tiny", 0)
    assert not parsed.force  # a restarted pod finds the same recipe on its volume and keeps it


@pytest.fixture(scope="module")
def generated_model(tmp_path_factory) -> Path:
    """The cpu-tiny example's model, made by running the init container's own command line."""
    body = load_example("cpu-tiny.yaml")
    (init,) = _children(body)["StatefulSet", "tiny-decode"]["spec"]["template"]["spec"]["initContainers"]
    target = tmp_path_factory.mktemp("model") / "model"
    argv = [str(target) if a == model.model_dir(specs.parse(body)) else a for a in init["args"]]
    assert cli.main(argv) == 0
    return target


def test_generated_model_is_byte_identical_across_pods(generated_model, tmp_path):
    again = tmp_path / "model"
    body = load_example("cpu-tiny.yaml")
    argv = [
        str(again) if a == model.model_dir(specs.parse(body)) else a
        for a in model.make_model_args(specs.parse(body))
    ]
    assert cli.main(argv) == 0
    names = sorted(p.name for p in generated_model.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    for name in names:
        assert (generated_model / name).read_bytes() == (again / name).read_bytes(), name


# ---- the router pod ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("example", "variant"), CASES)
def test_router_container_parses_with_the_real_cli_and_agrees_with_the_workers(example, variant, tmp_path):
    body = _body(example, variant)
    idep = specs.parse(body)
    kids = _children(body)
    dep = kids["Deployment", f"{idep.name}-router"]
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args, env, recording = parse_container(container, kids)
    wargs, wenv, _ = parse_container(
        kids["StatefulSet", f"{idep.name}-decode"]["spec"]["template"]["spec"]["containers"][0], kids
    )

    assert args.port == _port(container, "http")
    service = kids["Service", idep.name]
    assert _service_target(service, "http") == "http"
    assert _probe_paths(container) == {
        "readinessProbe": ("/health", "http"),
        "livenessProbe": ("/metrics", "http"),
    }

    # Discovery: the router reads the registry the workers write (same Redis, same deployment).
    assert args.deployment == wargs.deployment == idep.deployment_id
    from disagg.worker.cli.worker import _password
    from disagg.worker.serving import auth

    with container_environ(env) as later:
        router_password = _password(args)
        router_credential = auth.from_cli_args(args, "disagg router")
    with container_environ(wenv):
        worker_password = _password(wargs)
        worker_credential = auth.from_cli_args(wargs, "disagg worker")
    assert (args.redis_url, router_password) == (wargs.redis_url, worker_password)
    # the router calls the workers with the credential they check
    assert router_credential.token is not None and router_credential == worker_credential
    _check_redis_url(args.redis_url, idep, kids, router_password)

    # Tokenization agrees with the workers: same model, name, block size, context.
    assert args.model == wargs.model
    assert args.model_name == wargs.model_name == idep.spec.model.name
    assert args.block_size == wargs.block_size
    assert args.max_model_len == wargs.max_model_len
    volume = _mounted_volume(pod, container, args.model)
    assert volume["name"] == model.VOLUME
    worker_pod = kids["StatefulSet", f"{idep.name}-decode"]["spec"]["template"]["spec"]
    (worker_volume,) = [v for v in worker_pod["volumes"] if v["name"] == model.VOLUME]
    source = idep.spec.model.source
    if source.kind in ("pvc", "hostPath"):
        assert volume == worker_volume and "initContainers" not in pod
    else:
        (init,) = pod["initContainers"]
        if source.kind == "generate":
            assert init["args"] == worker_pod["initContainers"][0]["args"]
        else:
            got = [init["args"][i + 1] for i, a in enumerate(init["args"]) if a == "--include"]
            assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(got)
            assert init["args"][init["args"].index("--local-dir") + 1] == args.model
        assert _mounted_volume(pod, init, args.model)["name"] == model.VOLUME

    # Routing: prefill workers lend themselves to whole requests only when the spec says so.
    assert args.prefill_overflow == idep.spec.router.prefill_overflow
    assert (args.prefill_overflow is not None) == (variant == "prefill-overflow")

    # The API-key Secret is mounted where --api-key-file points.
    if idep.spec.router.api_key is None:
        assert args.api_key_file is None
    else:
        key_volume = _mounted_volume(pod, container, args.api_key_file)
        assert key_volume["secret"]["secretName"] == idep.spec.router.api_key.name
        assert Path(args.api_key_file).name == idep.spec.router.api_key.key

    unread = (
        ({k for k in env if k.startswith("DISAGG_")} | _disagg_env(container)) - recording.read - later.read
    )
    assert not unread, f"the router ignores {sorted(unread)}"


async def test_router_serves_its_probe_paths_and_finds_the_registered_workers(
    generated_model, redis_url, tmp_path
):
    """The router built from its container's command line serves the probed paths and lists the
    workers registered under the deployment id the worker containers get."""
    from disagg.worker.cli import router as router_cmd

    body = load_example("cpu-tiny.yaml")
    body["spec"]["router"]["apiKeySecret"] = {"name": "keys", "key": "list"}
    idep = specs.parse(body)
    kids = _children(body)
    (container,) = kids["Deployment", "tiny-router"]["spec"]["template"]["spec"]["containers"]
    args, env, _ = parse_container(container, kids)
    wargs, _, _ = parse_container(
        kids["StatefulSet", "tiny-decode"]["spec"]["template"]["spec"]["containers"][0], kids
    )

    # Stand-ins for the pod's volumes and its Redis Service: the generated model, a key file, the test's Redis.
    key_file = tmp_path / Path(args.api_key_file).name
    key_file.write_text(f"{API_KEY}\n")
    args.api_key_file = str(key_file)
    args.model = str(generated_model)
    args.redis_url = redis_url
    worker_state = KVState(redis_url, wargs.deployment, POD_NAME)
    worker_state.register(
        WorkerInfo(id=POD_NAME, role="decode", address=f"{POD_IP}:{wargs.port}", model=wargs.model_name)
    )
    other = KVState(redis_url, "default.other", "w-other")
    other.register(WorkerInfo(id="w-other", role="decode", address="10.9.9.9:1", model=wargs.model_name))

    with container_environ(env):
        router = router_cmd.build_router(args)
    assert router.api_keys == frozenset({API_KEY})
    assert router.model_name == idep.spec.model.name
    assert router.args.max_model_len == idep.spec.model.max_model_length
    assert router.pool._source() == [(POD_NAME, "decode", f"{POD_IP}:{wargs.port}")]

    server = TestServer(router.app())
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as http:
            for kind, (path, port) in _probe_paths(container).items():
                assert port == "http"
                async with http.get(server.make_url(path)) as resp:
                    assert resp.status != 404, (kind, path)
                    if kind == "livenessProbe":
                        assert resp.status == 200  # no worker reachable yet is no reason to restart
    finally:
        await server.close()
        worker_state.close()
        other.close()


# ---- the finalizer's Redis cleanup ------------------------------------------------------------------


def _populate(url: str, deployment: str, password: str) -> set[bytes]:
    """Registry entry, a transfer with its lease, a prefix-index entry: the keys a worker writes."""
    state = KVState(url, deployment, "w1", password=password)
    try:
        state.register(WorkerInfo(id="w1", role="prefill", address="10.0.0.1:50051", model="tiny"))
        state.publish_blocks([1, 2, 3])
        state.begin_transfer("req-1", "w1", "w2", [3, 4], lease_seconds=30)
    finally:
        state.close()
    client = redis.Redis.from_url(url, password=password)
    try:
        return set(client.scan_iter(match=f"*{{{deployment}}}*"))
    finally:
        client.close()


def test_deletion_job_removes_exactly_this_deployments_worker_keys(secure_redis):
    """The Job the finalizer starts for an external Redis runs `disagg cleanup` with the password
    from the user's Secret (the operator never holds it); run here as its pod would run it."""
    from disagg.operator.builders import cleanup_job

    body = load_example("cpu-tiny.yaml")
    _external_redis(body["spec"])
    idep = specs.parse(body)
    url, password = secure_redis.url, secure_redis.password
    ours = _populate(url, idep.deployment_id, password)
    assert len(ours) >= 4 and all(k.decode().startswith(Keys(idep.deployment_id).prefix) for k in ours)
    # Deployments whose ids share a prefix with ours, or live in another namespace.
    others = set()
    for deployment in (f"{idep.deployment_id}2", idep.deployment_id[:-1], f"other.{idep.name}"):
        others |= _populate(url, deployment, password)
    client = redis.Redis.from_url(url, password=password)
    client.set("unrelated", "1")
    job = cleanup_job.job(idep)
    (container,) = job["spec"]["template"]["spec"]["containers"]
    command = list(container["command"])
    _replace(command, WorkerProcessArgs.cli_flag("redis_url"), url)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISAGG_")}
    env.update(container_env(container, {}))
    env["DISAGG_REDIS_PASSWORD"] = password  # what the user's Secret holds
    try:
        assert command[:2] == ["disagg", "cleanup"] and "ownerReferences" not in job["metadata"]
        done = subprocess.run(
            [sys.executable, "-m", "disagg.worker.cli", *command[1:]],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == f"deleted {len(ours)} keys of {idep.deployment_id}"
        assert set(client.scan_iter()) == others | {b"unrelated"}
        # Without the password: refused, and it says so without printing one.
        env.pop("DISAGG_REDIS_PASSWORD")
        refused = subprocess.run(
            [sys.executable, "-m", "disagg.worker.cli", *command[1:]],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert refused.returncode == 1 and password not in refused.stderr + refused.stdout
    finally:
        client.close()


def test_operator_imports_no_torch():
    code = "import sys, disagg.operator.handlers, disagg.operator.main; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---- the examples themselves ----------------------------------------------------------------------


def test_examples_readme_names_every_example():
    readme = (ROOT / "examples" / "README.md").read_text()
    for name in EXAMPLES:
        assert name in readme, name
    for name in EXAMPLES:
        assert yaml.safe_load((ROOT / "examples" / name).read_text())["kind"] == "InferenceDeployment"


# ---- the pods' command lines, run ---------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _replace(argv: list[str], flag: str, value: str) -> None:
    argv[argv.index(flag) + 1] = value


def _get(url: str, headers: dict | None = None) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=5) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")
    except (urllib.error.URLError, OSError):
        return 0, {}


def _launch(
    container: dict,
    kids: dict,
    pod_name: str,
    swaps: dict[str, str],
    log: Path,
) -> subprocess.Popen:
    """Start the container's command line as a local process: same arguments and environment, with
    the pod's volume, ports and Redis Service swapped for local ones."""
    env = container_env(container, kids, pod_name=pod_name, pod_ip="127.0.0.1")
    argv = [_expand(a, env) for a in container["args"]]
    for flag, value in swaps.items():
        _replace(argv, flag, value)
    proc_env = {k: v for k, v in os.environ.items() if not k.startswith("DISAGG_")}
    proc_env.update(env, OMP_NUM_THREADS="1")
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "disagg.worker.cli", *argv],
            env=proc_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )


def _wait(
    predicate, procs: dict[str, subprocess.Popen], tmp_path: Path, what: str, timeout: float = 120
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        for name, proc in procs.items():
            if proc.poll() is not None:
                pytest.fail(
                    f"{name} exited ({proc.returncode}):\n{(tmp_path / f'{name}.log').read_text()[-3000:]}"
                )
        time.sleep(0.25)
    logs = "\n".join(f"--- {n}\n{(tmp_path / f'{n}.log').read_text()[-1500:]}" for n in procs)
    pytest.fail(f"timed out waiting for {what}\n{logs}")


@contextlib.contextmanager
def managed_redis(kids: dict, name: str, tmp_path: Path):
    """The managed Redis pod's containers run locally: the init container's script writes the auth
    config from the Secret-backed environment, then redis-server starts with the pod's arguments
    (its mount swapped for a local folder, its port for a free one). Yields (url, server process)."""
    from disagg.operator.builders import redis as redis_builder

    pod = kids["StatefulSet", f"{name}-redis"]["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    (server,) = pod["containers"]
    auth = tmp_path / "redis-auth"
    auth.mkdir()
    env = container_env(init, kids)
    script = init["command"][2].replace(redis_builder.AUTH_DIR, str(auth))
    subprocess.run([*init["command"][:2], script], env=env, check=True, timeout=30)
    port = _free_port()
    args = [a.replace(redis_builder.AUTH_DIR, str(auth)) for a in server["args"]]
    proc = subprocess.Popen(
        [*server["command"], *args, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                redis.Redis.from_url(url, password=SECRET_VALUE, socket_timeout=1).ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.1)
        yield url, proc
    finally:
        proc.terminate()
        proc.wait(10)


def test_managed_redis_requires_the_generated_password_and_keeps_it_off_command_lines(tmp_path):
    kids = _children(load_example("cpu-tiny.yaml"))
    pod = kids["StatefulSet", "tiny-redis"]["spec"]["template"]["spec"]
    assert "--protected-mode" in pod["containers"][0]["args"]
    assert pod["containers"][0]["args"][pod["containers"][0]["args"].index("--protected-mode") + 1] == "yes"
    with managed_redis(kids, "tiny", tmp_path) as (url, proc):
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(url).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(url, password="wrong").ping()
        assert redis.Redis.from_url(url, password=SECRET_VALUE).ping()
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert SECRET_VALUE.encode() not in cmdline
    (init,) = pod["initContainers"]
    assert init["env"] == [
        {
            "name": "REDIS_PASSWORD",
            "valueFrom": {"secretKeyRef": {"name": "tiny-credentials", "key": "redis-password"}},
        }
    ]


@pytest.mark.slow
def test_the_pods_command_lines_serve_a_chat_completion_and_drain(generated_model, tmp_path):
    """Prefill, decode and router processes started from the cpu-tiny example's own containers find
    each other through Redis, answer a chat completion, and the decode pod's preStop drains it."""
    body = load_example("cpu-tiny.yaml")
    # The tiny model prefills this test's prompt faster than any trip to another process, so the
    # load placement would keep it local: the threshold placement (a field of the spec) forces the
    # disaggregated path, which is what this test must see work from the pods' commands.
    body["spec"]["kvTransfer"]["prefillPlacement"] = "threshold"
    idep = specs.parse(body)
    kids = _children(body)
    procs: dict[str, subprocess.Popen] = {}
    metrics: dict[str, int] = {}
    with contextlib.ExitStack() as stack:
        redis_url, _ = stack.enter_context(managed_redis(kids, "tiny", tmp_path))
        _serve_and_drain(kids, idep, procs, metrics, generated_model, redis_url, tmp_path)


def _serve_and_drain(kids, idep, procs, metrics, generated_model, redis_url, tmp_path) -> None:
    try:
        for role in ("decode", "prefill"):
            (container,) = kids["StatefulSet", f"tiny-{role}"]["spec"]["template"]["spec"]["containers"]
            metrics[role] = _free_port()
            process = WorkerProcessArgs.cli_flag
            swaps = {
                cli_flag("model"): str(generated_model),
                process("port"): str(_free_port()),
                process("metrics_port"): str(metrics[role]),
                process("redis_url"): redis_url,
                process("host"): "127.0.0.1",
            }
            procs[role] = _launch(container, kids, f"tiny-{role}-0", swaps, tmp_path / f"{role}.log")
        (router,) = kids["Deployment", "tiny-router"]["spec"]["template"]["spec"]["containers"]
        port = _free_port()
        swaps = {
            "--model": str(generated_model),
            "--port": str(port),
            "--redis-url": redis_url,
            "--host": "127.0.0.1",
        }
        procs["router"] = _launch(router, kids, "tiny-router-0", swaps, tmp_path / "router.log")

        def router_sees_both():
            status, health = _get(f"http://127.0.0.1:{port}/internal/workers", INTERNAL_HEADERS)
            roles = {w["role"] for w in health.get("workers", []) if w.get("ready")}
            return status == 200 and {"prefill", "decode"} <= roles

        _wait(router_sees_both, procs, tmp_path, "the router to discover both workers through Redis")
        registry = KVState(redis_url, idep.deployment_id, "probe", password=SECRET_VALUE)
        ids = {w.id for w in registry.workers()}
        registry.close()
        assert ids == {"tiny-decode-0", "tiny-prefill-0"}

        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            data=json.dumps(
                {
                    "model": idep.spec.model.name,
                    "messages": [{"role": "user", "content": "hello " * 80}],
                    "max_tokens": 4,
                }
            ).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as resp:
            answer = json.loads(resp.read())
        assert answer["model"] == idep.spec.model.name
        assert answer["usage"]["completion_tokens"] >= 1
        # A long prompt is prefilled on the prefill pod, its KV blocks moved with the example's backend.
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics['decode']}/metrics", timeout=5) as resp:
            exposition = resp.read().decode()
        remote = [
            float(line.rsplit(" ", 1)[1])
            for line in exposition.splitlines()
            if line.startswith("disagg_disaggregation_decisions_total") and 'decision="remote"' in line
        ]
        assert remote and remote[0] >= 1, exposition

        # The preStop hook (its exec command, in the container's environment), then what readiness
        # and liveness see while the pod terminates.
        (decode,) = kids["StatefulSet", "tiny-decode"]["spec"]["template"]["spec"]["containers"]
        hook = list(decode["lifecycle"]["preStop"]["exec"]["command"])
        hook[hook.index(Drain.URL) + 1] = f"http://127.0.0.1:{metrics['decode']}{workers.DRAIN_PATH}"
        hook_env = {k: v for k, v in os.environ.items() if not k.startswith("DISAGG_")}
        hook_env.update(container_env(decode, kids))
        done = subprocess.run(
            [sys.executable, "-m", "disagg.worker.cli", *hook[1:]],
            env=hook_env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0 and json.loads(done.stdout) == {"drained": True, "streams": 0}, done
        assert _get(f"http://127.0.0.1:{metrics['decode']}{workers.HEALTH_PATH}")[0] == 503
        assert _get(f"http://127.0.0.1:{metrics['decode']}{workers.LIVE_PATH}")[0] == 200
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


async def test_tensor_parallel_request_is_reported_in_the_status_naming_the_field(cluster):
    """The real kopf handlers turn the refusal into the Degraded condition a user reads."""
    body = load_example("cpu-tiny.yaml")
    body["spec"]["prefill"]["tensorParallelSize"] = 2
    body["spec"].setdefault("kvTransfer", {})["backend"] = "grpc"  # the worker shards over nixl only

    def degraded() -> dict:
        obj = cluster.live("disagg.dev/v1alpha1/inferencedeployments", "tiny") or {}
        found = [x for x in (obj.get("status") or {}).get("conditions", []) if x["type"] == "Degraded"]
        return found[0] if found else {}

    await cluster.api.apply(body, field_manager="test-user")
    await cluster.eventually(lambda: degraded().get("reason") == "InvalidSpec", what="InvalidSpec")
    assert degraded()["message"].startswith("spec.kvTransfer.backend: ")
    assert cluster.live("apps/v1/statefulsets", "tiny-prefill") is None


# ---- the internal credential and the interfaces ---------------------------------------------------


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_pods_bind_their_pod_address_explicitly(role):
    """Workers and the router listen on loopback unless told otherwise; pods must be told."""
    kids = _children(load_example("cpu-tiny.yaml"))
    (worker,) = kids["StatefulSet", f"tiny-{role}"]["spec"]["template"]["spec"]["containers"]
    (router,) = kids["Deployment", "tiny-router"]["spec"]["template"]["spec"]["containers"]
    assert parse_container(worker, kids)[0].host == "0.0.0.0"
    assert parse_container(router, kids)[0].host == "0.0.0.0"


def test_pods_get_the_internal_credential_from_a_secret():
    kids = _children(load_example("cpu-tiny.yaml"))
    for kind, name in (
        ("StatefulSet", "tiny-prefill"),
        ("StatefulSet", "tiny-decode"),
        ("Deployment", "tiny-router"),
    ):
        (container,) = kids[kind, name]["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e for e in container.get("env", [])}
        assert INTERNAL_TOKEN_ENV in env and "secretKeyRef" in env[INTERNAL_TOKEN_ENV]["valueFrom"], name


def test_worker_prestop_hook_carries_the_credential():
    """A kubelet httpGet cannot send a Secret's value; /drain answers it 401."""
    kids = _children(load_example("cpu-tiny.yaml"))
    (container,) = kids["StatefulSet", "tiny-decode"]["spec"]["template"]["spec"]["containers"]
    hook = container["lifecycle"]["preStop"]
    assert hook.get("exec", {}).get("command", [])[:2] == ["disagg", "drain"], hook
