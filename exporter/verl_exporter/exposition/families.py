"""Build a client_python metric family (name, help, type and samples) for a spec entry: what the sidecar's and
the relay's own counters give client_python's registry. (The training store's and the collectors' series are
rendered by exposition.TextRenderer instead.)"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..spec import MetricSpec


def family(metric: MetricSpec, rows: Mapping[tuple[str, ...], float], const_labels: Mapping[str, str]) -> Metric:
    """rows: {label values in the order of metric.labels: value}; const_labels are appended to each."""
    names = list(metric.labels) + list(const_labels)
    extra: Sequence[str] = list(const_labels.values())
    fam: CounterMetricFamily | GaugeMetricFamily
    if metric.type == "counter":
        fam = CounterMetricFamily(metric.name[: -len("_total")], metric.help, labels=names)
    else:
        fam = GaugeMetricFamily(metric.name, metric.help, labels=names)
    for key, value in sorted(rows.items()):
        fam.add_metric(list(key) + list(extra), value)
    return fam
