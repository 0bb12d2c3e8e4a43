"""Longest cached prefix per worker, from the workers holding each block of a prompt in order."""

from __future__ import annotations

from collections.abc import Iterable


class PrefixMatcher:
    """Feed the member sets of consecutive block hashes; a worker's count is how many leading
    blocks it holds. Blocks past a gap do not count: KV is only reusable as a prefix."""

    def __init__(self):
        self.counts: dict[str, int] = {}
        self._candidates: set[str] | None = None
        self._seen = 0

    @property
    def exhausted(self) -> bool:
        """No worker can extend its match any more."""
        return self._candidates is not None and not self._candidates

    def feed(self, member_sets: Iterable[Iterable[str]]) -> None:
        for members in member_sets:
            if self.exhausted:
                return
            members = set(members)
            self._candidates = members if self._candidates is None else self._candidates & members
            self._seen += 1
            for worker in self._candidates:
                self.counts[worker] = self._seen


def leading_matches(member_sets: Iterable[Iterable[str]]) -> dict[str, int]:
    matcher = PrefixMatcher()
    matcher.feed(member_sets)
    return matcher.counts
