"""Events on an InferenceDeployment: the one way the operator and the autoscaler post them.

kopf queues them and posts them through its own client, in the background; they are not
filtered by the posting level set for log messages.
"""

from __future__ import annotations

import kopf


def post(body: dict, type: str, reason: str, message: str) -> None:
    kopf.event(body, type=type, reason=reason, message=message)
