"""The recording rules the alerts stand on, and each alert's PromQL (written by its kind, spec/kinds/)."""

from __future__ import annotations

from dataclasses import dataclass

from ..spec import RECORDINGS, WINDOW_RECORDING, MetricSpec, Spec
from ..spec.kinds.promql import fill, selector, selector_labels, vector
from ..spec.rules import equality_matchers

__all__ = ["Recording", "alert_expr", "all_recordings", "equality_matchers", "fill", "selector", "selector_labels"]

# Cross-rank aggregation drops what differs between ranks of one run.
CROSS_RANK_DROP = ("instance", "rank", "gpu")
CROSS_RANK_OPS = ("avg", "stddev", "min", "max")

WINDOW_GROUP = "windows"  # the recording group of per-series window aggregates, evaluated once a minute
# The recordings written on an entry (rates of the node's kernel counters: CPU, disk) have their own group, so
# that they run beside the training recordings instead of after them (a group's rules run one after another).
NODE_GROUP = "node"
# The engines' recordings likewise; their series are the engine's own (not the sidecars' job), named by it.
ENGINE_GROUP = "engines"


@dataclass(frozen=True)
class Recording:
    record: str
    expr: str
    group: str = "recording"


def alert_expr(alert, sel: str) -> str:
    return alert.promql(sel)


def cross_rank_records(metric: MetricSpec, sel: str) -> list[Recording]:
    drop = ", ".join(CROSS_RANK_DROP)
    return [Recording(f"job_run:{metric.name}:{op}", f"{op} without ({drop}) ({vector(metric.name, sel)})")
            for op in CROSS_RANK_OPS]


def window_records(metric: MetricSpec, sel: str) -> list[Recording]:
    """rank:<metric>:avg_over_time_10m = avg_over_time(<metric>[10m]), per series, for record: entries."""
    out = []
    for kind in metric.record:
        if not isinstance(kind, str) or kind in RECORDINGS:  # a written one, or not a window
            continue
        fn, window = WINDOW_RECORDING.fullmatch(kind).groups()
        out.append(Recording(f"rank:{metric.name}:{kind}", f"{fn}_over_time({vector(metric.name, sel)}[{window}])",
                             WINDOW_GROUP))
    return out


def all_recordings(spec: Spec) -> list[Recording]:
    sel = spec.rules.selector
    seen: dict[str, Recording] = {}
    for metric in spec.metrics:
        for r in metric.recordings:
            seen.setdefault(r.record, Recording(r.record, fill(r.expr, metric.name, "" if metric.scraped_from else sel),
                                                ENGINE_GROUP if metric.scraped_from else NODE_GROUP))
        if "cross_rank" in metric.record:
            for r in cross_rank_records(metric, sel):
                seen.setdefault(r.record, r)
        for r in window_records(metric, sel):
            seen.setdefault(r.record, r)
    return list(seen.values())
