"""Why a deployment's pods do not run, read from the pods themselves (pure).

A StatefulSet or Deployment only counts ready replicas; the reason one is missing lives in its pod:
the scheduler's verdict (`PodScheduled` False, reason Unschedulable), a container waiting on an
image it cannot pull or restarting in a crash loop, a pod evicted by its node, or a running pod
whose readiness probe keeps failing. Each becomes a `PodProblem` naming the pod; the status
reports them and the reconciler posts an Event for each new one.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

# Container waiting reasons, by what the user has to fix.
IMAGE_PULL = (
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "ErrImageNeverPull",
    "RegistryUnavailable",
)
CONTAINER_CONFIG = ("CreateContainerConfigError", "CreateContainerError", "RunContainerError")
# Most urgent first: the first problem names the condition's reason.
SEVERITY = (
    "Unschedulable",
    "ImagePullFailed",
    "CrashLoopBackOff",
    "ContainerConfigError",
    "Evicted",
    "NotReady",
)


@dataclass(frozen=True)
class PodProblem:
    pod: str
    reason: str  # one of SEVERITY
    message: str

    def describe(self) -> str:
        return f"pod {self.pod}: {self.message}"


def _condition(pod: dict, ctype: str) -> dict | None:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == ctype:
            return cond
    return None


def _seconds(timestamp: str | None) -> float | None:
    if not timestamp:
        return None
    try:
        when = datetime.datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ")
    except ValueError:
        return None
    return when.replace(tzinfo=datetime.UTC).timestamp()


def _container_problem(status: dict) -> tuple[str, str] | None:
    name = status.get("name", "?")
    waiting = (status.get("state") or {}).get("waiting") or {}
    reason = waiting.get("reason", "")
    detail = waiting.get("message", "")
    if reason in IMAGE_PULL:
        return (
            "ImagePullFailed",
            f"container {name} cannot pull {status.get('image', 'its image')}: {reason}"
            + (f" ({detail})" if detail else ""),
        )
    if reason == "CrashLoopBackOff":
        last = (status.get("lastState") or {}).get("terminated") or {}
        why = last.get("reason") or "exited"
        code = last.get("exitCode")
        said = f", {last['message'].strip()[:200]}" if last.get("message") else ""
        return (
            "CrashLoopBackOff",
            f"container {name} keeps restarting ({status.get('restartCount', 0)} restarts; last: {why}"
            + (f", exit code {code}" if code is not None else "")
            + f"{said})",
        )
    if reason in CONTAINER_CONFIG:
        return "ContainerConfigError", f"container {name} cannot start: {reason}" + (
            f" ({detail})" if detail else ""
        )
    return None


def problems_of(pod: dict, now: float, not_ready_grace_seconds: float) -> list[PodProblem]:
    """What keeps `pod` from serving, as of `now` (seconds since the epoch)."""
    meta = pod.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return []  # going away: its replacement is judged instead
    name = meta.get("name", "?")
    status = pod.get("status") or {}
    if status.get("phase") == "Failed" and status.get("reason") == "Evicted":
        return [PodProblem(name, "Evicted", f"evicted by its node: {status.get('message', '')}".rstrip(": "))]
    scheduled = _condition(pod, "PodScheduled")
    if (
        scheduled is not None
        and scheduled.get("status") == "False"
        and scheduled.get("reason") == "Unschedulable"
    ):
        return [
            PodProblem(
                name, "Unschedulable", f"cannot be scheduled: {scheduled.get('message', '')}".rstrip(": ")
            )
        ]
    found = []
    for container in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        problem = _container_problem(container)
        if problem is not None:
            found.append(PodProblem(name, *problem))
    if found:
        return found
    ready = _condition(pod, "Ready")
    running = status.get("phase") == "Running" and all(
        (c.get("state") or {}).get("running") is not None for c in status.get("containerStatuses") or []
    )
    if running and ready is not None and ready.get("status") == "False":
        since = _seconds(ready.get("lastTransitionTime"))
        if since is not None and now - since >= not_ready_grace_seconds:
            return [
                PodProblem(
                    name, "NotReady", f"running but failing its readiness probe for {int(now - since)} s"
                )
            ]
    return []


def problems(pods: list[dict], now: float, not_ready_grace_seconds: float) -> list[PodProblem]:
    """Every pod's problems, most urgent first, then by pod name."""
    found = [p for pod in pods for p in problems_of(pod, now, not_ready_grace_seconds)]
    return sorted(found, key=lambda p: (SEVERITY.index(p.reason), p.pod))
