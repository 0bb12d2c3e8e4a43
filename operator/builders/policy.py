"""Settings a resource may ask for only where the operator's installer allows them."""

from __future__ import annotations

from disagg.operator.settings import Settings
from disagg.operator.spec import InferenceDeployment, SpecError


def check(idep: InferenceDeployment, settings: Settings) -> None:
    src = idep.spec.model.source
    if src.kind == "hostPath" and not settings.host_path_allowed(src.path):
        allowed = ", ".join(settings.host_path_prefixes)
        raise SpecError(
            "spec.model.source.hostPath.path",
            f"{src.path!r} is not allowed: "
            + (
                f"this operator mounts host paths only under {allowed}"
                if allowed
                else "this operator mounts no host paths (its installer enables them with "
                "--allow-host-path PREFIX); use a PVC"
            ),
        )
