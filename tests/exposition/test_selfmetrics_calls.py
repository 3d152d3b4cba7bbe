"""Self-metrics are named by SelfMetric handles, checked against the spec as their module is imported; what an
import cannot see is checked here: every call passes exactly the labels the spec declares (a forgotten label
would be a KeyError in a sidecar at 3 a.m.), and no call names a metric by a bare string."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import verl_exporter
from verl_exporter.exposition.selfmetrics import SelfMetric, SelfMetrics
from verl_exporter.spec import load_spec

PKG = Path(verl_exporter.__file__).parent
NOT_LABELS = {"amount", "value"}


def _handles(tree: ast.Module) -> dict[str, str]:
    """{constant: metric name} of a module's `NAME = SelfMetric("...")` lines."""
    return {node.targets[0].id: node.value.args[0].value for node in tree.body
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
            and getattr(node.value.func, "id", "") == "SelfMetric" and isinstance(node.targets[0], ast.Name)}


def calls():
    """(where, first argument, metric name or None, label keywords or None where the call passes **labels) of
    each .inc/.set/.value call on a self-metric handle or a "verl_..." string."""
    for path in sorted(PKG.rglob("*.py")):
        tree = ast.parse(path.read_text())
        handles = _handles(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("inc", "set", "value") and node.args):
                continue
            first = node.args[0]
            if isinstance(first, ast.Name) and first.id in handles:
                arg, name = first.id, handles[first.id]
            elif isinstance(first, ast.Constant) and str(first.value).startswith("verl_"):
                arg, name = repr(first.value), None
            else:
                continue
            words = None if any(k.arg is None for k in node.keywords) else {k.arg for k in node.keywords} - NOT_LABELS
            yield f"{path.relative_to(PKG)}:{node.lineno}", arg, name, words


def test_the_calls_are_found():
    assert sum(1 for _ in calls()) >= 40


def test_every_call_names_a_handle_and_passes_the_labels_the_spec_declares():
    metrics = {m.name: m for m in load_spec().metrics}
    wrong = []
    for where, arg, name, words in calls():
        if name is None:
            wrong.append(f"{where}: {arg} is a bare string: name it by a SelfMetric handle")
        elif words is not None and words != set(metrics[name].labels):
            wrong.append(f"{where}: {name} takes labels {sorted(metrics[name].labels)}, the call gives {sorted(words)}")
    assert wrong == []


def test_a_name_the_spec_lacks_or_one_verl_feeds_fails_as_the_handle_is_made():
    with pytest.raises(LookupError, match="verl_exporter_lines_parsd_total"):
        SelfMetric("verl_exporter_lines_parsd_total")
    fed_by_verl = next(m.name for m in load_spec().metrics if m.instrumented_by is None)
    with pytest.raises(LookupError, match=fed_by_verl):
        SelfMetric(fed_by_verl)


def test_a_handle_sets_the_series_its_spec_entry_declares():
    metrics = SelfMetrics(load_spec())
    parsed = SelfMetric("verl_exporter_lines_parsed_total")
    assert parsed.labels == ("source",)
    metrics.inc(parsed, 2, source="file")
    assert metrics.value(parsed, source="file") == metrics.value(parsed.name, source="file") == 2
    with pytest.raises(KeyError):  # a label the entry declares, not given
        metrics.inc(parsed)
