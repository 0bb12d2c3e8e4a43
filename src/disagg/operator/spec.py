"""The InferenceDeployment spec as typed values, with the CRD's defaults applied.

The API server applies the CRD defaults, but the operator must not depend on that (older
objects, other API servers, tests), so parsing fills the same defaults itself; a test checks
that these defaults equal the ones declared in `crds/inferencedeployment.yaml`. Malformed input
raises `SpecError` naming the field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from disagg.operator import footprints, rules
from disagg.operator.autoscaling.spec import AutoscalingSpec, AutoscalingSpecError, parse_autoscaling
from disagg.operator.constants import ROLES
from disagg.worker.engine.args import SPECULATIVE_METHODS, EngineArgs
from disagg.worker.model.precisions import DTYPES, KV_CACHE_DTYPES, QUANTIZATIONS
from disagg.worker.serving.args import KV_TRANSFERS, PREFILL_PLACEMENTS, ServingArgs


class SpecError(ValueError):
    """The resource cannot be reconciled as written; the message names the field."""

    def __init__(self, path: str, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path = path


def _section(obj: dict, key: str, path: str, required: bool = False) -> dict:
    value = obj.get(key)
    if value is None:
        if required:
            raise SpecError(f"{path}.{key}", "is required")
        return {}
    if not isinstance(value, dict):
        raise SpecError(f"{path}.{key}", f"must be an object, got {type(value).__name__}")
    return value


def _get(
    obj: dict, key: str, path: str, kind: type | tuple[type, ...], default: Any = None, required: bool = False
):
    value = obj.get(key, default)
    if value is None:
        if required:
            raise SpecError(f"{path}.{key}", "is required")
        return None
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        raise SpecError(f"{path}.{key}", f"must be a number, got {value!r}")
    if not isinstance(value, kind):
        raise SpecError(f"{path}.{key}", f"has the wrong type: {value!r}")
    return value


def _choice(obj: dict, key: str, path: str, allowed: tuple[str, ...], default: str | None) -> str | None:
    value = _get(obj, key, path, str, default)
    if value is not None and value not in allowed:
        raise SpecError(f"{path}.{key}", f"must be one of {', '.join(allowed)}, got {value!r}")
    return value


@dataclass(frozen=True)
class SecretRef:
    name: str
    key: str


def _secret(obj: dict, key: str, path: str, default_key: str) -> SecretRef | None:
    sec = _section(obj, key, path)
    if not sec:
        return None
    return SecretRef(
        _get(sec, "name", f"{path}.{key}", str, required=True),
        _get(sec, "key", f"{path}.{key}", str, default_key),
    )


@dataclass(frozen=True)
class ModelSource:
    kind: str  # pvc | hostPath | huggingFace | generate
    claim_name: str | None = None
    path: str = ""
    repo: str | None = None
    revision: str = "main"
    token: SecretRef | None = None
    size_limit: str = "60Gi"
    preset: str | None = None


# Ranks per worker: powers of two (attention heads and KV heads split evenly); above a node's GPUs a
# role runs as a LeaderWorkerSet.
TENSOR_PARALLEL_SIZES = (1, 2, 4, 8, 16, 32, 64)
SOURCE_KINDS = ("pvc", "hostPath", "huggingFace", "generate")


def _source(model: dict) -> ModelSource:
    path = "spec.model.source"
    src = _section(model, "source", "spec.model", required=True)
    # Exactly one is set: a CEL rule, checked by `parse` before anything else.
    kind = next(k for k in SOURCE_KINDS if src.get(k) is not None)
    body = _section(src, kind, path)
    sub = f"{path}.{kind}"
    if kind == "pvc":
        return ModelSource(
            kind,
            claim_name=_get(body, "claimName", sub, str, required=True),
            path=_get(body, "path", sub, str, ""),
        )
    if kind == "hostPath":
        host = _get(body, "path", sub, str, required=True)
        if not host.startswith("/"):
            raise SpecError(f"{sub}.path", f"must be an absolute path, got {host!r}")
        return ModelSource(kind, path=host)
    if kind == "huggingFace":
        return ModelSource(
            kind,
            repo=_get(body, "repo", sub, str, required=True),
            revision=_get(body, "revision", sub, str, "main"),
            token=_secret(body, "tokenSecret", sub, "token"),
            size_limit=_get(body, "sizeLimit", sub, str, "60Gi"),
        )
    return ModelSource(
        kind, preset=_choice(body, "preset", sub, ("tiny", "small"), None) or _missing(sub, "preset")
    )


def _missing(path: str, key: str):
    raise SpecError(f"{path}.{key}", "is required")


@dataclass(frozen=True)
class Model:
    name: str
    source: ModelSource
    dtype: str = EngineArgs.dtype
    quantization: str = EngineArgs.quantization
    kv_cache_dtype: str = EngineArgs.kv_cache_dtype
    max_model_length: int | None = None


@dataclass(frozen=True)
class Image:
    repository: str = "ghcr.io/disagg/disagg-worker"
    tag: str = "0.1.0"
    pull_policy: str = "IfNotPresent"
    pull_secrets: tuple[str, ...] = ()

    @property
    def ref(self) -> str:
        return f"{self.repository}:{self.tag}"


@dataclass(frozen=True)
class Router:
    replicas: int = 1
    service_type: str = "ClusterIP"
    port: int = 8000
    service_annotations: dict = field(default_factory=dict)
    api_key: SecretRef | None = None
    resources: dict = field(default_factory=lambda: footprints.or_default({}, footprints.ROUTER))
    prefill_overflow: float | None = None  # the router's --prefill-overflow margin
    priority_class: str | None = None  # default: the operator's --serving-priority-class


@dataclass(frozen=True)
class KvDisk:
    """The KV cache's disk tier: a volume of `size` (an emptyDir, or a claim of `storage_class`)."""

    size: str
    size_bytes: int
    storage_class: str | None = None


