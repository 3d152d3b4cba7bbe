"""A dashboard panel, declared on the metric entry it draws (or with a query of its own)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, PrivateAttr, StringConstraints, model_validator

from ..core.models import StrictModel
from .rules import Number

Dashboard = Literal["overview", "training", "gpu", "host", "engines"]
PanelType = Literal["timeseries", "bars", "stat", "heatmap", "bargauge", "table"]


class Panel(StrictModel):
    """A dashboard panel drawing the entry's metric (or a query of its own)."""

    dashboard: Dashboard
    row: str = ""
    title: Annotated[str, StringConstraints(min_length=1)]
    type: PanelType = "timeseries"
    query: str = Field("<metric>{<sel>}", description="PromQL with <metric> and <sel>")
    legend: str = ""
    moving_average: str = ""
    stack: bool = False
    rate: bool = False
    width: int = Field(12, ge=1, le=24, description="grid columns")
    height: int = 8
    unit: str = Field("", description="a Grafana unit")
    min: Number | None = None
    max: Number | None = None
    description: str = ""
    _metric: str = PrivateAttr("")  # the entry it is declared on (set by the entry)

    @property
    def metric(self) -> str:
        return self._metric

    def on_metric(self, metric: str) -> Panel:
        self._metric = metric
        return self

    @model_validator(mode="after")
    def _query(self) -> Panel:
        bad = []
        if "<sel>" not in self.query:
            bad.append("the query must use <sel> so the dashboard's job/run/rank variables apply")
        if self.rate and self.query != "<metric>{<sel>}":
            bad.append("rate: true wraps the plain selector; write rate() into a custom query instead")
        if "rate(" in self.query and "$__rate_interval" not in self.query:
            bad.append("rate() in a panel must use [$__rate_interval]")
        if bad:
            raise ValueError("; ".join(bad))
        return self
