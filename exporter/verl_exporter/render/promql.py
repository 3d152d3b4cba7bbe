"""PromQL for each kind of alert declared in the spec, and the recording rules those alerts stand on.

One function per alert kind builds the expression; ``output_labels`` says which labels the expression keeps,
which the generated promtool tests need to state the labels of the alert they expect.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..spec import RECORDINGS, WINDOW_RECORDING, MetricSpec, Spec
from ..spec.rules import Alert, duration_seconds, equality_matchers, fill_params

NONFINITE = "verl_training_nonfinite_values_total"
NONFINITE_MEMORY = "1d"  # how far back a restarted sidecar's NaN count is compared
# Labels a sidecar's series carry besides the metric's own: Prometheus's target labels and the sidecar's.
TARGET_LABELS = ("job", "instance")
# Cross-rank aggregation drops what differs between ranks of one run.
CROSS_RANK_DROP = ("instance", "rank", "gpu")
CROSS_RANK_OPS = ("avg", "stddev", "min", "max")
MIN_SAMPLES = 10  # an adaptive alert says nothing until its window holds this many samples


WINDOW_GROUP = "windows"  # the recording group of per-series window aggregates, evaluated once a minute
# The recordings written on an entry (rates of the node's kernel counters: CPU, disk) have their own group, so
# that they run beside the training recordings instead of after them (a group's rules run one after another).
NODE_GROUP = "node"


@dataclass(frozen=True)
class Recording:
    record: str
    expr: str
    group: str = "recording"


def selector(*parts: str) -> str:
    """Join label matchers, skipping empty ones: selector('job="verl"', '') -> 'job="verl"'."""
    return ", ".join(p.strip() for p in parts if p and p.strip())


def vector(metric: str, *matchers: str) -> str:
    inner = selector(*matchers)
    return f"{metric}{{{inner}}}" if inner else metric


def fill(template: str, metric: str, sel: str) -> str:
    """Replace the spec's placeholders: <metric> and <sel> (a selector that may be empty)."""
    out = template.replace("<metric>", metric).replace("<sel>", sel)
    # An empty selector must not leave "{}", "{, x}" or "{x, }" behind.
    out = re.sub(r"\{\s*,\s*", "{", out)
    out = re.sub(r",\s*\}", "}", out)
    return out.replace("{}", "")


def adaptive_lag(alert: Alert) -> str:
    """How far back the baseline window ends: past the alert's own `for`, so that a sustained shift is
    compared with what came before it, not with a window that already absorbs it."""
    return f"{duration_seconds(alert.for_) // 60 + 10}m"


def adaptive_records(alert: Alert, sel: str) -> list[Recording]:
    base = vector(alert.metric, sel)
    w = alert.window
    return [
        Recording(f"rank:{alert.metric}:avg_over_time_{w}", f"avg_over_time({base}[{w}])"),
        Recording(f"rank:{alert.metric}:stddev_over_time_{w}", f"stddev_over_time({base}[{w}])"),
        Recording(f"rank:{alert.metric}:count_over_time_{w}", f"count_over_time({base}[{w}])"),
    ]


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


JOIN = "on (job, instance, run, rank)"  # how one sidecar's series of different metrics are matched


def detector_cond(signal: str, direction: str, k: float, change: float, sel: str) -> str:
    """A step-domain deviation of one signal, from the gauges verl_exporter.core.detect exports; the value is the
    sustained z-score."""
    sig = selector(sel, f'signal="{signal}"')
    parts = []
    for d in (("down", "up") if direction == "both" else (direction,)):
        stat, cmp, ch = ("sustained_drop_zscore", "<", -change) if d == "down" else \
            ("sustained_rise_zscore", ">", change)
        cond = f"verl_detector_{stat}{{{sig}}} > {_num(k)}"
        if change:
            cond += f" and {JOIN} verl_detector_relative_change{{{sig}}} {cmp} {_num(ch)}"
        parts.append(cond)
    return " or ".join(f"({p})" for p in parts) if len(parts) > 1 else parts[0]