@dataclass(frozen=True)
class Role:
    name: str  # prefill | decode
    replicas: int | None
    autoscaling: AutoscalingSpec | None
    resources: dict = field(default_factory=dict)
    tensor_parallel_size: int = EngineArgs.tensor_parallel_size
    block_size: int = EngineArgs.block_size
    memory_fraction: float = EngineArgs.gpu_memory_utilization
    kv_host_bytes: int | None = None  # the KV cache's host-memory tier
    kv_disk: KvDisk | None = None
    max_unavailable: int = 1
    termination_grace_seconds: int = 120
    node_selector: dict = field(default_factory=dict)
    tolerations: tuple = ()
    affinity: dict | None = None
    env: tuple = ()
    priority_class: str | None = None


@dataclass(frozen=True)
class KvTransfer:
    backend: str = ServingArgs.kv_transfer
    prefill_placement: str = ServingArgs.prefill_placement
    disagg_threshold: int = ServingArgs.disagg_threshold
    ucx_transports: tuple[str, ...] = ()
    rdma_resource: str = "rdma/hca"
    rdma_count: int = 0


@dataclass(frozen=True)
class Redis:
    managed: bool = True
    image: str = "redis:7.4-alpine"
    url: str | None = None
    password: SecretRef | None = None
    resources: dict = field(default_factory=lambda: footprints.or_default({}, footprints.REDIS))
    priority_class: str | None = None  # default: the operator's --serving-priority-class


@dataclass(frozen=True)
class Monitoring:
    service_monitor: bool = True
    interval: str = "15s"


@dataclass(frozen=True)
class Speculative:
    method: str  # ngram | draft
    num_tokens: int = EngineArgs.num_speculative_tokens
    draft_path: str | None = None  # inside the model volume


@dataclass(frozen=True)
class PerPodIssuer:
    """cert-manager's issuer of one certificate per pod (its csi-driver)."""

    name: str
    kind: str = "Issuer"
    group: str = "cert-manager.io"
    duration: str = "24h"


ISSUER_KINDS = ("Issuer", "ClusterIssuer")


@dataclass(frozen=True)
class GrpcTLS:
    secret_name: str | None = None  # one certificate for every pod
    per_pod: PerPodIssuer | None = None  # or one per pod: each worker's own identity
    server_name: str | None = None


@dataclass(frozen=True)
class NetworkPolicy:
    enabled: bool = True
    clients_from: tuple[dict, ...] | None = None  # None: the default sources (see builders/network)
    metrics_namespaces: tuple[str, ...] = ()


@dataclass(frozen=True)
class Spec:
    model: Model
    image: Image
    router: Router
    prefill: Role
    decode: Role
    kv_transfer: KvTransfer
    redis: Redis
    monitoring: Monitoring
    grpc_tls: GrpcTLS | None = None
    network_policy: NetworkPolicy = field(default_factory=NetworkPolicy)
    speculative: Speculative | None = None

    def role(self, name: str) -> Role:
        return self.prefill if name == "prefill" else self.decode


