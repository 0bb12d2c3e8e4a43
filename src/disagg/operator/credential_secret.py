"""The deployment's generated credentials Secret: created once with random values, never read.

Create-only: a POST that the API server answers 409 when the Secret exists, which leaves it as it
is (values the pods already use, or ones an administrator put there). The operator never GETs,
lists or watches Secrets and drops the POST's answer, so no Secret value ever enters the operator.
"""

from __future__ import annotations

import secrets as random

from disagg.operator.builders import secrets
from disagg.operator.kube import Kube
from disagg.operator.spec import InferenceDeployment

TOKEN_BYTES = 32  # 256 bits; URL-safe text, fit for a header, a Redis config line and an env value


def new_secret(idep: InferenceDeployment) -> dict:
    return secrets.credentials_secret(
        idep,
        internal_token=random.token_urlsafe(TOKEN_BYTES),
        redis_password=random.token_urlsafe(TOKEN_BYTES),
    )


async def ensure(kube: Kube, idep: InferenceDeployment) -> bool:
    """Create the Secret unless it exists; True when this call created it."""
    return await kube.create_only(new_secret(idep))
