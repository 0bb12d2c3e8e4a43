"""Why the router is or is not ready, in words a person running it can act on.

A probe only sees the status code; the body and the log say the reason. Reasons name no host,
address or worker (the readiness endpoint needs no credential): the log line that goes with a
registry problem carries the detail.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

# reason code -> what to check
REASONS = {
    "registry_name_unresolved": "the worker registry's (Redis) host name does not resolve: is cluster DNS running?",
    "registry_refused": "the worker registry (Redis) refused the connection: is it running, on that port?",
    "registry_auth": "the worker registry (Redis) refused the credential",
    "registry_timeout": "the worker registry (Redis) did not answer in time",
    "registry_error": "the worker registry (Redis) could not be read",
    "registry_not_read": "the worker registry (Redis) has not been read yet",
    "no_decode_workers": "no decode worker is ready, so nothing can generate",
    "no_prefill_workers": "no prefill worker is ready: prompts are prefilled on the decode workers",
}


def registry_problem(exc: BaseException) -> str:
    """The reason code for an exception raised while reading the registry."""
    chain: list[BaseException] = []
    seen: BaseException | None = exc
    while seen is not None and len(chain) < 8:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    for e in chain:
        if isinstance(e, socket.gaierror):
            return "registry_name_unresolved"
        if isinstance(e, ConnectionRefusedError):
            return "registry_refused"
        if isinstance(e, TimeoutError):
            return "registry_timeout"
    # redis-py wraps the socket errors in its own ConnectionError, with the text only
    text = " ".join(f"{type(e).__name__} {e}" for e in chain)
    if "name resolution" in text or "Name or service not known" in text or "nodename nor servname" in text:
        return "registry_name_unresolved"
    if "Connection refused" in text:
        return "registry_refused"
    if "AuthenticationError" in text or "WRONGPASS" in text or "NOAUTH" in text:
        return "registry_auth"
    if "Timeout" in text or "timed out" in text:
        return "registry_timeout"
    return "registry_error"


@dataclass(frozen=True)
class Readiness:
    decode: int  # ready decode (or colocated) workers
    prefill: int  # ready prefill workers
    registry_problem: str | None  # why the registry could not be read, None while it can
    uses_registry: bool

    @property
    def ready(self) -> bool:
        """Ready when a decode worker is: a registry outage with workers still known keeps serving
        (the last known members stay), but is reported."""
        return self.decode > 0

    @property
    def reasons(self) -> tuple[str, ...]:
        out = [self.registry_problem] if self.registry_problem else []
        if self.decode == 0:
            out.append("no_decode_workers")
        elif self.uses_registry and self.prefill == 0:
            out.append("no_prefill_workers")
        return tuple(out)

    def body(self) -> dict:
        return {
            "status": "ok" if self.ready else "no_workers",
            "reasons": [{"code": r, "message": REASONS[r]} for r in self.reasons],
            "ready_workers": {"decode": self.decode, "prefill": self.prefill},
            "registry": self.registry_problem is None,
        }
