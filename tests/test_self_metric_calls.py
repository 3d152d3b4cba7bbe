"""Every self-metric the code sets by name is declared in the spec with exactly the labels the call passes:
a misspelt name or a forgotten label fails here, not as a KeyError in a sidecar at 3 a.m."""

from __future__ import annotations

import ast
from pathlib import Path

import verl_exporter
from verl_exporter.spec import load_spec

PKG = Path(verl_exporter.__file__).parent
NOT_LABELS = {"amount", "value"}


def calls_by_name():
    """(where, name, label keywords or None where the call passes **labels) of each .inc/.set/.value("verl_...")."""
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("inc", "set", "value") and node.args
                    and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("verl_")):
                words = None if any(k.arg is None for k in node.keywords) else \
                    {k.arg for k in node.keywords} - NOT_LABELS
                yield f"{path.relative_to(PKG)}:{node.lineno}", node.args[0].value, words


def test_the_calls_are_found():
    assert sum(1 for _ in calls_by_name()) >= 40


def test_every_named_self_metric_is_declared_with_the_labels_it_is_given():
    metrics = {m.name: m for m in load_spec().metrics}
    wrong = []
    for where, name, words in calls_by_name():
        metric = metrics.get(name)
        if metric is None:
            wrong.append(f"{where}: {name} is not in the spec")
        elif metric.instrumented_by is None:
            wrong.append(f"{where}: {name} is fed by verl keys, not set by the pack")
        elif words is not None and words != set(metric.labels):
            wrong.append(f"{where}: {name} takes labels {sorted(metric.labels)}, the call gives {sorted(words)}")
    assert wrong == []