@dataclass(frozen=True)
class InferenceDeployment:
    """One InferenceDeployment object: identity, parsed spec, and the autoscaler's status."""

    name: str
    namespace: str
    uid: str
    generation: int
    spec: Spec
    autoscaler_desired: dict = field(
        default_factory=dict
    )  # role -> status.<role>.autoscaling.desiredReplicas

    @property
    def deployment_id(self) -> str:
        # Unique across namespaces, so two deployments sharing an external Redis never share keys.
        return f"{self.namespace}.{self.name}"


def _int(obj: dict, key: str, path: str, default: int | None, minimum: int | None = None) -> int | None:
    value = _get(obj, key, path, int, default)
    if value is not None and minimum is not None and value < minimum:
        raise SpecError(f"{path}.{key}", f"must be at least {minimum}, got {value}")
    return value


def _number(obj: dict, key: str, path: str, default: float | None, minimum: float) -> float | None:
    value = _get(obj, key, path, (int, float), default)
    if value is not None and value < minimum:
        raise SpecError(f"{path}.{key}", f"must be at least {minimum:g}, got {value}")
    return None if value is None else float(value)


def _autoscaling(role: str, body: dict, path: str) -> AutoscalingSpec:
    # One parser of the section for the operator and the autoscaler (same defaults, same errors).
    try:
        return parse_autoscaling(role, body, path)
    except AutoscalingSpecError as exc:
        field, _, problem = str(exc).partition(": ")
        raise SpecError(field, problem) from None


_QUANTITY_SUFFIXES = {
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18, "": 1,
}  # fmt: skip


def quantity_bytes(value: str | int, path: str) -> int:
    """Bytes of a Kubernetes memory or storage quantity (`8Gi`, `1.5Mi`, `500M`, `1048576`)."""
    found = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([KMGTPE]i|[kMGTPE])?", str(value).strip())
    if found is None:
        raise SpecError(path, f"is not a quantity of bytes: {value!r}")
    return int(float(found[1]) * _QUANTITY_SUFFIXES[found[2] or ""])


def _kv_tiers(kv: dict, path: str) -> tuple[int | None, KvDisk | None]:
    host = _section(kv, "host", path)
    disk = _section(kv, "disk", path)
    host_bytes = None
    if host:
        host_bytes = quantity_bytes(
            _get(host, "memory", f"{path}.host", str, required=True), f"{path}.host.memory"
        )
    kv_disk = None
    if disk:  # without host: refused by a CEL rule (`rules.py`)
        size = _get(disk, "size", f"{path}.disk", str, required=True)
        kv_disk = KvDisk(size, quantity_bytes(size, f"{path}.disk.size"),
                         _get(disk, "storageClassName", f"{path}.disk", str))  # fmt: skip
    for field_path, amount in (
        (f"{path}.host.memory", host_bytes),
        (f"{path}.disk.size", kv_disk and kv_disk.size_bytes),
    ):
        if amount is not None and amount < 1:
            raise SpecError(field_path, "must be more than 0")
    return host_bytes, kv_disk


def _role(spec: dict, name: str) -> Role:
    path = f"spec.{name}"
    body = _section(spec, name, "spec", required=True)
    kv = _section(body, "kvCache", path)
    auto = _section(body, "autoscaling", path)
    tp = _int(body, "tensorParallelSize", path, EngineArgs.tensor_parallel_size, 1)
    if tp not in TENSOR_PARALLEL_SIZES:
        raise SpecError(
            f"{path}.tensorParallelSize",
            f"must be one of {', '.join(map(str, TENSOR_PARALLEL_SIZES))}, got {tp}",
        )
    fraction = _get(kv, "memoryFraction", f"{path}.kvCache", (int, float), EngineArgs.gpu_memory_utilization)
    if not 0.05 <= fraction <= 0.98:
        raise SpecError(f"{path}.kvCache.memoryFraction", f"must be between 0.05 and 0.98, got {fraction}")
    block = _int(kv, "blockSize", f"{path}.kvCache", EngineArgs.block_size, 1)
    if block not in (8, 16, 32, 64, 128):
        raise SpecError(f"{path}.kvCache.blockSize", f"must be one of 8, 16, 32, 64, 128, got {block}")
    kv_host_bytes, kv_disk = _kv_tiers(kv, f"{path}.kvCache")
    env = _get(body, "env", path, list, [])
    for i, item in enumerate(env):
        if not isinstance(item, dict) or not item.get("name"):
            raise SpecError(f"{path}.env[{i}].name", "is required")
    return Role(
        name=name,
        replicas=_int(body, "replicas", path, None, 0),
        autoscaling=_autoscaling(name, auto, f"{path}.autoscaling") if auto else None,
        resources=_section(body, "resources", path),
        tensor_parallel_size=tp,
        block_size=block,
        memory_fraction=float(fraction),
        kv_host_bytes=kv_host_bytes,
        kv_disk=kv_disk,
        max_unavailable=_int(body, "maxUnavailable", path, 1, 0),
        termination_grace_seconds=_int(body, "terminationGracePeriodSeconds", path, 120, 1),
        node_selector=_section(body, "nodeSelector", path),
        tolerations=tuple(_get(body, "tolerations", path, list, [])),
        affinity=_section(body, "affinity", path) or None,
        env=tuple(env),
        priority_class=_get(body, "priorityClassName", path, str, None),
    )


