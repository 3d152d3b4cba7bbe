"""Replay exported counter values through the generated alert expressions with promtool.

A sidecar restart is modelled the way Prometheus sees it: the last sample before the restart, a stale
marker, missing scrapes while the sidecar is down, then the restarted sidecar's values.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml
from conftest import REPO, require_tool
from helpers import scaled
from verl_exporter.spec.rules import EVAL_TIME_RE, duration_seconds

NONFINITE = "verl_training_nonfinite_values_total"


def nonfinite_alert_exprs() -> dict[str, str]:
    """{alert: expr} of every generated alert that reads the NaN counter."""
    groups = yaml.safe_load((REPO / "rules" / "verl-alerts.yaml").read_text())["groups"]
    return {r["alert"]: r["expr"] for g in groups for r in g["rules"] if "alert" in r and NONFINITE in r["expr"]}


def restart_values(before: list[float], down_minutes: int, after: list[float]) -> list[float | str | None]:
    """Per-minute samples of one counter across a restart that kept the sidecar down for down_minutes."""
    return [*before, "stale", *[None] * (down_minutes - 1), *after]


def firing_minutes(tmp_path: Path, series: str, values: list, expr: str, minutes,
                   more: dict[str, list] | None = None) -> list[int]:
    """The minutes (among `minutes`) at which expr returns anything for this input series (and `more`: other
    series -> their values)."""
    promtool = require_tool("promtool")
    inputs = [{"series": name, "values": " ".join("_" if v is None else str(v) for v in vals)}
              for name, vals in {series: values, **(more or {})}.items()]
    # One test file, one case per minute, each expecting nothing; promtool names the cases that got something.
    cases = [{"expr": f"count({expr})", "eval_time": f"{m}m", "exp_samples": []} for m in minutes]
    test = {"evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": inputs, "promql_expr_test": cases}]}
    path = tmp_path / "replay-test.yaml"
    path.write_text(yaml.safe_dump(test, sort_keys=False))
    result = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=scaled(120))
    if result.returncode == 0:
        return []
    failing = [duration_seconds(t) // 60 for t in re.findall(r'", ' + EVAL_TIME_RE, result.stdout + result.stderr)]
    assert failing, result.stdout + result.stderr
    return sorted(failing)
