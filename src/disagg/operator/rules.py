"""The CRD's CEL validation rules, mirrored in Python: the one place the operator checks them.

The API server enforces `x-kubernetes-validations`; this mirror lets the operator refuse a
resource that slipped past them (an API server without CEL, an object stored before a rule
existed) with the same message and field, and lets the tests check each rule's logic. The
parsers (`spec`, `autoscaling.spec`) run it first and do not check these rules again. A test
asserts that every CEL rule in the CRD has exactly one mirror here (rule text, message, fieldPath).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# UCX transports that reach only processes sharing a pod's memory or PID namespace.
POD_LOCAL_TRANSPORTS = ("cma", "sm", "shm", "posix", "sysv", "self")


@dataclass(frozen=True)
class Rule:
    at: str  # JSON path of the object the CEL rule is attached to; "*" stands for prefill and decode
    cel: str  # the rule text exactly as in the CRD
    check: Callable[[dict], bool]  # the same predicate over the (defaulted) object at `at`
    message: str
    field_path: str = ""  # the rule's fieldPath in the CRD: where under `at` the error is reported


def _has(obj: dict, key: str) -> bool:
    return isinstance(obj, dict) and obj.get(key) is not None


def _target_has(spec: dict, role: str, key: str) -> bool:
    auto = (spec.get(role) or {}).get("autoscaling")
    return auto is None or _has(auto.get("target") or {}, key)


RULES: tuple[Rule, ...] = (
    Rule(
        "spec",
        "!has(self.prefill.autoscaling) || has(self.prefill.autoscaling.target.ttftMilliseconds)",
        lambda s: _target_has(s, "prefill", "ttftMilliseconds"),
        "prefill autoscales on time to first token; set prefill.autoscaling.target.ttftMilliseconds",
        ".prefill.autoscaling.target",
    ),
    Rule(
        "spec",
        "!has(self.decode.autoscaling) || has(self.decode.autoscaling.target.itlMilliseconds)",
        lambda s: _target_has(s, "decode", "itlMilliseconds"),
        "decode autoscales on inter-token latency; set decode.autoscaling.target.itlMilliseconds",
        ".decode.autoscaling.target",
    ),
    Rule(
        "spec.model.source",
        "[has(self.pvc), has(self.hostPath), has(self.huggingFace), has(self.generate)].filter(x, x).size() == 1",
        lambda s: sum(_has(s, k) for k in ("pvc", "hostPath", "huggingFace", "generate")) == 1,
        "set exactly one of pvc, hostPath, huggingFace, generate",
    ),
    Rule(
        "spec.*",
        "has(self.replicas) != has(self.autoscaling)",
        lambda r: _has(r, "replicas") != _has(r, "autoscaling"),
        "set exactly one of replicas and autoscaling",
    ),
    Rule(
        "spec.*.autoscaling",
        "self.minReplicas <= self.maxReplicas",
        lambda a: a["minReplicas"] <= a["maxReplicas"],
        "minReplicas must not exceed maxReplicas",
        ".minReplicas",
    ),
    Rule(
        "spec.*.autoscaling.target",
        "has(self.ttftMilliseconds) != has(self.itlMilliseconds)",
        lambda t: _has(t, "ttftMilliseconds") != _has(t, "itlMilliseconds"),
        "set exactly one of ttftMilliseconds and itlMilliseconds",
    ),
    Rule(
        "spec.kvTransfer.ucxTransports",
        "self.size() == 0 || 'tcp' in self",
        lambda ts: len(ts) == 0 or "tcp" in ts,
        "NIXL needs the tcp transport for notifications; include tcp",
    ),
    Rule(
        "spec.kvTransfer.ucxTransports",
        f"!self.exists(t, t in [{', '.join(repr(t) for t in POD_LOCAL_TRANSPORTS)}])",
        lambda ts: not any(t in POD_LOCAL_TRANSPORTS for t in ts),
        "cma, sm, shm, posix, sysv and self reach only processes of one pod, and each worker is its own "
        "pod: use tcp, or rc/ud/dc for RDMA",
    ),
    Rule(
        "spec.*.kvCache",
        "!has(self.disk) || has(self.host)",
        lambda k: not _has(k, "disk") or _has(k, "host"),
        "kvCache.disk needs kvCache.host (blocks reach the disk through host memory)",
        ".disk",
    ),
    Rule(
        "spec.grpcTLS",
        "has(self.secretName) != has(self.perPodIssuer)",
        lambda t: _has(t, "secretName") != _has(t, "perPodIssuer"),
        "set exactly one of secretName and perPodIssuer",
    ),
    Rule(
        "spec.grpcTLS",
        "!has(self.perPodIssuer) || has(self.serverName)",
        lambda t: not _has(t, "perPodIssuer") or _has(t, "serverName"),
        "perPodIssuer needs serverName, the DNS name each pod's certificate carries for its peers to check",
        ".serverName",
    ),
    Rule(
        "spec.redis",
        "has(self.managed) != has(self.external)",
        lambda r: _has(r, "managed") != _has(r, "external"),
        "set exactly one of managed and external",
    ),
)


def _resolve(obj: dict, path: str) -> list[tuple[str, object]]:
    """All (concrete path, value) pairs the rule path names; absent parts yield nothing (CEL skips them)."""
    found = [("", obj)]
    for part in path.split("."):
        keys = ("prefill", "decode") if part == "*" else (part,)
        nxt = []
        for prefix, value in found:
            for key in keys:
                if isinstance(value, dict) and value.get(key) is not None:
                    nxt.append((f"{prefix}.{key}" if prefix else key, value[key]))
        found = nxt
    return found


def violations(resource: dict) -> list[str]:
    """Messages `path: message` for every CEL rule the resource breaks (empty when valid)."""
    out = []
    for rule in RULES:
        for path, value in _resolve(resource, rule.at):
            try:
                ok = rule.check(value)
            except (KeyError, TypeError):
                continue  # the schema itself rejects such a value; CEL never sees it
            if not ok:
                out.append(f"{path}{rule.field_path}: {rule.message}")
    return out
