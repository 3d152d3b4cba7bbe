"""Sidecar settings (`verl-exporter serve`): a YAML file (--config) overlaid by command-line flags.

ServeConfig is a core.models StrictModel: an unknown key or a wrong value is an error, every one reported at
once, a file's with its FILE:LINE; `verl-exporter schema config` writes its JSON Schema. A file may spell
keys with dashes like the flags (``verl-log:`` is ``verl_log:``). The control endpoint's bearer token is never
a setting: the config names the environment variable or the file that holds it (sidecar/control.read_token).
"""

from __future__ import annotations

import os
import re
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, ValidationInfo, field_validator, model_validator

from ..core.models import FileError, StrictModel, json_schema, read_yaml, validate, where
from ..core.server import parse_listen
from ..spec import LABEL_NAME_RE, RESERVED_LABELS
from .collectors.sampler import DEFAULT_INTERVAL_S, DEFAULT_SLOW_INTERVAL_S
from .control import parse_file_mode
from .forensics import DEFAULT_MAX_BYTES, DEFAULT_MAX_FILES, DEFAULT_TIMEOUT_S
from .sources.verl_file import DEFAULT_MAX_LINE_BYTES, DEFAULT_POLL_S, DEFAULT_RECOVER_BYTES
from .store import DEFAULT_MAX_UNMAPPED

MIN_LINE_BYTES = 1024  # verl's step lines run to kilobytes: a smaller cap would reject them all
DEFAULT_PORT = 9477  # one sidecar per rank: the port is DEFAULT_PORT + local rank unless --listen says


class ConfigError(FileError):
    """A serve config (file or flags) that cannot be used; ``problems`` lists every problem, each with its place."""


def _as_written(value: Any) -> Any:
    """YAML reads ``run: 2024`` as a number: a name takes it as the text it was written as."""
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


def _octal(value: Any) -> Any:
    """YAML reads an unquoted 0640 as the integer 416: take it as the octal number it was written as."""
    return format(value, "04o") if isinstance(value, int) and not isinstance(value, bool) else value


def _label_pairs(value: Any) -> Any:
    """Repeated --label KEY=VALUE flags arrive as a list."""
    if not isinstance(value, list):
        return value
    bad = [item for item in value if "=" not in str(item)]
    if bad:
        raise ValueError(f"--label takes KEY=VALUE, got {bad[0]!r}")
    return dict(str(item).partition("=")[::2] for item in value)


def _tuple(value: Any) -> Any:
    """A YAML list of paths is the tuple the frozen config keeps."""
    return tuple(value) if isinstance(value, list) else value


Name = Annotated[str, BeforeValidator(_as_written, json_schema_input_type=str | int)]
Count = Annotated[int, Field(ge=0)]
LabelName = Annotated[str, Field(pattern=LABEL_NAME_RE.pattern)]


