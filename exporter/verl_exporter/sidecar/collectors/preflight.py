"""The last `verl-exporter preflight` result on this node, from the file it writes (``--preflight-result``).

A run started without a passing pre-flight is then visible in Prometheus: the file is absent (no series),
older than the run, or says a check failed. The file is read on every sample (it is a few hundred bytes,
capped at MAX_BYTES) and is hostile input like any other: a file that is not a result this module wrote is
counted as a problem and exports nothing, never a guess.

The format and the check names are declared here, the one place both the writer (tools/preflight) and the
reader import; the check names bound the ``check`` label.
"""

from __future__ import annotations

import json
import math
import os
import stat
from typing import Any

from .base import Collector, Context, Sample, Unavailable, register

RESULT_FORMAT = "verl-exporter-preflight-result"
RESULT_FORMAT_VERSION = 1
RESULT_NAME = "preflight.json"  # the file's name in the preflight's --state-dir
MAX_BYTES = 64 * 1024
CHECKS = ("gpu", "fabric", "disk", "checkpoint", "agreement", "paging")  # in the order they run
STATUSES = ("pass", "fail", "skip")


class BadResult(ValueError):
    """A result file that is not one the preflight wrote."""


def parse_result(raw: bytes) -> dict[str, Any]:
    """{"timestamp", "passed", "checks": {check: status}} of a result file's bytes; BadResult says why not."""
    if len(raw) > MAX_BYTES:
        raise BadResult(f"larger than {MAX_BYTES} bytes")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise BadResult(f"not JSON: {type(e).__name__}") from None
    if not isinstance(doc, dict) or doc.get("format") != RESULT_FORMAT:
        raise BadResult("not a verl-exporter preflight result")
    if doc.get("format_version") != RESULT_FORMAT_VERSION:
        raise BadResult(f"format version {doc.get('format_version')!r}; this exporter reads {RESULT_FORMAT_VERSION}")
    ts = doc.get("timestamp")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
        raise BadResult("timestamp is not a unix time")
    checks = doc.get("checks")
    if not isinstance(checks, dict):
        raise BadResult("checks is not a mapping")
    out: dict[str, str] = {}
    for name, status in checks.items():
        if name not in CHECKS or status not in STATUSES:
            raise BadResult(f"unknown check or status: {str(name)[:40]!r}: {str(status)[:40]!r}")
        out[name] = status
    passed = doc.get("passed")
    if not isinstance(passed, bool) or passed != all(s != "fail" for s in out.values()):
        raise BadResult("passed does not agree with the checks")
    return {"timestamp": float(ts), "passed": passed, "checks": out}


def read_result(path: str) -> dict[str, Any] | None:
    """The parsed result file; None when there is none yet. Raises OSError or BadResult."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO put there must not block the sampler
    except FileNotFoundError:
        return None
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise BadResult("not a regular file")
        raw = f.read(MAX_BYTES + 1)
    return parse_result(raw)


@register
class PreflightCollector(Collector):
    name = "preflight"
    description = "the last `verl-exporter preflight` result on this node (--preflight-result)"
    per_node = True

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        if not ctx.config.preflight_result:
            raise Unavailable("no --preflight-result file given")
        self.path = ctx.config.preflight_result

    def sample(self) -> list[Sample]:
        try:
            result = read_result(self.path)
        except (OSError, BadResult) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            self.ctx.self_metrics.problem(self.name, "read", f"{self.path}: {why}", expected=True)
            return []
        if result is None:
            return []
        rows: list[Sample] = [("verl_preflight_last_run_timestamp_seconds", {}, result["timestamp"]),
                              ("verl_preflight_passed", {}, 1.0 if result["passed"] else 0.0)]
        rows.extend(("verl_preflight_check_passed", {"check": check}, 1.0 if status == "pass" else 0.0)
                    for check, status in result["checks"].items() if status != "skip")
        return rows
