"""The rollout engines' file_sd entry, kept current from the prometheus.yml verl writes (--engines-from).

With ``actor_rollout_ref.rollout.prometheus.enable`` verl rewrites the prometheus.yml of Ray's session with a job
``rollout`` listing its vLLM or SGLang servers. The sidecar polls that file and, when it changed (mtime or size),
writes ``<--file-sd DIR>/rollout-<run>.json`` atomically (engine_file_sd): the servers
labelled with the run (the join with the training series) and --rollout-engine (which the alerts select on).

A target that is not a host:port string is left out; it, a missing file, YAML that does not parse, or one
without the rollout job's targets is counted
(``verl_exporter_source_errors_total{component="engines_sd"}``) and logged once per change of the file; the last
good entry stays, so the servers do not leave discovery while verl rewrites its file (a dead one is
VerlRolloutEngineDown's).
"""

from __future__ import annotations

import json
import os
import re
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..core.atomicfile import make_dirs, write_atomic
from ..core.models import FileError, read_yaml
from ..spec import SCRAPED_FROM

POLL_S = 5.0
COMPONENT = "engines_sd"
VERL_ROLLOUT_JOB = "rollout"  # verl/workers/rollout/utils.py update_prometheus_config


# A target as Prometheus takes it: host:port, the host a DNS name, an IPv4 address or a bracketed IPv6 one.
_HOST = r"(?:[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,251}[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+(?:%[A-Za-z0-9_.-]+)?\])"
_TARGET = re.compile(rf"{_HOST}:([0-9]{{1,5}})")


def is_target(value: Any) -> bool:
    """A host:port string with a port of 1-65535: no scheme, path, whitespace or newline."""
    if not isinstance(value, str):
        return False
    match = _TARGET.fullmatch(value)
    return match is not None and 1 <= int(match.group(1)) <= 65535


def rollout_targets(verl_config: Any) -> list[Any]:
    """The targets of verl's rollout job in a prometheus.yml, as written: anything may stand where one belongs."""

    def items(value: Any, key: str) -> list[Any]:  # a file written by hand may hold anything where a list belongs
        found = value.get(key) if isinstance(value, dict) else None
        return found if isinstance(found, list) else []

    return [t for job in items(verl_config, "scrape_configs")
            if isinstance(job, dict) and job.get("job_name") == VERL_ROLLOUT_JOB
            for static in items(job, "static_configs") for t in items(static, "targets")]


def engine_file_sd(verl_config: Any, run: str, engine: str) -> list[dict[str, Any]]:
    """file_sd entries for the servers of the prometheus.yml verl writes, labelled with the run (so the engine
    series join the run's training series) and the engine (which the engine alerts select on). Only host:port
    targets are taken (null became "None", a URL or a newline went to Prometheus as written)."""
    if engine not in SCRAPED_FROM:  # the engines verl's rollout knows: actor_rollout_ref.rollout.name
        raise ValueError(f"engine must be one of {SCRAPED_FROM}, not {engine!r}")
    targets = [t for t in rollout_targets(verl_config) if is_target(t)]
    return [{"targets": targets, "labels": {"run": run, "rollout_engine": engine}}] if targets else []


class EnginesSd:
    def __init__(self, source: str, directory: str, run: str, engine: str, problem: Callable[..., None],
                 poll: float = POLL_S):
        self.source = Path(source)
        self.path = Path(directory) / f"rollout-{re.sub(r'[^A-Za-z0-9_.-]', '_', run)}.json"
        self.run, self.engine = run, engine
        self._problem = problem  # SelfMetrics.problem: counts and logs
        self._poll = poll
        self._seen: tuple[object, ...] | None = None  # the source's (mtime_ns, size) last read, or "missing"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def update(self) -> bool:
        """Read the source if it changed; True when the entry was written."""
        try:
            st = os.stat(self.source)
            seen: tuple[object, ...] = (st.st_mtime_ns, st.st_size)
        except OSError as e:
            if self._seen != ("missing",):
                self._seen = ("missing",)
                self._problem(COMPONENT, "missing", f"cannot read {self.source}: {e}", expected=True)
            return False
        if seen == self._seen:
            return False
        self._seen = seen
        if not stat.S_ISREG(st.st_mode):  # a FIFO would block open(), at the sidecar's start before it serves
            self._problem(COMPONENT, "unreadable", f"{self.source}: not a regular file", expected=True)
            return False
        try:
            doc, _ = read_yaml(self.source)
        except (FileError, OSError) as e:
            self._problem(COMPONENT, "unreadable", f"{self.source}: {e}", expected=True)
            return False
        entry = engine_file_sd(doc, self.run, self.engine)
        bad = [t for t in rollout_targets(doc) if not is_target(t)]
        if bad:
            shown = ", ".join(repr(t)[:60] for t in bad[:3]) + (", ..." if len(bad) > 3 else "")
            self._problem(COMPONENT, "bad_target", f"{self.source}: {len(bad)} target(s) of verl's rollout job "
                          f"that are not host:port left out: {shown}", expected=True)
        if not entry:
            self._problem(COMPONENT, "no_targets", f"{self.source} has no targets of verl's rollout job",
                          expected=True)
            return False
        try:
            make_dirs(self.path.parent, 0o755)
            write_atomic(self.path, json.dumps(entry), mode=0o644)  # Prometheus may run as another user
        except OSError as e:
            self._seen = None  # try again at the next poll
            self._problem(COMPONENT, "write", f"cannot write {self.path}: {e}", expected=True)
            return False
        return True

    def start(self) -> EnginesSd:
        self.update()

        def loop() -> None:
            while not self._stop.wait(self._poll):
                self.update()

        self._thread = threading.Thread(target=loop, name="verl-exporter-engines-sd", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling; the entry stays, as Prometheus should keep scraping the servers verl listed."""
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=2)