class ServeConfig(StrictModel):
    """verl-exporter serve: what one rank's sidecar reads and serves."""

    listen: str = Field(f"0.0.0.0:{DEFAULT_PORT}", description=f"HOST:PORT to serve on, :PORT for all interfaces "
                                                               f"(default 0.0.0.0:{DEFAULT_PORT} + local rank)")
    rank: Count | None = Field(None, description="global rank (default $RANK); exported as label rank")
    local_rank: Count | None = Field(None, description="rank on this node (default $LOCAL_RANK)")
    run: Name | None = Field(None, description="run / experiment name; exported as label run")
    labels: Annotated[dict[LabelName, Name], BeforeValidator(_label_pairs)] = Field(
        default_factory=dict, description="extra constant labels on every series")
    verl_log: str | None = Field(None, description="verl file-logger JSONL to follow ($VERL_FILE_LOGGER_PATH)")
    checkpoint_dir: str | None = Field(None, description="verl's trainer.default_local_dir (checkpoints)")
    spec: str | None = Field(None, description="a metric spec (file or directory) to use, not the packaged one")
    overrides: str | None = Field(None, description="an overrides file (default $VERL_EXPORTER_OVERRIDES, then "
                                                    "./verl-exporter.yaml when it exists); '' for none")
    max_unmapped: Count = Field(DEFAULT_MAX_UNMAPPED, description="cap on verl_unmapped_* series")
    poll_interval: float = Field(DEFAULT_POLL_S, ge=0.01, le=10, description="seconds between polls of the log")
    recover_bytes: Count = Field(DEFAULT_RECOVER_BYTES, description="bytes of the log's tail read at start")
    max_line_bytes: int = Field(DEFAULT_MAX_LINE_BYTES, ge=MIN_LINE_BYTES,  # 0 would reject every line, silently
                                description="longest log line accepted")
    collectors: dict[str, bool] = Field(default_factory=dict,
                                        description="collector name -> on/off; unset: the collector's default")
    interval: float = Field(DEFAULT_INTERVAL_S, ge=0.1, le=300, description="seconds between collector samples")
    slow_interval: float = Field(DEFAULT_SLOW_INTERVAL_S, ge=1, le=3600,
                                 description="seconds between costly reads: energy, checkpoint size and hashes")
    procfs: str = Field("/proc", description="where /proc is mounted")
    gpus: str = Field("auto", pattern=r"^(auto|all|[\w:.-]+(,[\w:.-]+)*)$",
                      description="GPUs of this rank: auto (CUDA_VISIBLE_DEVICES + local rank), all, or a "
                                  "comma-separated list of NVML indices / GPU UUIDs")
    trainer_pid: Count | None = Field(None, description="the trainer's pid: its process tree is role=trainer")
    watch_paths: Annotated[tuple[str, ...], BeforeValidator(_tuple)] = \
        Field((), description="also export size/free of the filesystems holding these paths")
    gpu_pcie_throughput: bool = Field(False, description="also read PCIe throughput (about 20 ms per GPU per read)")
    checkpoint_grace: float = Field(900.0, ge=0, le=86400, description="seconds an unfinished global_step_N/ may "
                                                                       "exist before it counts as incomplete")
    checkpoint_verify: bool = Field(False, description="check kept checkpoints against their SHA-256 manifests")
    file_sd: str | None = Field(None, description="folder to register this sidecar in for Prometheus file_sd")
    advertise: str | None = Field(None, description="host name Prometheus should scrape (default this host's FQDN)")
    hang_factor: float = Field(0.0, ge=0, le=1000, description="/healthz fails when no step came for this many "
                                                               "times the recent step time; 0 = off")
    hang_min_seconds: float = Field(600.0, ge=0, le=86400 * 7,
                                    description="never call the trainer hung before this many seconds")
    control_token_env: str | None = Field(None, description="enable the control endpoint, with the bearer token "
                                                            "in this environment variable")
    control_token_file: str | None = Field(None, description="same, with the token read from this file")
    control_file: str | None = Field(None, description="where requests are recorded for the trainer (default "
                                                       "<checkpoint_dir>/.verl-exporter-control.json)")
    control_file_mode: Annotated[str, BeforeValidator(_octal, json_schema_input_type=str | int)] = Field(
        "0644", description="octal permissions of the control file; 0644 lets a trainer under another uid read it")

    forensics_dir: str | None = Field(None, description="capture the trainer's stacks (py-spy) into this folder "
                                                        "when the run stalls or the relay asks; off when unset")
    forensics_py_spy: str = Field("py-spy", description="the py-spy binary (a name on PATH or a path)")
    forensics_native: bool = Field(True, description="ask py-spy for native frames too (--native), without "
                                                     "them where that fails")
    forensics_max_files: int = Field(DEFAULT_MAX_FILES, ge=1, le=10000,
                                     description="captures kept in the folder (the oldest removed)")
    forensics_max_bytes: int = Field(DEFAULT_MAX_BYTES, ge=1024 * 1024,
                                     description="bytes of captures kept in the folder (the oldest removed)")
    forensics_flight_recorder: str | None = Field(None, description="path prefix of the ranks' Flight Recorder "
                                                                    "JSON dumps (<prefix><rank>), read at a capture")
    forensics_timeout: float = Field(DEFAULT_TIMEOUT_S, gt=0, le=600, description="seconds py-spy may take per "
                                                                                  "process")

    state_dir: str | None = Field(None, description="keep the run's highest step and restart counts here "
                                                    "(progress supervision); off when unset")
    planned_steps: Count | None = Field(None, description="the run's planned total steps "
                                                          "(trainer.total_training_steps)")
    save_freq: int | None = Field(None, ge=1, description="verl's trainer.save_freq (next checkpoint due)")
    max_ckpt_to_keep: int | None = Field(None, ge=1, description="verl's trainer.max_actor_ckpt_to_keep")
    deadline: float | None = Field(None, ge=0, description="unix time the allocation ends (a reservation)")

    @field_validator("listen")
    @classmethod
    def _listen(cls, value: str) -> str:
        parse_listen(value)
        return value

    @field_validator("labels")
    @classmethod
    def _labels(cls, labels: dict[str, str]) -> dict[str, str]:
        for k in labels:
            if k in ("run", "rank"):
                raise ValueError(f"label {k!r} is set by --{k}, not --label")
            if k.startswith("__") or k in RESERVED_LABELS:
                raise ValueError(f"label name {k!r} is not allowed (reserved)")
        return labels

    @field_validator("collectors")
    @classmethod
    def _collectors(cls, value: dict[str, bool]) -> dict[str, bool]:
        from .collectors import REGISTRY  # on first use: the training process may never need the collectors

        unknown = sorted(set(value) - set(REGISTRY))
        if unknown:
            raise ValueError(f"unknown collector(s) {unknown}; known: {sorted(REGISTRY)}")
        return value

    @field_validator("control_file_mode")
    @classmethod
    def _mode(cls, value: str) -> str:
        parse_file_mode(value)
        return value

    @model_validator(mode="after")
    def _control_needs_a_file(self, info: ValidationInfo) -> ServeConfig:
        # a file alone is checked before the flags are known: they may supply the other half
        if (info.context or {}).get("partial"):
            return self
        if (self.control_token_env or self.control_token_file) and not (self.control_file or self.checkpoint_dir):
            raise ValueError("the control endpoint needs --control-file or --checkpoint-dir (where the file goes)")
        return self

    def const_labels(self, target_labels: tuple[str, ...] = ("run", "rank")) -> dict[str, str]:
        """Labels put on every series: run and rank when set, then the user's --label pairs."""
        out: dict[str, str] = {}
        if self.run and "run" in target_labels:
            out["run"] = self.run
        if self.rank is not None and "rank" in target_labels:
            out["rank"] = str(self.rank)
        out.update(self.labels)
        return out


