"""Sidecar settings (`verl-exporter serve`): a YAML file (--config) overlaid by command-line flags.

ServeConfig is a core.models StrictModel: an unknown key or a wrong value is an error, every one reported at
once, a file's with its FILE:LINE; `verl-exporter schema config` writes its JSON Schema. A file may spell
keys with dashes like the flags (``verl-log:`` is ``verl_log:``). The control endpoint's bearer token is never
a setting: the config names the environment variable or the file that holds it (sidecar/control.read_token).
"""

from __future__ import annotations

import argparse
import os
import re
import types
import typing
from collections.abc import Collection
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, JsonValue, ValidationInfo, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

from ..core.argtypes import integer
from ..core.models import FileError, KeyPath, Pid, StrictModel, json_schema, read_yaml, validate, where
from ..exposition.app import parse_listen
from ..spec import LABEL_NAME_RE, RESERVED_LABELS, SCRAPED_FROM, Engine
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
Count = Annotated[int, Field(ge=0, le=10**18)]  # a count or size from a file or flag; none is larger
LabelName = Annotated[str, Field(pattern=LABEL_NAME_RE.pattern)]


# The flag groups of `verl-exporter serve --help`; a field names its group with "x-group" (the rest: general).
COLLECT = "resource collectors"
LIVENESS = "discovery and liveness"
CONTROL = "automated response (off by default)"
PROGRESS = "progress supervision (with --state-dir)"
FORENSICS = "hang forensics (off by default: a stack capture attaches to the trainer)"


