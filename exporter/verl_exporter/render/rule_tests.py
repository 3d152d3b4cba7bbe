"""promtool unit tests generated from the spec: for every alert, one case where it must stay silent and one
where it must fire, with its full labels and expanded annotations. Each kind writes its own case
(``case_for`` -> the kind's ``test_case``, from the pieces in spec/kinds/promtool.py)."""

from __future__ import annotations

import re

from ..spec import Spec
from ..spec.kinds.promtool import expand, expand_series, go_printf, hold_at

__all__ = ["all_cases", "case_for", "expand", "expand_series", "go_printf", "hold_at", "left_open"]


def case_for(spec: Spec, alert) -> dict:
    """One promtool test group for an alert: silent before the fault, firing after it."""
    return alert.test_case(spec)


def all_cases(spec: Spec) -> list[dict]:
    return [case_for(spec, a) for a in spec.alerts()]


# Prometheus 3.x range selectors are left-open: (t-d, t] drops the sample at t-d that 2.x's [t-d, t] holds.
# On promtool's whole-second sample grid, 2.x over [d-1s] selects what 3.x selects over [d].
# Quoted strings are matched first so that a "[5m]" inside a label value stays as it is.
DURATION = r"\d+[smhdwy](?:\d+[smhdwy])*"
RANGE = re.compile(rf'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|\[({DURATION})(:{DURATION})?\]')
SECONDS = {"y": 365 * 86400, "w": 7 * 86400, "d": 86400, "h": 3600, "m": 60, "s": 1}


def _seconds(duration: str) -> int:
    return sum(int(n) * SECONDS[unit] for n, unit in re.findall(r"(\d+)([smhdwy])", duration))


def _duration(seconds: int) -> str:
    parts = []
    for unit, size in SECONDS.items():
        if seconds >= size:
            parts.append(f"{seconds // size}{unit}")
            seconds %= size
    return "".join(parts) or "0s"


def left_open(expr: str) -> str:
    """The expression with every range (and subquery range) 1 s shorter: Prometheus 3.x's left-open
    selection emulated on a 2.x promtool."""
    return RANGE.sub(lambda m: m[0] if m[1] is None else f"[{_duration(_seconds(m[1]) - 1)}{m[2] or ''}]", expr)
