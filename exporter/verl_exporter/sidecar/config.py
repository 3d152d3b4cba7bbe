"""Sidecar settings: a YAML file (--config) overlaid by command-line flags, checked strictly.

Every problem is reported at once, naming the setting. The result is a frozen dataclass.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from ..core.server import parse_listen
from ..spec import LABEL_NAME_RE, RESERVED_LABELS
from .collectors.sampler import DEFAULT_INTERVAL_S, DEFAULT_SLOW_INTERVAL_S
from .control import parse_file_mode
from .sources.verl_file import DEFAULT_MAX_LINE_BYTES, DEFAULT_POLL_S, DEFAULT_RECOVER_BYTES
from .store import DEFAULT_MAX_UNMAPPED

MIN_LINE_BYTES = 1024  # verl's step lines run to kilobytes: a smaller cap would reject them all
DEFAULT_PORT = 9477  # one sidecar per rank: the port is DEFAULT_PORT + local rank unless --listen says


class ConfigError(ValueError):
    def __init__(self, problems: list[str], origin: str = "config"):
        self.problems = problems
        super().__init__(f"{origin}: " + "; ".join(problems))


@dataclass(frozen=True)
class ServeConfig:
    listen: str = f"0.0.0.0:{DEFAULT_PORT}"
    rank: int | None = None
    local_rank: int | None = None
    run: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    verl_log: str | None = None
    checkpoint_dir: str | None = None
    spec: str | None = None
    overrides: str | None = None  # an overrides file (spec/overrides.py); unset: $VERL_EXPORTER_OVERRIDES,
    # then ./verl-exporter.yaml when it exists; "" for none
    max_unmapped: int = DEFAULT_MAX_UNMAPPED
    poll_interval: float = DEFAULT_POLL_S
    recover_bytes: int = DEFAULT_RECOVER_BYTES
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
    # resource collectors
    collectors: dict[str, bool] = field(default_factory=dict)  # name -> on/off; unset = the collector's default
    interval: float = DEFAULT_INTERVAL_S
    slow_interval: float = DEFAULT_SLOW_INTERVAL_S
    procfs: str = "/proc"
    gpus: str = "auto"
    trainer_pid: int | None = None
    watch_paths: tuple[str, ...] = ()
    gpu_pcie_throughput: bool = False
    checkpoint_grace: float = 900.0
    checkpoint_verify: bool = False
    # discovery and liveness
    file_sd: str | None = None
    advertise: str | None = None
    hang_factor: float = 0.0  # 0 = off; else /healthz fails after this many times the recent step time
    hang_min_seconds: float = 600.0
    # automated response (off unless a token is given)
    control_token_env: str | None = None
    control_token_file: str | None = None
    control_file: str | None = None
    control_file_mode: str = "0644"  # octal; readable by a trainer under another uid

    def const_labels(self, target_labels: tuple[str, ...] = ("run", "rank")) -> dict[str, str]:
        """Labels put on every series: run and rank when set, then the user's --label pairs."""
        out: dict[str, str] = {}
        if self.run and "run" in target_labels:
            out["run"] = self.run
        if self.rank is not None and "rank" in target_labels:
            out["rank"] = str(self.rank)
        out.update(self.labels)
        return out


_KEYS = {f.name for f in fields(ServeConfig)}


def read_config_file(path: str | None) -> dict[str, Any]:
    if not path:
        return {}
    try:
        doc = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError([f"cannot read it: {e.strerror}"], path) from None
    except UnicodeDecodeError as e:
        raise ConfigError([f"not UTF-8 text (byte {e.start})"], path) from None
    except yaml.YAMLError as e:
        raise ConfigError([f"not valid YAML: {e}"], path) from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(["it must be a mapping of settings"], path)
    # verl-log: and verl_log: are the same setting (flags are dashed, the dataclass fields are not)
    values = {str(k).replace("-", "_"): v for k, v in doc.items()}
    unknown = sorted(set(values) - _KEYS)
    if unknown:
        raise ConfigError([f"unknown setting(s) {unknown}; known: {sorted(_KEYS)}"], path)
    if len(values) < len(doc):
        raise ConfigError(["a setting is given twice (once with dashes, once with underscores)"], path)
    return values


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else None