class ServeConfig(StrictModel):
    """verl-exporter serve: what one rank's sidecar reads and serves."""

    listen: str = Field(f"0.0.0.0:{DEFAULT_PORT}", description=f"HOST:PORT to serve on, :PORT for all interfaces "
                                                               f"(default 0.0.0.0:{DEFAULT_PORT} + local rank)",
        json_schema_extra={"x-metavar": "HOST:PORT"})
    rank: Count | None = Field(None, description="global rank (default $RANK); exported as label rank",
        json_schema_extra={"x-metavar": "N"})
    local_rank: Count | None = Field(None, description="rank on this node (default $LOCAL_RANK)",
        json_schema_extra={"x-metavar": "N"})
    run: Name | None = Field(None, description="run / experiment name; exported as label run",
        json_schema_extra={"x-metavar": "NAME"})
    labels: Annotated[dict[LabelName, Name], BeforeValidator(_label_pairs)] = Field(
        default_factory=dict, description="extra constant labels on every series",
        json_schema_extra={"x-metavar": "KEY=VALUE", "x-flag": "--label"})
    verl_log: str | None = Field(None, description="verl file-logger JSONL to follow ($VERL_FILE_LOGGER_PATH)",
        json_schema_extra={"x-metavar": "PATH"})
    checkpoint_dir: str | None = Field(None, description="verl's trainer.default_local_dir (checkpoints)",
        json_schema_extra={"x-metavar": "DIR"})
    spec: str | None = Field(None, description="a metric spec (file or directory) to use, not the packaged one",
        json_schema_extra={"x-metavar": "PATH"})
    overrides: str | None = Field(None, description="an overrides file (default $VERL_EXPORTER_OVERRIDES, then "
                                                    "./verl-exporter.yaml when it exists); '' for none",
        json_schema_extra={"x-metavar": "FILE"})
    max_unmapped: Count = Field(DEFAULT_MAX_UNMAPPED, description="cap on verl_unmapped_* series")
    poll_interval: float = Field(DEFAULT_POLL_S, ge=0.01, le=10, description="seconds between polls of the log")
    recover_bytes: Count = Field(DEFAULT_RECOVER_BYTES, description="bytes of the log's tail read at start")
    max_line_bytes: int = Field(DEFAULT_MAX_LINE_BYTES, ge=MIN_LINE_BYTES,  # 0 would reject every line, silently
                                description="longest log line accepted")
    collectors: dict[str, bool] = Field(default_factory=dict,
                                        description="collector name -> on/off; unset: the collector's default")
    interval: float = Field(DEFAULT_INTERVAL_S, ge=0.1, le=300, description="seconds between collector samples",
        json_schema_extra={"x-group": COLLECT})
    slow_interval: float = Field(DEFAULT_SLOW_INTERVAL_S, ge=1, le=3600,
                                 description="seconds between costly reads: energy, checkpoint size and hashes",
        json_schema_extra={"x-group": COLLECT})
    procfs: str = Field("/proc", description="where /proc is mounted",
        json_schema_extra={"x-metavar": "DIR", "x-group": COLLECT})
    sysfs_root: str = Field("/sys", description="where /sys is mounted (the fabric collector reads "
                                                "class/infiniband under it)",
        json_schema_extra={"x-metavar": "DIR", "x-group": COLLECT})
    gpus: str = Field("auto", pattern=r"^(auto|all|[\w:.-]+(,[\w:.-]+)*)$",
                      description="GPUs of this rank: auto (CUDA_VISIBLE_DEVICES + local rank), all, or a "
                                  "comma-separated list of NVML indices / GPU UUIDs",
        json_schema_extra={"x-metavar": "auto|all|LIST", "x-group": COLLECT})
    trainer_pid: Pid | None = Field(None, description="the trainer's pid: its process tree is role=trainer",
        json_schema_extra={"x-metavar": "PID", "x-group": COLLECT})
    watch_paths: Annotated[tuple[str, ...], BeforeValidator(_tuple)] = \
        Field((), description="also export size/free of the filesystems holding these paths",
        json_schema_extra={"x-group": COLLECT, "x-metavar": "PATH", "x-flag": "--watch-path"})
    gpu_pcie_throughput: bool = Field(False, description="also read PCIe throughput (about 20 ms per GPU per read)",
        json_schema_extra={"x-group": COLLECT})
    checkpoint_grace: float = Field(900.0, ge=0, le=86400, description="seconds an unfinished global_step_N/ may "
                                                                       "exist before it counts as incomplete",
        json_schema_extra={"x-group": COLLECT})
    checkpoint_verify: bool = Field(False, description="check kept checkpoints against their SHA-256 manifests",
        json_schema_extra={"x-group": COLLECT})
    preflight_result: str | None = Field(None, description="the result file of `verl-exporter preflight` on this "
                                                           "node (<its --state-dir>/preflight.json), exported",
        json_schema_extra={"x-group": COLLECT, "x-metavar": "FILE"})
    file_sd: str | None = Field(None, description="folder to register this sidecar in for Prometheus file_sd",
        json_schema_extra={"x-group": LIVENESS, "x-metavar": "DIR"})
    advertise: str | None = Field(None, description="host name Prometheus should scrape (default this host's FQDN)",
        json_schema_extra={"x-group": LIVENESS, "x-metavar": "HOST"})
    engines_from: str | None = Field(None, description="the prometheus.yml verl writes for its rollout servers "
                                                       "(Ray's session): keep --file-sd DIR/rollout-<run>.json "
                                                       "listing them", json_schema_extra={"x-group": LIVENESS,
                                                                                          "x-metavar": "PATH"})
    rollout_engine: Engine = Field("vllm", description="those servers' engine (verl's "
                                                                      "actor_rollout_ref.rollout.name)",
        json_schema_extra={"x-group": LIVENESS, "x-metavar": "|".join(SCRAPED_FROM)})
    healthz_hang: bool = Field(False, description="/healthz also fails while the trainer is hung: while the spec's "
                                                  "critical stall alert (VerlTrainingStalled, its knobs as the "
                                                  "overrides file sets them) holds on this sidecar's store",
        json_schema_extra={"x-group": LIVENESS})
    # Deprecated: the knobs of that alert, which an overrides file sets for the rules too (sidecar.hang_flags).
    hang_factor: float | None = Field(None, ge=0, le=1000, description="deprecated: the stall alert's factor "
                                                                       "(overrides: thresholds.factor); K > 0 also "
                                                                       "sets --healthz-hang, 0 changes nothing",
        json_schema_extra={"x-metavar": "K", "x-group": LIVENESS})
    hang_min_seconds: float | None = Field(None, ge=0, le=86400 * 7,
                                           description="deprecated: the stall alert's floor in seconds "
                                                       "(overrides: thresholds.at_least)",
        json_schema_extra={"x-group": LIVENESS})
    control_token_env: str | None = Field(None, description="enable the control endpoint, with the bearer token "
                                                            "in this environment variable",
        json_schema_extra={"x-group": CONTROL, "x-metavar": "NAME"})
    control_token_file: str | None = Field(None, description="same, with the token read from this file",
        json_schema_extra={"x-group": CONTROL, "x-metavar": "PATH"})
    control_file: str | None = Field(None, description="where requests are recorded for the trainer (default "
                                                       "<checkpoint_dir>/.verl-exporter-control.json)",
        json_schema_extra={"x-group": CONTROL, "x-metavar": "PATH"})
    control_file_mode: Annotated[str, BeforeValidator(_octal, json_schema_input_type=str | int)] = Field(
        "0644", description="octal permissions of the control file; 0644 lets a trainer under another uid read it",
        json_schema_extra={"x-group": CONTROL, "x-metavar": "OCTAL"})

    forensics_dir: str | None = Field(None, description="capture the trainer's stacks (py-spy) into this folder "
                                                        "when the run stalls or the relay asks; off when unset",
        json_schema_extra={"x-group": FORENSICS, "x-metavar": "DIR"})
    forensics_py_spy: str = Field("py-spy", description="the py-spy binary (a name on PATH or a path)",
        json_schema_extra={"x-group": FORENSICS, "x-metavar": "PATH"})
    forensics_native: bool = Field(True, description="ask py-spy for native frames too (--native), without "
                                                     "them where that fails",
        json_schema_extra={"x-group": FORENSICS})
    forensics_max_files: int = Field(DEFAULT_MAX_FILES, ge=1, le=10000,
                                     description="captures kept in the folder (the oldest removed)",
        json_schema_extra={"x-group": FORENSICS})
    forensics_max_bytes: int = Field(DEFAULT_MAX_BYTES, ge=1024 * 1024,
                                     description="bytes of captures kept in the folder (the oldest removed)",
        json_schema_extra={"x-group": FORENSICS})
    forensics_flight_recorder: str | None = Field(None, description="path prefix of the ranks' Flight Recorder "
                                                                    "JSON dumps (<prefix><rank>), read at a capture",
        json_schema_extra={"x-group": FORENSICS, "x-metavar": "PREFIX"})
    forensics_timeout: float = Field(DEFAULT_TIMEOUT_S, gt=0, le=600, description="seconds py-spy may take per "
                                                                                  "process",
        json_schema_extra={"x-group": FORENSICS})

    state_dir: str | None = Field(None, description="keep the run's highest step and restart counts here, "
                                                    "across sidecar and trainer restarts; off when unset",
        json_schema_extra={"x-group": PROGRESS, "x-metavar": "DIR"})
    planned_steps: Count | None = Field(None, description="the run's planned total steps (verl's "
                                                          "trainer.total_training_steps): ETA, early end",
        json_schema_extra={"x-group": PROGRESS})
    save_freq: int | None = Field(None, ge=1, description="verl's trainer.save_freq: when the next checkpoint is due",
        json_schema_extra={"x-group": PROGRESS})
    max_ckpt_to_keep: int | None = Field(None, ge=1, description="verl's trainer.max_actor_ckpt_to_keep: alert "
                                                                 "when more checkpoints are kept",
        json_schema_extra={"x-group": PROGRESS})
    deadline: float | None = Field(None, ge=0, description="unix time the allocation ends (a reservation): alert "
                                                           "when the next checkpoint comes after it",
        json_schema_extra={"x-group": PROGRESS, "x-metavar": "UNIX_TIME"})

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
        if self.engines_from and not (self.file_sd and self.run):
            raise ValueError("--engines-from needs --file-sd (where the entry goes) and --run (its label)")
        return self

    def const_labels(self, target_labels: Collection[str] = ("run", "rank")) -> dict[str, str]:
        """Labels put on every series: run and rank when set, then the user's --label pairs."""
        out: dict[str, str] = {}
        if self.run and "run" in target_labels:
            out["run"] = self.run
        if self.rank is not None and "rank" in target_labels:
            out["rank"] = str(self.rank)
        out.update(self.labels)
        return out


