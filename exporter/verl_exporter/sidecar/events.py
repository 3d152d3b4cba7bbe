"""Events of a metric's series: the steps at which its verl keys arrive (a validation series' evaluations).

A gauge that did not move cannot show Prometheus that something happened: a collapsed model scores 0.0 on
every evaluation, a small validation set gives the same accuracy twice. The store sees the keys arrive, so for
each series of a metric an ``events:`` entry watches (spec/metrics/40-trainers.yaml) it keeps how many steps
the series arrived at, the last of them and when it was seen, exported as that entry says (``record``).

A step counts once per series, and only past the last one counted (the ``mark``): a repeated line, or the
recovered tail of the log a restarted sidecar reads again, counts nothing twice. A run resumed from a
checkpoint logs again the steps after it: a step below the last one seen lowers the marks below it, so an
evaluation done again is counted again. The state is kept across sidecar restarts by sidecar/progress.py (the
state file, read back as hostile input: ``EventState`` checks each entry, ``restore`` takes only what fits this
spec).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Field, StringConstraints

from ..core.models import StrictModel
from ..exposition.encode import safe_label_value
from ..spec import MetricSpec, Spec
from .mapper import MAX_LABEL_LENGTH, series_cap

_MAX = 2**53  # a count or step above this is none (and a float no longer holds every integer)
NO_MARK = -1.0  # before any step (steps are non-negative integers)
# the most entries a state may hold: the spec's caps bound it below (restore keeps each metric's cap)
MAX_ENTRIES = 1000


@dataclass
class _Series:
    count: float
    step: float
    time: float
    mark: float  # the highest step counted, lowered by a resume below it


class EventState(StrictModel):
    """One watched series as the state file keeps it."""

    metric: Annotated[str, StringConstraints(max_length=200)]
    labels: Annotated[list[Annotated[str, StringConstraints(max_length=MAX_LABEL_LENGTH)]], Field(max_length=8)]
    count: Annotated[int, Field(ge=1, le=_MAX)]
    step: Annotated[float, Field(ge=0, le=_MAX, allow_inf_nan=False)]
    time: Annotated[float, Field(ge=0, le=_MAX, allow_inf_nan=False)]
    mark: Annotated[float, Field(ge=NO_MARK, le=_MAX, allow_inf_nan=False)]


EventStates = Annotated[list[EventState], Field(max_length=MAX_ENTRIES)]


class SeriesEvents:
    """The events of every metric the spec's ``events:`` entries watch. Not thread-safe: the store calls it
    under its lock."""

    def __init__(self, spec: Spec):
        self._exported: dict[str, list[MetricSpec]] = {}  # watched metric -> its events entries
        for m in spec.events():
            assert m.events is not None  # spec.events()
            self._exported.setdefault(m.events.of, []).append(m)
        self.watched = frozenset(self._exported)
        self._caps = {name: series_cap(spec[name]) for name in self.watched}
        self._arity = {name: len(spec[name].labels) for name in self.watched}
        self._series: dict[str, dict[tuple[str, ...], _Series]] = {name: {} for name in self.watched}

    def take(self, step: float, seen_at: float, arrived: Iterable[tuple[str, tuple[str, ...]]]) -> None:
        """The series whose keys arrived on a line of this (valid) step; each counts once past its mark."""
        for name, labels in arrived:
            one = self._series[name].get(labels)
            if one is None:
                if len(self._series[name]) >= self._caps[name]:  # the store caps the series first
                    continue
                one = self._series[name][labels] = _Series(0.0, step, seen_at, NO_MARK)
            if step > one.mark:
                one.count += 1
                one.step, one.time, one.mark = step, seen_at, step

    def rewind(self, step: float) -> None:
        """A step below the last one seen (a resumed run): what is logged again from it on counts again."""
        for series in self._series.values():
            for one in series.values():
                one.mark = min(one.mark, step - 1)

    def rows(self) -> list[tuple[MetricSpec, dict[tuple[str, ...], float]]]:
        out = []
        for name, entries in self._exported.items():
            series = self._series[name]
            for m in entries:
                assert m.events is not None
                record = m.events.record
                out.append((m, {labels: getattr(one, record) for labels, one in series.items()}))
        return out

    def state(self) -> list[dict[str, Any]]:
        """Every series counted so far, as the state file keeps it (sorted, so that an unchanged state writes the
        same text)."""
        return [{"metric": name, "labels": list(labels), "count": int(one.count), "step": one.step,
                 "time": one.time, "mark": one.mark}
                for name in sorted(self._series) for labels, one in sorted(self._series[name].items())]

    def restore(self, entries: Iterable[EventState]) -> int:
        """Take back a state (checked by EventState); an entry of a metric this spec does not watch, with the
        wrong number of labels, a label value the store would not have exported as it is, a mark past its step or
        over the metric's cap is left out. Returns how many were."""
        left_out = 0
        for e in entries:
            series = self._series.get(e.metric)
            if series is None or len(e.labels) != self._arity[e.metric] or e.mark > e.step or any(
                    safe_label_value(v)[0] != v for v in e.labels) or (
                    tuple(e.labels) not in series and len(series) >= self._caps[e.metric]):
                left_out += 1
                continue
            series[tuple(e.labels)] = _Series(float(e.count), e.step, e.time, e.mark)
        return left_out
