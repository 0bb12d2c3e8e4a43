"""The check against reality: tokens per second of speculative and of plain decode steps, as
measured while serving, per batch size. When speculating has been slower than plain decoding at a
batch size (overheads the start-up measurements do not see: bookkeeping, a draft catching up after
a pause), that batch size decodes plainly and only probes speculation now and then.

A probe is a few speculative steps in a row, judged on their own time per token: one step says
little (a rejected first proposal emits one token for a whole verify step, a burst of other load on
the machine lands on it), and the losing estimate it would otherwise be blended into is stale by
then. Judged that way, a transient loss switched speculation off for good: each probe moved the old
estimate a fifth of the way, lost again, and doubled the interval to the next."""

from __future__ import annotations

from dataclasses import dataclass

# weight of the newest step in the running seconds per token
_SMOOTHING = 0.2
# a batch size where speculation lost speculates once in this many decode steps, the interval
# doubling after each probe it loses again (a probe costs: a draft catches up on the whole pause)
PROBE_EVERY = 32
MAX_PROBE_EVERY = 1024
# speculative steps a probe runs before it is judged
PROBE_STEPS = 4


@dataclass
class _Probe:
    seconds: float = 0.0
    tokens: int = 0
    steps: int = 0


class ThroughputCheck:
    def __init__(self) -> None:
        self._plain: dict[int, float] = {}  # batch size -> seconds per token
        self._spec: dict[int, float] = {}
        self._since_probe: dict[int, int] = {}
        self._probe_every: dict[int, int] = {}
        self._probes: dict[int, _Probe] = {}  # batch size -> the probe under way

    def _update(self, table: dict[int, float], batch: int, seconds: float, tokens: int) -> None:
        per_token = seconds / max(tokens, 1)
        old = table.get(batch)
        table[batch] = per_token if old is None else (1 - _SMOOTHING) * old + _SMOOTHING * per_token

    def plain_step(self, batch: int, seconds: float) -> None:
        self._update(self._plain, batch, seconds, batch)

    def speculative_step(self, batch: int, seconds: float, tokens: int) -> None:
        probe = self._probes.get(batch)
        if probe is None:
            self._update(self._spec, batch, seconds, tokens)
            if not self._losing(batch):
                self._probe_every[batch] = PROBE_EVERY
            return
        probe.seconds += seconds
        probe.tokens += tokens
        probe.steps += 1
        if probe.steps < PROBE_STEPS:
            return
        del self._probes[batch]
        self._spec[batch] = probe.seconds / max(probe.tokens, 1)
        every = self._probe_every.get(batch, PROBE_EVERY)
        self._probe_every[batch] = min(2 * every, MAX_PROBE_EVERY) if self._losing(batch) else PROBE_EVERY

    def _losing(self, batch: int) -> bool:
        plain = self._plain.get(batch)
        return plain is not None and self._spec[batch] >= plain

    def allows(self, batch: int) -> bool:
        """Whether a decode step of `batch` sequences may speculate."""
        plain, spec = self._plain.get(batch), self._spec.get(batch)
        if plain is None:
            return False  # measure plain decoding first
        if spec is None or spec < plain or batch in self._probes:
            return True
        n = self._since_probe.get(batch, 0) + 1
        if n >= self._probe_every.get(batch, PROBE_EVERY):
            self._since_probe[batch] = 0
            self._probes[batch] = _Probe()
            return True
        self._since_probe[batch] = n
        return False