def _hint(err: ErrorDetails, path: KeyPath) -> str | None:
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


def env_int(name: str) -> int | None:
    """A rank from the environment: ASCII digits, at most 9 of them (no rank is larger); None otherwise."""
    value = os.environ.get(name, "")
    return int(value) if re.fullmatch(r"[0-9]{1,9}", value) else None


def flag_values(parsed: dict[str, Any]) -> dict[str, Any]:
    """The settings among parsed `serve` arguments (vars(args)): the --collector.NAME switches gathered into
    collectors, the command's own arguments (command, --config, --log-level) left out."""
    flags = {k: v for k, v in parsed.items() if k not in ("command", "config", "log_level", "func")}
    toggles = {k.split("__", 1)[1]: flags.pop(k) for k in list(flags) if k.startswith("collector__")}
    if any(v is not None for v in toggles.values()):
        flags["collectors"] = {k: v for k, v in toggles.items() if v is not None}
    return flags


def build_config(file_values: dict[str, Any], flag_values: dict[str, Any], origin: str = "config") -> ServeConfig:
    """Merge (flags win over the file, the file over the environment, that over defaults) and check."""
    merged: dict[str, Any] = {"rank": env_int("RANK"), "local_rank": env_int("LOCAL_RANK")}
    merged.update({k: v for k, v in file_values.items() if v is not None})
    unknown = sorted(set(flag_values) - set(ServeConfig.model_fields))
    if unknown:  # a flag with no setting behind it would be dropped without a word
        raise ValueError(f"flags without a setting: {unknown}")
    flags = {k: v for k, v in flag_values.items() if v is not None}
    if isinstance(flags.get("collectors"), dict) and isinstance(merged.get("collectors"), dict):
        flags["collectors"] = {**merged["collectors"], **flags["collectors"]}  # --collector.x wins per name
    merged.update(flags)
    if "listen" not in merged:
        local = merged.get("local_rank")
        offset = local if isinstance(local, int) and not isinstance(local, bool) and local >= 0 else 0
        merged["listen"] = f"0.0.0.0:{DEFAULT_PORT + offset}"
    return validate(ServeConfig, merged, origin, error=ConfigError, hint=_hint)


