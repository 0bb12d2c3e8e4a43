"""What makes every pod the operator builds pass the `restricted` Pod Security Standard.

Non-root with the runtime's default seccomp profile, no privilege escalation, no capabilities and a
read-only root file system; whatever a process writes (temporary files, HOME, the native-kernel
cache) goes to emptyDir volumes that live and die with the pod.
"""

from __future__ import annotations

import copy

USER = 1000
CACHE_DIR = "/var/cache/disagg"
TMP_DIR = "/tmp"

CONTAINER = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}


def pod(user: int = USER, fs_group: bool = True) -> dict:
    out = {
        "runAsNonRoot": True,
        "runAsUser": user,
        "runAsGroup": user,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    if fs_group:
        out["fsGroup"] = user
    return out


def container() -> dict:
    return copy.deepcopy(CONTAINER)


def scratch_volumes(cache: bool = False) -> list[dict]:
    out = [{"name": "tmp", "emptyDir": {}}]
    if cache:
        out.append({"name": "cache", "emptyDir": {}})
    return out


def scratch_mounts(cache: bool = False) -> list[dict]:
    out = [{"name": "tmp", "mountPath": TMP_DIR}]
    if cache:
        out.append({"name": "cache", "mountPath": CACHE_DIR})
    return out


def scratch_env(cache: bool = False) -> list[dict]:
    # HOME on the writable volume: libraries that cache under ~ (Triton, Hugging Face) find it writable.
    out = [{"name": "HOME", "value": TMP_DIR}]
    if cache:
        out.append({"name": "DISAGG_CACHE_DIR", "value": CACHE_DIR})
    return out