def build_config(file_values: dict[str, Any], flag_values: dict[str, Any], origin: str = "config") -> ServeConfig:
    """Merge (flags win over the file, the file over the environment, that over defaults) and check."""
    merged: dict[str, Any] = {"rank": _env_int("RANK"), "local_rank": _env_int("LOCAL_RANK")}
    merged.update({k: v for k, v in file_values.items() if v is not None})
    flags = {k: v for k, v in flag_values.items() if v is not None and k in _KEYS}
    if isinstance(flags.get("collectors"), dict) and isinstance(merged.get("collectors"), dict):
        flags["collectors"] = {**merged["collectors"], **flags["collectors"]}  # --collector.x wins per name
    merged.update(flags)
    problems: list[str] = []

    for key in ("rank", "local_rank", "max_unmapped", "recover_bytes", "max_line_bytes", "trainer_pid"):
        value = merged.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            problems.append(f"{key} must be a non-negative integer, got {value!r}")
        elif key == "max_line_bytes" and value < MIN_LINE_BYTES:  # 0 would reject every line, silently
            problems.append(f"max_line_bytes must be at least {MIN_LINE_BYTES}, got {value!r}")
    if "poll_interval" in merged:
        value = merged["poll_interval"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.01 <= value <= 10:
            problems.append(f"poll_interval must be a number of seconds in [0.01, 10], got {value!r}")
    for key, low, high in (("interval", 0.1, 300), ("slow_interval", 1, 3600), ("checkpoint_grace", 0, 86400),
                           ("hang_factor", 0, 1000), ("hang_min_seconds", 0, 86400 * 7)):
        value = merged.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not low <= value <= high):
            problems.append(f"{key} must be a number of seconds in [{low}, {high}], got {value!r}")
    collectors = merged.get("collectors") or {}
    if not isinstance(collectors, dict) or not all(isinstance(v, bool) for v in collectors.values()):
        problems.append("collectors must map collector names to true/false")
        collectors = {}
    else:
        from .collectors import REGISTRY

        unknown = sorted(set(collectors) - set(REGISTRY))
        if unknown:
            problems.append(f"unknown collector(s) {unknown}; known: {sorted(REGISTRY)}")
    merged["collectors"] = dict(collectors)
    watch = merged.get("watch_paths") or ()
    if isinstance(watch, str) or not all(isinstance(p, str) for p in watch):
        problems.append("watch_paths must be a list of paths")
        watch = ()
    merged["watch_paths"] = tuple(watch)
    gpus = str(merged.get("gpus", "auto"))
    if not re.fullmatch(r"auto|all|[\w:.-]+(,[\w:.-]+)*", gpus):
        problems.append(f"gpus must be auto, all or a comma-separated list of indices/UUIDs, got {gpus!r}")
    if "listen" not in merged:
        local = merged.get("local_rank")
        merged["listen"] = f"0.0.0.0:{DEFAULT_PORT + (local if isinstance(local, int) else 0)}"
    try:
        parse_listen(str(merged["listen"]))
    except ValueError as e:
        problems.append(str(e))
    labels = merged.get("labels") or {}
    if isinstance(labels, list):  # from repeated --label k=v flags
        pairs = {}
        for item in labels:
            k, sep, v = str(item).partition("=")
            if not sep:
                problems.append(f"--label takes KEY=VALUE, got {item!r}")
            pairs[k] = v
        labels = pairs
    if not isinstance(labels, dict):
        problems.append("labels must map label names to values")
        labels = {}
    for k in labels:
        if not LABEL_NAME_RE.match(str(k)) or str(k).startswith("__") or k in RESERVED_LABELS:
            problems.append(f"label name {k!r} is not allowed (reserved or not a Prometheus label name)")
        if k in ("run", "rank"):
            problems.append(f"label {k!r} is set by --{k}, not --label")
    merged["labels"] = {str(k): str(v) for k, v in labels.items()}
    if (merged.get("control_token_env") or merged.get("control_token_file")) and not (
            merged.get("control_file") or merged.get("checkpoint_dir")):
        problems.append("the control endpoint needs --control-file or --checkpoint-dir (where the file goes)")
    mode = merged.get("control_file_mode")
    if mode is not None:
        # YAML reads an unquoted 0640 as the integer 416: take it as the octal number it was written as
        merged["control_file_mode"] = mode = format(mode, "04o") if isinstance(mode, int) else str(mode)
        try:
            parse_file_mode(mode)
        except ValueError as e:
            problems.append(f"control_file_mode: {e}")
    for key in ("run", "verl_log", "checkpoint_dir", "spec", "overrides", "control_token_env", "control_token_file",
                "control_file", "file_sd", "advertise"):
        if merged.get(key) is not None:
            merged[key] = str(merged[key])
    if problems:
        raise ConfigError(problems, origin)
    return ServeConfig(**{k: v for k, v in merged.items() if k in _KEYS})