def _grpc_tls(spec: dict) -> GrpcTLS | None:
    tls = _section(spec, "grpcTLS", "spec")
    if not tls:
        return None
    issuer = _section(tls, "perPodIssuer", "spec.grpcTLS")
    per_pod = None
    if issuer:
        path = "spec.grpcTLS.perPodIssuer"
        per_pod = PerPodIssuer(
            name=_get(issuer, "name", path, str, required=True),
            kind=_choice(issuer, "kind", path, ISSUER_KINDS, PerPodIssuer.kind),
            group=_get(issuer, "group", path, str, PerPodIssuer.group),
            duration=_get(issuer, "duration", path, str, PerPodIssuer.duration),
        )
    return GrpcTLS(
        secret_name=_get(tls, "secretName", "spec.grpcTLS", str, None),
        per_pod=per_pod,
        server_name=_get(tls, "serverName", "spec.grpcTLS", str, None),
    )


def _network_policy(spec: dict) -> NetworkPolicy:
    path = "spec.networkPolicy"
    body = _section(spec, "networkPolicy", "spec")
    clients = _get(body, "clientsFrom", path, list, None)
    for i, peer in enumerate(clients or []):
        if not isinstance(peer, dict):
            raise SpecError(f"{path}.clientsFrom[{i}]", "must be a NetworkPolicyPeer object")
    namespaces = _get(body, "metricsNamespaces", path, list, [])
    for i, ns in enumerate(namespaces):
        if not isinstance(ns, str) or not ns:
            raise SpecError(f"{path}.metricsNamespaces[{i}]", "must be a namespace name")
    return NetworkPolicy(
        enabled=_get(body, "enabled", path, bool, True),
        clients_from=None if clients is None else tuple(clients),
        metrics_namespaces=tuple(namespaces),
    )


