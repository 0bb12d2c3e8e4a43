"""What the autoscaler keeps in memory per InferenceDeployment, and the status it writes.

Memory is per operator process: after a restart the stabilization windows start over (the
conservative direction) and the last scale time is read back from the status.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

from disagg.operator.autoscaling.control import Decision, Memory
from disagg.operator.autoscaling.scrape import PoolScraper
from disagg.operator.autoscaling.spec import AutoscalingSpec

DECISIONS_KEPT = 5


@dataclass
class DeploymentState:
    scraper: PoolScraper
    memories: dict[str, Memory] = field(default_factory=dict)

    def memory(self, role: str, role_status: dict) -> Memory:
        if role not in self.memories:
            last = parse_time(role_status.get("lastScaleTime"))
            self.memories[role] = Memory(last_scale_time=last)
        return self.memories[role]


def iso(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value) -> float | None:
    if not value:
        return None
    try:
        return datetime.datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def worth_recording(decision: Decision, previous: list[dict]) -> bool:
    """Every change, and a hold only when its reason differs from the last one recorded, so
    the five entries show the story rather than five identical ticks."""
    if decision.changed or decision.action == "revert":
        return True
    return not previous or previous[-1].get("code") != decision.code


def role_status(
    spec: AutoscalingSpec, decision: Decision, previous: dict, now: float, *, record: bool | None = None
) -> dict:
    """`status.<role>.autoscaling` after a decision (a whole object: merge-patched as is)."""
    decisions = list(previous.get("decisions") or [])
    if record if record is not None else worth_recording(decision, decisions):
        decisions.append(
            {
                "time": iso(now),
                "from": decision.previous,
                "to": decision.replicas,
                "action": decision.action,
                "code": decision.code,
                "reason": decision.reason,
            }
        )
    last_scale = previous.get("lastScaleTime")
    if decision.changed:
        last_scale = iso(now)
    metric = decision.metric_seconds
    return {
        "currentMetric": None if metric is None else round(metric * 1000, 3),
        "target": round(spec.target_seconds * 1000, 3),
        "desiredReplicas": decision.replicas,
        "lastScaleTime": last_scale,
        "decisions": decisions[-DECISIONS_KEPT:],
    }
