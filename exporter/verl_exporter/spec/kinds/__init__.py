"""Alert kinds, one module each: a kind owns its keys and knobs, its PromQL, its generated promtool test, its
output labels, its in-process evaluation (the circuit breaker's) and what calibrate compares its knobs with.

``Alert`` is the union of the registered kinds, told apart by ``kind``. A new kind is one module here with a
subclass of ``base.AlertBase`` decorated ``@register``, and its tests.
"""

from __future__ import annotations

from typing import Annotated, Union

from pydantic import Field

from . import condition, detector, expr, nonfinite, stale, stall, threshold  # noqa: F401 - they register
from .base import CROSS_METRIC, KINDS, AlertBase, StepView

Alert = Annotated[Union[tuple(KINDS.values())], Field(discriminator="kind")]  # noqa: UP007

__all__ = ["CROSS_METRIC", "KINDS", "Alert", "AlertBase", "StepView"]
