"""Resolve a verl metric key (``timing_s/gen``) to a spec metric and its label values.

Literal keys are looked up in a dict; patterns are tried in spec order. Results are cached, since a run
logs the same keys every step; the cache is bounded so that a stream of ever-new keys cannot grow it.
Sources with ``when_absent`` depend on the whole line, not on one key: ``conditional`` answers them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from ..spec import UNMAPPED_PREFIX, MetricSpec, Spec

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


def unmapped_name(key: str) -> str:
    """The sanitised Prometheus name an unknown key is exported under (statsd_exporter's escaping)."""
    body = _UNSAFE.sub("_", key).strip("_").lower()
    return UNMAPPED_PREFIX + (body or "empty")


class KeyMapper:
    def __init__(self, spec: Spec):
        self._literal: dict[str, Resolved] = {}
        self._patterns: list[tuple[MetricSpec, object]] = []
        self._conditional: list[tuple[str, str, Resolved]] = []  # (key, key that must be absent, target)
        for metric in spec.metrics:
            for rule in metric.sources:
                if rule.when_absent:
                    values = tuple(rule.const_labels[name] for name in metric.labels)
                    self._conditional.append((rule.pattern, rule.when_absent, Resolved(metric, values, rule.scale)))
                elif rule.literal:
                    values = tuple(rule.const_labels[name] for name in metric.labels)
                    self._literal[rule.pattern] = Resolved(metric, values, rule.scale)
                else:
                    self._patterns.append((metric, rule))
        self._cache: dict[str, Resolved | None] = {}

    def resolve(self, key: str) -> Resolved | None:
        """The metric a key feeds, or None when no spec entry matches it."""
        try:
            return self._cache[key]
        except KeyError:
            pass
        found = self._literal.get(key)
        if found is None:
            found = self._match_patterns(key)
        if len(self._cache) < _CACHE_LIMIT:
            self._cache[key] = found
        return found

    def conditional(self, line: Mapping) -> list[tuple[str, Resolved]]:
        """The extra (key, target) pairs a line feeds: a key standing in for another key the line lacks."""
        return [(key, target) for key, absent, target in self._conditional if key in line and absent not in line]

    def _match_patterns(self, key: str) -> Resolved | None:
        for metric, rule in self._patterns:
            m = rule.regex.fullmatch(key)
            if m is None:
                continue
            captured = m.groupdict()
            if any(captured[k] not in allowed for k, allowed in rule.allowed.items()):
                continue
            values = tuple(captured[name] if name in captured else rule.const_labels[name]
                           for name in metric.labels)
            return Resolved(metric, values, rule.scale)
        return None