def flag_name(name: str) -> str:
    """The command-line flag of a setting: its name with dashes, or the field's own "x-flag"."""
    extra = _extra(ServeConfig.model_fields[name])
    return str(extra.get("x-flag") or "--" + name.replace("_", "-"))


def _extra(field: FieldInfo) -> dict[str, JsonValue]:
    """A field's json_schema_extra: the flag's presentation (x-flag, x-group, x-metavar)."""
    extra = field.json_schema_extra
    return extra if isinstance(extra, dict) else {}


def _default_text(field: FieldInfo) -> str:
    """" (default X)" for the help, from the field's own default (unless its description says it)."""
    if "default" in (field.description or "") or field.default_factory is not None:
        return ""
    value = field.default
    if value is None or value in ("", (), {}):
        return ""
    if isinstance(value, bool):
        return " (default on)" if value else ""
    return f" (default {value})"


def add_flags(parser: argparse.ArgumentParser) -> None:
    """`verl-exporter serve`'s flags, one per ServeConfig field, derived from it: name, type, help and default
    come from the field, so a setting is declared once (collectors: one --collector.NAME per collector)."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for name, field in ServeConfig.model_fields.items():
        if name == "collectors":
            continue  # per collector, below
        extra = _extra(field)
        group = extra.get("x-group")
        target: argparse._ActionsContainer = parser
        if group is not None:
            target = groups.setdefault(str(group), parser.add_argument_group(str(group)))
        kind = next((t for t in (bool, int, float, tuple, dict)
                     if t is _base(field.annotation)), str)
        options: dict[str, Any] = {"dest": name, "help": (field.description or "") + _default_text(field)}
        if "x-metavar" in extra:
            options["metavar"] = extra["x-metavar"]
        if kind is bool:
            options.update(action=argparse.BooleanOptionalAction if field.default else "store_true", default=None)
        elif kind in (tuple, dict):
            options.update(action="append", help=options["help"] + " (repeatable)")
        else:
            options["type"] = integer if kind is int else kind  # ASCII digits, bounded: see core.argtypes
            options.setdefault("metavar", {int: "N", float: "S"}.get(kind))
        target.add_argument(flag_name(name), **options)
    from .collectors import REGISTRY

    collect = groups.setdefault(COLLECT, parser.add_argument_group(COLLECT))
    for name, cls in sorted(REGISTRY.items()):
        collect.add_argument(f"--collector.{name}", dest=f"collector__{name}", action=argparse.BooleanOptionalAction,
                             default=None, help=f"{cls.description} (default {'on' if cls.default_enabled else 'off'})")


def _base(annotation: Any) -> Any:
    """The plain type under Optional[...] and Annotated[...]: int for ``Count | None``."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (typing.Union, types.UnionType):
            annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
        elif origin is not None:
            return origin
        else:
            return annotation


def schema() -> dict[str, Any]:
    """The JSON Schema of a --config file, with the collectors' names spelled out and label names checked."""
    from .collectors import REGISTRY

    doc = json_schema(ServeConfig, "verl-exporter serve --config")
    for prop in doc["properties"].values():  # the flags' presentation (x-group, x-metavar) is not the file's
        for key in [k for k in prop if k.startswith("x-")]:
            del prop[key]
    doc["properties"]["collectors"]["propertyNames"] = {"enum": sorted(REGISTRY)}
    doc["properties"]["labels"]["propertyNames"] = {"pattern": LABEL_NAME_RE.pattern}
    return doc

