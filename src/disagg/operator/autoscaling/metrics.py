"""Prometheus text exposition and histogram arithmetic, without a Prometheus server.

Histogram buckets are cumulative counters since the process started, so a percentile "over
the last minute" is the percentile of the DIFFERENCE between two scrapes. Pods are summed
bucket by bucket (never percentiles averaged), and quantiles are interpolated linearly inside
the bucket exactly as PromQL's `histogram_quantile` does, so both readers agree.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Histogram:
    """Cumulative bucket counts by upper bound (`le`), sorted, the last one +Inf."""

    buckets: tuple[tuple[float, float], ...]
    sum: float = 0.0

    @property
    def count(self) -> float:
        return self.buckets[-1][1] if self.buckets else 0.0

    def minus(self, older: Histogram) -> Histogram:
        """Observations made since `older` was taken. A smaller count means the process
        restarted in between (counters reset), so everything now counted is new."""
        if self.count < older.count:
            return self
        mine = dict(self.buckets)
        theirs = dict(older.buckets)
        bounds = sorted(set(mine) | set(theirs))
        return Histogram(
            tuple(
                (le, max(0.0, _at(self.buckets, le, mine) - _at(older.buckets, le, theirs))) for le in bounds
            ),
            max(0.0, self.sum - older.sum),
        )


def _at(buckets: tuple[tuple[float, float], ...], le: float, lookup: dict[float, float]) -> float:
    """Cumulative count at bound `le`; for a bound this histogram lacks, the count at its
    largest bound below (a lower estimate, as good as the coarser layout allows)."""
    if le in lookup:
        return lookup[le]
    below = [count for bound, count in buckets if bound <= le]
    return below[-1] if below else 0.0


def merge(histograms: Iterable[Histogram]) -> Histogram | None:
    """Sum of histograms bucket by bucket (pods of one pool); None when given none."""
    histograms = [h for h in histograms if h.buckets]
    if not histograms:
        return None
    bounds = sorted({le for h in histograms for le, _ in h.buckets})
    lookups = [dict(h.buckets) for h in histograms]
    return Histogram(
        tuple(
            (le, sum(_at(h.buckets, le, lk) for h, lk in zip(histograms, lookups, strict=True)))
            for le in bounds
        ),
        sum(h.sum for h in histograms),
    )


def quantile(q: float, hist: Histogram | None) -> float | None:
    """PromQL `histogram_quantile` semantics; None when no observation was made."""
    if not 0 <= q <= 1:
        raise ValueError(f"quantile: must be in [0, 1], got {q}")
    if hist is None or hist.count <= 0:
        return None
    rank = q * hist.count
    lower_bound, lower_count = 0.0, 0.0
    for le, count in hist.buckets:
        if count >= rank and count > lower_count:
            if math.isinf(le):
                # The +Inf bucket has no width: report the largest finite bound, as PromQL does.
                return lower_bound
            if lower_bound == 0.0 and le <= 0:
                return le
            return lower_bound + (le - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = le, count
    return lower_bound


def histogram_from_samples(pairs: Iterable[tuple[float, float]], total: float = 0.0) -> Histogram:
    """Build a Histogram from (le, cumulative count) pairs in any order."""
    ordered = sorted(pairs)
    if not ordered or not math.isinf(ordered[-1][0]):
        raise ValueError("histogram: the +Inf bucket is missing")
    return Histogram(tuple(ordered), total)


@dataclass
class Exposition:
    """One `/metrics` page: histograms and gauges by name, each keyed by its labels."""

    histograms: dict[str, dict[frozenset, Histogram]] = field(default_factory=dict)
    gauges: dict[str, dict[frozenset, float]] = field(default_factory=dict)

    def histogram(self, name: str, **labels: str) -> Histogram | None:
        """Sum of the series of `name` whose labels include `labels`."""
        return merge(h for key, h in self.histograms.get(name, {}).items() if _matches(key, labels))

    def gauge_values(self, name: str, **labels: str) -> list[float]:
        return [v for key, v in self.gauges.get(name, {}).items() if _matches(key, labels)]


def _matches(key: frozenset, labels: dict[str, str]) -> bool:
    return all((k, v) in key for k, v in labels.items())


def parse_exposition(text: str) -> Exposition:
    """Parse Prometheus text format (what prometheus-client's `/metrics` serves)."""
    page = Exposition()
    for family in text_string_to_metric_families(text):
        if family.type == "histogram":
            series: dict[frozenset, dict] = {}
            for s in family.samples:
                labels = {k: v for k, v in s.labels.items() if k != "le"}
                entry = series.setdefault(frozenset(labels.items()), {"buckets": [], "sum": 0.0})
                if s.name.endswith("_bucket"):
                    entry["buckets"].append((float(s.labels["le"]), float(s.value)))
                elif s.name.endswith("_sum"):
                    entry["sum"] = float(s.value)
            page.histograms[family.name] = {
                key: histogram_from_samples(e["buckets"], e["sum"])
                for key, e in series.items()
                if e["buckets"]
            }
        elif family.type == "gauge":
            page.gauges[family.name] = {frozenset(s.labels.items()): float(s.value) for s in family.samples}
    return page
