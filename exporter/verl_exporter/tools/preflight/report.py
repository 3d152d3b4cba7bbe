"""What a check returns, how the findings print (text or --json), and the result file the sidecar reads."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ...core.atomicfile import write_atomic
from ...sidecar.collectors.preflight import CHECKS, RESULT_FORMAT, RESULT_FORMAT_VERSION, RESULT_NAME
from ...spec import Spec
from ...spec.overrides import PreflightKnobs


@dataclass(frozen=True)
class Finding:
    check: str  # one of CHECKS
    ok: bool
    line: str  # what was found; when not ok, what to do about it

    def __post_init__(self) -> None:
        if self.check not in CHECKS:
            raise ValueError(f"unknown check {self.check!r}")


class UsageError(Exception):
    """A flag combination that cannot be checked: exit 2."""


@dataclass
class Options:
    """Everything the checks read: the flags, the knobs, and the parts tests replace with fakes."""

    spec: Spec
    knobs: PreflightKnobs = field(default_factory=PreflightKnobs)
    node: str = ""
    gpus: int | None = None  # expected GPU count
    nvml_loader: Callable[[], Any] | None = None
    procfs: str = "/proc"
    kmsg: str = "/dev/kmsg"
    sysfs_root: str = "/sys"
    ports: int | None = None  # expected fabric ports
    port_rate_gbps: float | None = None  # the rate every port must run at; default: the highest seen here
    fabric_sample_s: float | None = None
    checkpoint_dir: str | None = None
    max_ckpt_to_keep: int | None = None
    deep: bool = False  # hash every file even when its manifest vouches for it
    manifests_dir: str | None = None
    nodes: int | None = None  # nodes expected in manifests_dir
    relay_url: str | None = None
    prometheus_url: str | None = None
    run: str | None = None
    clock: Callable[[], float] = time.time
    sleep: Callable[[float], None] = time.sleep
    cache: dict[str, Any] = field(default_factory=dict)  # what several checks read, computed once


def status_of(findings: list[Finding], check: str, skipped: set[str]) -> str:
    if check in skipped:
        return "skip"
    return "fail" if any(not f.ok for f in findings if f.check == check) else "pass"


def render_text(findings: list[Finding], statuses: dict[str, str]) -> str:
    lines = [f"{'ok  ' if f.ok else 'FAIL'} {f.check}: {f.line}" for f in findings]
    lines += [f"skip {check}: skipped (--skip {check})" for check, s in statuses.items() if s == "skip"]
    failed = [c for c, s in statuses.items() if s == "fail"]
    lines.append(f"preflight: FAILED ({', '.join(failed)})" if failed else "preflight: passed")
    return "\n".join(lines)


def document(findings: list[Finding], statuses: dict[str, str], node: str, now: float) -> dict[str, Any]:
    """The --json output, and the result file (which the sidecar's preflight collector validates)."""
    return {"format": RESULT_FORMAT, "format_version": RESULT_FORMAT_VERSION, "timestamp": round(now, 3),
            "node": node, "passed": all(s != "fail" for s in statuses.values()), "checks": statuses,
            "findings": [asdict(f) for f in findings]}


def write_result(state_dir: str, doc: dict[str, Any]) -> Path:
    path = Path(state_dir) / RESULT_NAME
    write_atomic(path, json.dumps(doc, indent=1) + "\n", mode=0o644)
    return path


def default_node() -> str:
    return os.uname().nodename
