"""Alert kinds, one module each: a kind owns its keys and knobs, its PromQL, its generated promtool test, its
output labels, its in-process evaluation (the circuit breaker's) and what calibrate compares its knobs with.

``Alert`` is the union of the registered kinds, told apart by ``kind``. Every module of this package is
imported here, and each kind registers itself (``@register``), so a new kind is one module with a subclass of
``base.AlertBase`` and its tests; nothing else names it.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING, Annotated, TypeAlias, Union

from pydantic import Field

from .base import CROSS_METRIC, KINDS, AlertBase, StepView

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

if TYPE_CHECKING:  # the union is only known once the modules have registered; statically, every kind is one
    Alert: TypeAlias = AlertBase
else:
    Alert = Annotated[Union[tuple(KINDS.values())], Field(discriminator="kind")]  # noqa: UP007

__all__ = ["CROSS_METRIC", "KINDS", "Alert", "AlertBase", "StepView"]