def parse_spec(spec: dict) -> Spec:
    if not isinstance(spec, dict):
        raise SpecError("spec", "is required")
    model = _section(spec, "model", "spec", required=True)
    image = _section(spec, "image", "spec")
    router = _section(spec, "router", "spec")
    service = _section(router, "service", "spec.router")
    kvt = _section(spec, "kvTransfer", "spec")
    rdma = _section(kvt, "rdma", "spec.kvTransfer")
    redis = _section(spec, "redis", "spec") or {"managed": {}}  # managed XOR external: a CEL rule
    mon = _section(spec, "monitoring", "spec")
    external = _section(redis, "external", "spec.redis")
    managed = _section(redis, "managed", "spec.redis")
    return Spec(
        model=Model(
            name=_get(model, "name", "spec.model", str, required=True),
            source=_source(model),
            dtype=_choice(model, "dtype", "spec.model", ("auto", *DTYPES), EngineArgs.dtype),
            quantization=_choice(
                model, "quantization", "spec.model", ("auto", "none", *QUANTIZATIONS), EngineArgs.quantization
            ),
            kv_cache_dtype=_choice(
                model, "kvCacheDtype", "spec.model", ("auto", *KV_CACHE_DTYPES), EngineArgs.kv_cache_dtype
            ),
            max_model_length=_int(model, "maxModelLength", "spec.model", None, 1),
        ),
        image=Image(
            repository=_get(image, "repository", "spec.image", str, Image.repository),
            tag=str(_get(image, "tag", "spec.image", (str, int, float), Image.tag)),
            pull_policy=_choice(
                image, "pullPolicy", "spec.image", ("Always", "IfNotPresent", "Never"), "IfNotPresent"
            ),
            pull_secrets=tuple(_get(image, "pullSecrets", "spec.image", list, [])),
        ),
        router=Router(
            replicas=_int(router, "replicas", "spec.router", 1, 1),
            service_type=_choice(
                service, "type", "spec.router.service", ("ClusterIP", "NodePort", "LoadBalancer"), "ClusterIP"
            ),
            port=_int(service, "port", "spec.router.service", 8000, 1),
            service_annotations=_section(service, "annotations", "spec.router.service"),
            api_key=_secret(router, "apiKeySecret", "spec.router", "api-keys"),
            resources=footprints.or_default(_section(router, "resources", "spec.router"), footprints.ROUTER),
            prefill_overflow=_number(router, "prefillOverflow", "spec.router", None, 0),
            priority_class=_get(router, "priorityClassName", "spec.router", str, None),
        ),
        prefill=_role(spec, "prefill"),
        decode=_role(spec, "decode"),
        kv_transfer=KvTransfer(
            backend=_choice(kvt, "backend", "spec.kvTransfer", KV_TRANSFERS, ServingArgs.kv_transfer),
            prefill_placement=_choice(
                kvt, "prefillPlacement", "spec.kvTransfer", PREFILL_PLACEMENTS, ServingArgs.prefill_placement
            ),
            disagg_threshold=_int(kvt, "disaggThreshold", "spec.kvTransfer", ServingArgs.disagg_threshold, 0),
            ucx_transports=tuple(_get(kvt, "ucxTransports", "spec.kvTransfer", list, [])),
            rdma_resource=_get(rdma, "resourceName", "spec.kvTransfer.rdma", str, "rdma/hca"),
            rdma_count=_int(rdma, "count", "spec.kvTransfer.rdma", 0, 0),
        ),
        redis=Redis(
            managed=redis.get("managed") is not None,
            image=_get(managed, "image", "spec.redis.managed", str, "redis:7.4-alpine"),
            url=_get(
                external, "url", "spec.redis.external", str, required=bool(redis.get("external") is not None)
            ),
            password=_secret(external, "passwordSecret", "spec.redis.external", "password"),
            resources=footprints.or_default(
                _section(managed, "resources", "spec.redis.managed"), footprints.REDIS
            ),
            priority_class=_get(managed, "priorityClassName", "spec.redis.managed", str, None),
        ),
        monitoring=Monitoring(
            service_monitor=_get(mon, "serviceMonitor", "spec.monitoring", bool, True),
            interval=_get(mon, "interval", "spec.monitoring", str, "15s"),
        ),
        grpc_tls=_grpc_tls(spec),
        network_policy=_network_policy(spec),
        speculative=_speculative(spec),
    )


def _speculative(spec: dict) -> Speculative | None:
    path = "spec.speculativeDecoding"
    body = _section(spec, "speculativeDecoding", "spec")
    if not body:
        return None
    method = _choice(body, "method", path, SPECULATIVE_METHODS, None) or _missing(path, "method")
    num_tokens = _int(body, "numTokens", path, EngineArgs.num_speculative_tokens, 1)
    if num_tokens > 16:
        raise SpecError(f"{path}.numTokens", f"must be at most 16, got {num_tokens}")
    draft = _get(body, "draftModelPath", path, str, None)
    if method == "draft":
        if not draft:
            _missing(path, "draftModelPath")
        src = _section(_section(spec, "model", "spec"), "source", "spec.model")
        if not any(src.get(k) is not None for k in ("pvc", "hostPath")):
            raise SpecError(
                f"{path}.draftModelPath",
                "needs a model source of kind pvc or hostPath (the volume holding both models)",
            )
    elif draft:
        raise SpecError(f"{path}.draftModelPath", "is only used with method draft")
    return Speculative(method, num_tokens, draft)


def parse(body: dict) -> InferenceDeployment:
    """Parse a whole InferenceDeployment object (metadata, spec, and the autoscaler's status).

    The CRD's CEL rules come first, from their one mirror (`rules`); the parsers below check
    types, ranges and defaults, and rely on those rules instead of repeating them."""
    broken = rules.violations(body)
    if broken:
        path, _, problem = broken[0].partition(": ")
        raise SpecError(path, problem)
    meta = body.get("metadata") or {}
    status = body.get("status") or {}
    desired = {}
    for role in ROLES:
        value = ((status.get(role) or {}).get("autoscaling") or {}).get("desiredReplicas")
        if isinstance(value, int) and not isinstance(value, bool):
            desired[role] = value
    return InferenceDeployment(
        name=meta.get("name") or _missing("metadata", "name"),
        namespace=meta.get("namespace") or "default",
        uid=meta.get("uid") or "",
        generation=int(meta.get("generation") or 1),
        spec=parse_spec(body.get("spec")),
        autoscaler_desired=desired,
    )
