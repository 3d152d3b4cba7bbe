"""Resolve a verl metric key (``timing_s/gen``) to a spec metric and its label values.

Literal keys are looked up in a dict; patterns are tried in spec order. Results are cached, since a run
logs the same keys every step; the cache is bounded so that a stream of ever-new keys cannot grow it.
Sources with ``when_absent`` depend on the whole line, not on one key: ``conditional`` answers them.

A label value captured from a key is where text from outside enters the exposition: lone surrogates (a JSON
``\\ud800`` escape, a name decoded from non-UTF-8 bytes) and control characters are escaped here
(``Resolved.escaped`` says why, for the store to count), and a value longer than MAX_LABEL_LENGTH once
escaped is refused ("label_too_long").
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..exposition.encode import safe_label_value
from ..spec import UNMAPPED_PREFIX, MetricSpec, SourceRule, Spec

_CACHE_LIMIT = 20_000
# Longest verl key and label value exported. Real keys are under 100 characters; a longer one would be
# exported verbatim as a name (and in HELP) and cached here, so a few huge keys could swell every scrape.
MAX_KEY_LENGTH = 256
MAX_LABEL_LENGTH = 128
_UNSAFE = re.compile(r"[^a-zA-Z0-9_]+")


@dataclass(frozen=True)
class Resolved:
    metric: MetricSpec
    label_values: tuple[str, ...]  # in the order of metric.labels
    scale: float
    escaped: str = ""  # why a label value was escaped ("not_utf8", "control_char"); "" when none was
    # metric.name, which the store reads for every value: a pydantic model's attribute costs ~3x a dataclass's
    # (BaseModel defines __getattr__, which keeps CPython from specialising the load)
    name: str = field(init=False)
    cap: int = field(init=False)  # series_cap(metric), read as often

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", self.metric.name)
        object.__setattr__(self, "cap", series_cap(self.metric))


def series_cap(metric: MetricSpec) -> int:
    """A metric's cap on label-value combinations: the Spec gives each its own or defaults.max_series."""
    if metric.max_series is None:
        raise ValueError(f"{metric.name} has no max_series: not a metric of a loaded Spec")
    return metric.max_series


def unmapped_name(key: str) -> str:
    """The sanitised Prometheus name an unknown key is exported under (statsd_exporter's escaping)."""
    body = _UNSAFE.sub("_", key).strip("_").lower()
    return UNMAPPED_PREFIX + (body or "empty")


class KeyMapper:
    def __init__(self, spec: Spec):
        self._literal: dict[str, Resolved] = {}
        # (metric, rule, its compiled pattern): the pattern read from the tuple, not from the model, per key tried
        self._patterns: list[tuple[MetricSpec, SourceRule, re.Pattern[str]]] = []
        self._conditional: list[tuple[str, str, Resolved]] = []  # (key, key that must be absent, target)
        for metric in spec.metrics:
            for rule in metric.source:
                if rule.when_absent:
                    values = tuple(rule.labels[name] for name in metric.labels)
                    self._conditional.append((rule.pattern, rule.when_absent, Resolved(metric, values, rule.factor)))
                elif rule.compiled is None:  # a literal key
                    values = tuple(rule.labels[name] for name in metric.labels)
                    self._literal[rule.pattern] = Resolved(metric, values, rule.factor)
                else:
                    self._patterns.append((metric, rule, rule.compiled))
        self._cache: dict[str, Resolved | None | str] = {}

    def resolve(self, key: str) -> Resolved | None | str:
        """The metric a key feeds, None when no spec entry matches it, or "label_too_long"."""
        try:
            return self._cache[key]
        except KeyError:
            pass
        found: Resolved | None | str = self._literal.get(key)
        if found is None:
            found = self._match_patterns(key)
        if len(self._cache) < _CACHE_LIMIT:
            self._cache[key] = found
        return found

    def conditional(self, line: Mapping[str, Any]) -> list[tuple[str, Resolved]]:
        """The extra (key, target) pairs a line feeds: a key standing in for another key the line lacks."""
        return [(key, target) for key, absent, target in self._conditional if key in line and absent not in line]

    def _match_patterns(self, key: str) -> Resolved | None | str:
        for metric, rule, regex in self._patterns:
            m = regex.fullmatch(key)
            if m is None:
                continue
            captured = m.groupdict()
            if any(captured[k] not in allowed for k, allowed in rule.values.items()):
                continue
            values, escaped = [], ""
            for name in metric.labels:
                if name in captured:
                    value, why = safe_label_value(captured[name])
                    if len(value) > MAX_LABEL_LENGTH:
                        return "label_too_long"
                    escaped = escaped or why
                else:
                    value = rule.labels[name]
                values.append(value)
            return Resolved(metric, tuple(values), rule.factor, escaped)
        return None
