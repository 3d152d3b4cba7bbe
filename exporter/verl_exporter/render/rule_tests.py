"""promtool unit tests generated from the spec: for every alert, one case where it must stay silent and one
where it must fire, with its full labels and expanded annotations. Each kind writes its own case
(``case_for`` -> the kind's ``test_case``, from the pieces in spec/kinds/promtool.py)."""

from __future__ import annotations

from ..spec import Spec
from ..spec.kinds.promtool import expand, expand_series, go_printf, hold_at

__all__ = ["all_cases", "case_for", "expand", "expand_series", "go_printf", "hold_at"]


def case_for(spec: Spec, alert) -> dict:
    """One promtool test group for an alert: silent before the fault, firing after it."""
    return alert.test_case(spec)


def all_cases(spec: Spec) -> list[dict]:
    return [case_for(spec, a) for a in spec.alerts()]
