"""The `detect:` part of a metric entry: which series are adaptive signals, and how their step-domain
baselines are built (see ``verl_exporter.core.detect``)."""

from __future__ import annotations

import re

from ..core.detect import MIN_STEPS_FLOOR, STATS, SignalSpec

SIGNAL_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")
DETECT_KEYS = {"signal", "labels", "window", "hold", "level_steps", "min_steps", "floor", "rel_floor", "trend",
               "export"}


def parse_detect(metric: str, labels: tuple[str, ...], i: int, raw, problems: list[str]) -> SignalSpec | None:
    where = f"metric {metric!r} detect[{i}]"
    if not isinstance(raw, dict):
        problems.append(f"{where}: must be a mapping")
        return None
    unknown = set(raw) - DETECT_KEYS
    if unknown:
        problems.append(f"{where}: unknown key(s) {sorted(unknown)}")
    name = raw.get("signal")
    if not isinstance(name, str) or not SIGNAL_NAME_RE.match(name):
        problems.append(f"{where}: signal must be a lower_snake_case name")
        return None
    sig_labels = raw.get("labels", {}) or {}
    if not isinstance(sig_labels, dict) or set(sig_labels) != set(labels):
        problems.append(f"{where}: labels must give a value for each of the metric's labels {list(labels)}")
        sig_labels = {}
    ints = {}
    for key, default, low in (("window", 30, MIN_STEPS_FLOOR), ("hold", 3, 1), ("level_steps", 5, 1),
                              ("min_steps", MIN_STEPS_FLOOR, MIN_STEPS_FLOOR)):
        value = raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            problems.append(f"{where}: {key} must be an integer >= {low}")
            value = default
        ints[key] = value
    if ints["min_steps"] > ints["window"]:
        problems.append(f"{where}: min_steps cannot exceed window")
    floats = {}
    for key, default in (("floor", 0.0), ("rel_floor", 0.02)):
        value = raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            problems.append(f"{where}: {key} must be a number >= 0")
            value = default
        floats[key] = float(value)
    export = raw.get("export", ["steps", "zscore", "sustained_rise_zscore", "sustained_drop_zscore"])
    if not isinstance(export, list) or set(export) - set(STATS):
        problems.append(f"{where}: export may list {list(STATS)}")
        export = []
    if "steps" not in export:
        export = ["steps", *export]
    return SignalSpec(name=name, metric=metric, labels=tuple((k, str(v)) for k, v in sig_labels.items()),
                      trend=bool(raw.get("trend", True)), export=tuple(export), **ints, **floats)
