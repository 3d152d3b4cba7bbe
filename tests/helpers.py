"""Helpers shared by the tests and the benchmarks (bench/ puts tests/ on sys.path): plain functions that need
neither pytest nor a running server. The fake GPU node is in fake_pynvml.busy_node."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import time
import types
import urllib.error
import urllib.request
from pathlib import Path

TESTS = Path(__file__).resolve().parent  # the suite's root: its helpers, data/ and fixtures/ (tests sit below it)
REPO = TESTS.parent
FIXTURES = TESTS / "fixtures"
DATA = TESTS / "data"
# Deadlines scale by this (a float, e.g. 4 on a machine whose cores other jobs keep busy); unset, by the load.
TIMEOUT_FACTOR_ENV = "VERL_EXPORTER_TEST_TIMEOUT_FACTOR"
CONTROL_TOKEN = "s3cr3t-control-token"  # the bearer token of the sidecars the tests start with /control on


def timeout_factor() -> float:
    """How many times longer than on a quiet machine a wait may take: $VERL_EXPORTER_TEST_TIMEOUT_FACTOR when set,
    else the machine's load per core over the last minute, at least 1 (measured at each wait, since another job
    may start during a long run). A condition that holds returns at once, so a large factor costs only the time
    a failing test takes to fail."""
    setting = os.environ.get(TIMEOUT_FACTOR_ENV, "").strip()
    if setting:
        factor = float(setting)
        if not factor > 0:
            raise ValueError(f"{TIMEOUT_FACTOR_ENV} must be a number above 0, not {setting!r}")
        return factor
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1.0, os.getloadavg()[0] / cores)


def scaled(seconds: float) -> float:
    """A deadline of `seconds` on a quiet machine, on this one (subprocess timeouts, a wait's own loop)."""
    return seconds * timeout_factor()


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05, what: str = ""):
    """predicate()'s first true result, polled every `interval` s; fails the test when none came within
    `timeout` seconds times the suite's timeout factor. No test waits a fixed time for something to happen."""
    limit = scaled(timeout)
    deadline = time.monotonic() + limit
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"{what or 'condition'} not met within {limit:.1f}s ({timeout}s x {TIMEOUT_FACTOR_ENV}"
                                 f" or the load: {limit / timeout:.2f})")
        time.sleep(interval)

RESULT_HEADER = ("measurement", "value", "baseline", "baseline value", "ratio", "goal", "verdict")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = max(1, -(-len(ordered) * q // 100))  # ceil
    return ordered[int(rank) - 1]


def results_table(rows: list[tuple[str, ...]], header: tuple[str, ...] = RESULT_HEADER) -> str:
    """A benchmark's results as aligned text columns, header first."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(header, widths, strict=True)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines)


def robot_target(kind: str, url: str, token: str, name: str = "t"):
    """A robot target as a relay config defines it, its token read from the environment it is given."""
    from verl_exporter.relay.config import parse_config

    doc = {"targets": {name: {"type": kind, "url": url, "token_env": "TOKEN"}}, "routes": [{"targets": [name]}]}
    return parse_config(doc, environ={"TOKEN": token}).targets[name]


def config_action(matchers: dict, action: str, url: str, token: str, cooldown_seconds: float = 1800.0):
    """A relay config's action, its token read from the environment."""
    from verl_exporter.relay.config import parse_config

    doc = {"targets": {"t": {"type": "console"}}, "routes": [{"targets": ["t"]}],
           "actions": [{"matchers": matchers, "action": action, "url": url, "token_env": "TOKEN",
                        "cooldown_seconds": cooldown_seconds}]}
    (out,) = parse_config(doc, environ={"TOKEN": token}).actions
    return out


def stop_action(url: str, token: str, cooldown_seconds: float = 1800.0):
    """A relay config's action that stops the run on VerlNumericalCollapse."""
    return config_action({"alertname": "VerlNumericalCollapse"}, "stop", url, token, cooldown_seconds)


def configure(ctx, **settings) -> None:
    """Change serve settings of a collectors Context in place: its collectors read ctx.config at each sample."""
    ctx.config = ctx.config.model_copy(update=settings)


def suite_module(relative: str) -> types.ModuleType:
    """A test module that another test reuses, by its path under tests/ (stack/test_stack.py feeds every key of
    verl/test_verl_keys.py's scan of verl): the module pytest collected, else the file imported once."""
    path = TESTS / relative
    for module in list(sys.modules.values()):
        if getattr(module, "__file__", None) == str(path):
            return module
    name = "tests." + relative.removesuffix(".py").replace("/", ".")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def control_post(url: str, token: str | None = None, body: bytes | None = b"{}", method: str = "POST"):
    """(status, the JSON answer, or {"text": ...}) of a request to a sidecar's /control endpoint."""
    req = urllib.request.Request(url, data=body, method=method)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=scaled(5)) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw or b"{}")
    except ValueError:
        return status, {"text": raw.decode()}


def run_demo(*args: str, env: dict | None = None, timeout: float = 240) -> tuple[subprocess.CompletedProcess, float]:
    """`verl-exporter demo ARGS` run to its end: (the finished process, its wall time in seconds). At the width
    docs/demo.md was cut at: the demo wraps to the terminal's columns (COLUMNS), and a runner that sets them
    (pytest-xdist's workers set 80) would wrap the excerpt's lines elsewhere."""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "verl_exporter", "demo", *args], capture_output=True, text=True,
                          timeout=scaled(timeout), env={**os.environ, "COLUMNS": "110", **(env or {})})
    return proc, time.monotonic() - started


def demo_rate() -> float:
    """The rate `demo` replays its run at in the tests: its default, slowed by the timeout factor, so that the path
    from the NaN to the checkpoint has the same share of a loaded machine (the demo compresses its timings by the
    rate: each rule's `for:`, Alertmanager's grouping, the stall limits)."""
    from verl_exporter.cli import build_parser

    return build_parser().parse_args(["demo"]).rate / timeout_factor()


def unwrap(text: str) -> str:
    """The demo's event lines as one line each (it wraps them under the time/step/who columns)."""
    return re.sub(r"\n {26}(?![│╭╰ ])", " ", text)
