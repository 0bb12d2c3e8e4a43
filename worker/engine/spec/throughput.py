"""The check against reality: tokens per second of speculative and of plain decode steps, as
measured while serving, per batch size. When speculating has been slower than plain decoding at a
batch size (overheads the start-up measurements do not see: bookkeeping, a draft catching up after
a pause), that batch size decodes plainly and only probes speculation now and then."""

from __future__ import annotations

# weight of the newest step in the running seconds per token
_SMOOTHING = 0.2
# a batch size where speculation lost speculates once in this many decode steps, the interval
# doubling after each probe it loses again (a probe costs: a draft catches up on the whole pause)
PROBE_EVERY = 32
MAX_PROBE_EVERY = 1024


class ThroughputCheck:
    def __init__(self) -> None:
        self._plain: dict[int, float] = {}  # batch size -> seconds per token
        self._spec: dict[int, float] = {}
        self._since_probe: dict[int, int] = {}
        self._probe_every: dict[int, int] = {}

    def _update(self, table: dict[int, float], batch: int, seconds: float, tokens: int) -> None:
        per_token = seconds / max(tokens, 1)
        old = table.get(batch)
        table[batch] = per_token if old is None else (1 - _SMOOTHING) * old + _SMOOTHING * per_token

    def plain_step(self, batch: int, seconds: float) -> None:
        self._update(self._plain, batch, seconds, batch)

    def speculative_step(self, batch: int, seconds: float, tokens: int) -> None:
        self._update(self._spec, batch, seconds, tokens)
        plain = self._plain.get(batch)
        every = self._probe_every.get(batch, PROBE_EVERY)
        if plain is not None and self._spec[batch] >= plain:
            self._probe_every[batch] = (
                min(2 * every, MAX_PROBE_EVERY) if self._since_probe.get(batch) == 0 else every
            )
        else:
            self._probe_every[batch] = PROBE_EVERY

    def allows(self, batch: int) -> bool:
        """Whether a decode step of `batch` sequences may speculate."""
        plain, spec = self._plain.get(batch), self._spec.get(batch)
        if plain is None:
            return False  # measure plain decoding first
        if spec is None or spec < plain:
            return True
        n = self._since_probe.get(batch, 0) + 1
        if n >= self._probe_every.get(batch, PROBE_EVERY):
            self._since_probe[batch] = 0
            return True
        self._since_probe[batch] = n
        return False