def alert_expr(alert: Alert, sel: str) -> str:
    m = alert.matchers.strip("{} ")
    if alert.kind == "threshold":
        inner = vector(alert.metric, sel, m)
        if alert.aggregate:
            inner = f"{alert.aggregate} ({inner})"
        return f"{inner} {alert.op} {_num(alert.threshold)}"
    if alert.kind == "nonfinite":
        counter = vector(NONFINITE, sel, f'metric="{alert.metric}"')
        w = alert.window if alert.window != "30m" else "10m"
        # The sidecar rebuilds this counter from the file after a restart, so a value that differs from the
        # last one before a gap (a sidecar down for longer than w) means NaNs logged in the gap; the same
        # value means none, and must not page. A counter never seen before is born with its first NaN.
        before = f"last_over_time({counter}[{NONFINITE_MEMORY}] offset {w})"
        return (f"increase({counter}[{w}]) > 0 or ({counter} != {before}) > 0"
                f" or ({counter} unless {before}) > 0")
    if alert.kind == "adaptive":
        w, lag = alert.window, adaptive_lag(alert)
        x = vector(alert.metric, sel, m)
        avg = vector(f"rank:{alert.metric}:avg_over_time_{w}", m) + f" offset {lag}"
        std = vector(f"rank:{alert.metric}:stddev_over_time_{w}", m) + f" offset {lag}"
        count = vector(f"rank:{alert.metric}:count_over_time_{w}", m) + f" offset {lag}"
        # The denominator's floor (a share of the mean, plus a tiny constant) keeps a flat series from
        # turning any wobble into an infinite z-score.
        z = f"({x} - {avg}) / ({std} + {_num(alert.rel_floor)} * abs({avg}) + 1e-9)"
        cmp = {"up": f"{z} > {_num(alert.k)}", "down": f"{z} < -{_num(alert.k)}",
               "both": f"abs({z}) > {_num(alert.k)}"}[alert.direction]
        return f"({cmp}) and {count} >= {MIN_SAMPLES}"
    if alert.kind == "trend":
        x = vector(alert.metric, sel, m)
        return f"predict_linear({x}[{alert.window}], {duration_seconds(alert.horizon)}) {alert.op} " \
               f"{_num(alert.threshold)}"
    if alert.kind == "stale":
        return f"time() - {vector(alert.metric, sel, m)} > {_num(alert.threshold)}"
    if alert.kind == "absent":
        return f"absent({vector(alert.metric, sel, m)})"
    if alert.kind == "expr":
        return fill(fill_params(alert.expr, alert), alert.metric, sel)
    if alert.kind == "detector":
        main = detector_cond(alert.signal, alert.direction, alert.k, alert.change, sel)
        if not alert.confirm:
            return main
        others = " or ".join(f"({detector_cond(c.signal, c.direction, c.k, c.change, sel)})"
                             for c in alert.confirm)
        return f"({main}) and {JOIN} ({others})"
    raise ValueError(f"unknown alert kind {alert.kind}")


MATCHER_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')


def selector_labels(selector: str) -> dict[str, str]:
    """Labels a test series needs for the selector to select it (job="verl" when it says nothing of job):
    an equality's value, the first alternative of a regex that matches it, "verl" where a negation allows.
    Raises ValueError for a selector no label value can be chosen for."""
    out: dict[str, str] = {"job": "verl"}
    for name, op, raw in MATCHER_RE.findall(selector):
        value = raw.encode().decode("unicode_escape")
        if op == "=":
            out[name] = value
        elif op == "=~":
            choices = ["verl", *value.split("|")]
            found = next((c for c in choices if _full(value, c)), None)
            if found is None:
                raise ValueError(f"no value of {name} could be chosen to match {name}=~{raw!r} in the generated "
                                 "tests; start the regex with a literal alternative")
            out[name] = found
        else:
            candidates = ["verl", "verl-exporter", "x"]
            ok = [c for c in candidates if (c != value if op == "!=" else not _full(value, c))]
            if not ok:
                raise ValueError(f"no value of {name} could be chosen for {name}{op}{raw!r}")
            out[name] = out[name] if name in out and out[name] in ok and name != "job" else ok[0]
    return out


def _full(pattern: str, text: str) -> bool:
    try:
        return re.fullmatch(pattern, text) is not None
    except re.error:
        return False


def keeps_label(expr: str, label: str) -> bool:
    """Whether an expression's result keeps a label of its input series: not when it is an aggregation
    `op by (...)` that does not list it (a heuristic enough for the spec's expr alerts)."""
    m = re.match(r"^\s*(?:sum|min|max|avg|count|quantile|stddev|stdvar|topk|bottomk|group)\s+by\s*\(([^)]*)\)",
                 expr)
    return m is None or label in [x.strip() for x in m.group(1).split(",")]


def output_labels(alert: Alert, series_labels: dict[str, str], sel: str) -> dict[str, str]:
    """The labels an alert carries (besides alertname and its own labels) for an input series."""
    if alert.kind == "absent":
        return {**equality_matchers(sel), **equality_matchers(alert.matchers)}
    if alert.kind == "threshold" and alert.aggregate:
        by = re.search(r"\bby\s*\(([^)]*)\)", alert.aggregate)
        keep = [x.strip() for x in by.group(1).split(",")] if by else []
        return {k: v for k, v in series_labels.items() if k in keep}
    if alert.kind == "nonfinite":
        return {**series_labels, "metric": alert.metric}
    return dict(series_labels)


def _num(x) -> str:
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    return repr(x) if isinstance(x, float) else str(x)


def all_recordings(spec: Spec) -> list[Recording]:
    sel = spec.rules.selector
    seen: dict[str, Recording] = {}
    for metric in spec.metrics:
        for r in metric.recordings:
            seen.setdefault(r.record, Recording(r.record, fill(r.expr, metric.name, sel), NODE_GROUP))
        if "cross_rank" in metric.record:
            for r in cross_rank_records(metric, sel):
                seen.setdefault(r.record, r)
        for r in window_records(metric, sel):
            seen.setdefault(r.record, r)
    for alert in spec.alerts():
        if alert.kind == "adaptive":
            for r in adaptive_records(alert, sel):
                seen.setdefault(r.record, r)
    return list(seen.values())
