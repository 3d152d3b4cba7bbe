"""The sidecar's own health: counters and gauges declared in the spec with ``instrumented_by: exporter``.

Code names a self-metric by a ``SelfMetric`` handle, one per module and name, made as the module is imported:
a name the packaged spec does not declare as set by the pack fails that import, not a sidecar at 3 a.m. The
handle only refers to the spec entry, where the name, type, help and labels are declared.

Every problem anywhere in the sidecar goes through ``problem()``: it is counted and logged, and never raised
into the caller. Per component and kind, the first occurrence is logged with its traceback when it comes from
an exception that may be a bug; ordinary bad input (``expected=True``, or an OSError or UnicodeError: a
timeout, a reset connection, an unreadable file, undecodable bytes) is one line. Repeats are one line each, at
most once a minute.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import time
from collections.abc import Iterator

from prometheus_client.core import Metric

from .. import __version__
from ..spec import MetricSpec, Spec, load_spec
from .encode import safe_text
from .families import family

log = logging.getLogger(__name__)

_LOG_EVERY_S = 60.0
_MESSAGE_LIMIT = 400  # a message may quote what came from outside: never a whole /metrics body in the log
# Exceptions of ordinary bad input and I/O: their one-line message says it all, a traceback would only alarm.
_EXPECTED = (OSError, UnicodeError)


def describe(error: BaseException, limit: int = 200) -> str:
    """A short "Type: message" of an exception, for a log line (repr() of some quotes all their input)."""
    text = str(error)
    if len(text) > limit:
        text = text[:limit] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def one_line(message: str, limit: int = _MESSAGE_LIMIT) -> str:
    """The message on one line that any log handler can write: control characters and lone surrogates escaped."""
    message = safe_text(message[: limit * 2])
    return message if len(message) <= limit else message[:limit] + "..."


@functools.cache
def _set_by_the_pack() -> dict[str, MetricSpec]:
    return {m.name: m for m in load_spec().metrics if m.instrumented_by is not None}


class SelfMetric:
    """A spec entry the pack sets (``instrumented_by``), looked up by name in the packaged spec when made."""

    __slots__ = ("name", "labels")

    def __init__(self, name: str):
        metric = _set_by_the_pack().get(name)
        if metric is None:
            raise LookupError(f"{name} is not a metric the packaged spec says the pack sets (instrumented_by)")
        self.name, self.labels = name, tuple(metric.labels)

    def __repr__(self) -> str:
        return f"SelfMetric({self.name!r})"


BUILD_INFO = SelfMetric("verl_exporter_build_info")
SOURCE_ERRORS = SelfMetric("verl_exporter_source_errors_total")


class SpecSeries:
    """Thread-safe counters and gauges of the spec entries one part of the pack sets (names checked on use)."""

    def __init__(self, spec: Spec, instrumented_by: str, const_labels: dict[str, str] | None = None):
        self._metrics = {m.name: m for m in spec.instrumented(instrumented_by)}
        self._values: dict[str, dict[tuple[str, ...], float]] = {name: {} for name in self._metrics}
        self._lock = threading.Lock()
        # A run name from the command line may hold a lone surrogate: it must not make the registry unencodable.
        self._const = {name: safe_text(str(value)) for name, value in (const_labels or {}).items()}

    def _key(self, name: str, labels: dict[str, str]) -> tuple[str, ...]:
        metric = self._metrics[name]  # KeyError: not one this part sets, or not in the spec it was given
        return tuple(safe_text(str(labels[label])) for label in metric.labels)

    def inc(self, metric: SelfMetric, amount: float = 1.0, **labels: str) -> None:
        key = self._key(metric.name, labels)
        with self._lock:
            series = self._values[metric.name]
            series[key] = series.get(key, 0.0) + amount

    def set(self, metric: SelfMetric, value: float, **labels: str) -> None:
        key = self._key(metric.name, labels)
        with self._lock:
            self._values[metric.name][key] = float(value)

    def value(self, metric: SelfMetric | str, **labels: str) -> float:
        """The current value of one series (0 when never touched); for tests (by name) and health checks."""
        name = metric if isinstance(metric, str) else metric.name
        key = self._key(name, labels)
        with self._lock:
            return self._values[name].get(key, 0.0)

    def snapshot(self) -> dict[str, dict[tuple[str, ...], float]]:
        with self._lock:
            return {name: dict(series) for name, series in self._values.items()}

    def collect(self) -> Iterator[Metric]:
        snapshot = self.snapshot()
        for name, metric in self._metrics.items():
            yield family(metric, snapshot[name], self._const)


class SelfMetrics(SpecSeries):
    def __init__(self, spec: Spec, const_labels: dict[str, str] | None = None):
        super().__init__(spec, "exporter", const_labels)
        self._last_logged: dict[tuple[str, str], float] = {}
        self.set(BUILD_INFO, 1, version=__version__)

    def problem(self, component: str, kind: str, message: str, count: bool = True,
                error: BaseException | None = None, expected: bool = False) -> None:
        """Count a problem of a component and log it, rate-limited per (component, kind).

        The first one of a (component, kind) carries the traceback of error, or of the exception being
        handled when called from an ``except`` block; later ones are one line. expected=True says "ordinary
        bad input, not a bug": never a traceback (nor for an OSError or UnicodeError). count=False for
        problems that have a counter of their own (rejected lines): log only. The message is logged on one
        bounded line.
        """
        if count:
            self.inc(SOURCE_ERRORS, component=component)
        now = time.monotonic()
        last = self._last_logged.get((component, kind))
        if last is None or now - last >= _LOG_EVERY_S:
            self._last_logged[(component, kind)] = now
            exc = None
            if last is None and not expected:
                exc = error or sys.exc_info()[1]
                if isinstance(exc, _EXPECTED):
                    exc = None
            log.warning("%s: %s", component, one_line(message), exc_info=exc)
