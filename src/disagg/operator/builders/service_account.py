"""The ServiceAccount the deployment's pods run as (no API access: its token is not mounted)."""

from __future__ import annotations

from disagg.operator.builders import common
from disagg.operator.spec import InferenceDeployment


def service_account(idep: InferenceDeployment) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": common.metadata(idep, common.service_account_name(idep), "serviceaccount"),
        "automountServiceAccountToken": False,
    }