def _hint(err: dict, path: tuple) -> str | None:
    if err["type"] != "string_pattern_mismatch":
        return None
    if path[:1] == ("labels",):
        return "not a Prometheus label name"
    return "must be auto, all or a comma-separated list of GPU indices / UUIDs" if path == ("gpus",) else None


def _line(problem: str) -> int:
    m = re.match(r".*?:(\d+): ", problem)
    return int(m.group(1)) if m else 0


def read_config_file(path: str | None) -> dict[str, Any]:
    """The settings of a --config file, checked alone (every problem with its FILE:LINE); {} without one.
    An empty setting (``run:``) is unset."""
    if not path:
        return {}
    doc, lines = read_yaml(path, ConfigError)
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(["it must be a mapping of settings"], path)
    values: dict[str, Any] = {}
    problems: list[str] = []
    for key, value in doc.items():
        name = str(key).replace("-", "_")
        if name in values:
            problems.append(f"{where(path, lines, (key,))}: {name}: given twice (once with dashes, once with "
                            f"underscores)")
        values[name] = value
    lines = {(str(k[0]).replace("-", "_"), *k[1:]): n for k, n in lines.items()}
    values = {k: v for k, v in values.items() if v is not None}
    try:
        validate(ServeConfig, values, path, lines, ConfigError, _hint, context={"partial": True})
    except ConfigError as e:
        problems += e.problems
    if problems:
        raise ConfigError(sorted(problems, key=_line), path)
    return values


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else None


def build_config(file_values: dict[str, Any], flag_values: dict[str, Any], origin: str = "config") -> ServeConfig:
    """Merge (flags win over the file, the file over the environment, that over defaults) and check."""
    merged: dict[str, Any] = {"rank": _env_int("RANK"), "local_rank": _env_int("LOCAL_RANK")}
    merged.update({k: v for k, v in file_values.items() if v is not None})
    flags = {k: v for k, v in flag_values.items() if v is not None and k in ServeConfig.model_fields}
    if isinstance(flags.get("collectors"), dict) and isinstance(merged.get("collectors"), dict):
        flags["collectors"] = {**merged["collectors"], **flags["collectors"]}  # --collector.x wins per name
    merged.update(flags)
    if "listen" not in merged:
        local = merged.get("local_rank")
        ok = isinstance(local, int) and not isinstance(local, bool) and local >= 0
        merged["listen"] = f"0.0.0.0:{DEFAULT_PORT + (local if ok else 0)}"
    return validate(ServeConfig, merged, origin, error=ConfigError, hint=_hint)


def schema() -> dict:
    """The JSON Schema of a --config file, with the collectors' names spelled out and label names checked."""
    from .collectors import REGISTRY

    doc = json_schema(ServeConfig, "verl-exporter serve --config")
    doc["properties"]["collectors"]["propertyNames"] = {"enum": sorted(REGISTRY)}
    doc["properties"]["labels"]["propertyNames"] = {"pattern": LABEL_NAME_RE.pattern}
    return doc

