"""PodDisruptionBudgets: node drains take down at most `maxUnavailable` pods of a pool at once."""

from __future__ import annotations

from disagg.operator.builders import common
from disagg.operator.spec import InferenceDeployment


def _pdb(idep: InferenceDeployment, name: str, component: str, max_unavailable: int) -> dict:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": common.metadata(idep, name, component),
        "spec": {
            "maxUnavailable": max_unavailable,
            "selector": {"matchLabels": common.selector_labels(idep, component)},
        },
    }


def role_pdb(idep: InferenceDeployment, role: str) -> dict:
    return _pdb(idep, common.role_name(idep, role), role, idep.spec.role(role).max_unavailable)


def router_pdb(idep: InferenceDeployment) -> dict:
    return _pdb(idep, common.router_name(idep), "router", 1)
