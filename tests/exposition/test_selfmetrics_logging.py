"""Logging: one logger per module (getLogger(__name__)); a problem's first occurrence logs its traceback,
repeats are one line, at most once a minute."""

from __future__ import annotations

import logging
import re
from pathlib import Path

from verl_exporter.exposition import selfmetrics
from verl_exporter.exposition.selfmetrics import SelfMetrics
from verl_exporter.sidecar.control import ControlReader
from verl_exporter.spec import load_spec

PACKAGE = Path(selfmetrics.__file__).resolve().parent.parent  # the whole package (core/ is one folder of it)


def test_every_module_logs_under_its_own_name():
    sources = {str(p.relative_to(PACKAGE)): p.read_text(encoding="utf-8") for p in PACKAGE.rglob("*.py")}
    named = {path: re.findall(r"getLogger\(\s*[\"'][^)]*\)", text) for path, text in sources.items()}
    assert {path: calls for path, calls in named.items() if calls} == {}  # no logger by a hand-written name
    assert sum(text.count("getLogger(__name__)") for text in sources.values()) >= 10


def test_a_problem_logs_its_traceback_once_then_one_line_a_minute(caplog, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(selfmetrics.time, "monotonic", lambda: now[0])
    sm = SelfMetrics(load_spec())

    def fail(message: str) -> None:
        try:
            raise RuntimeError(message)  # may be a bug: its traceback is worth the first log line
        except RuntimeError as e:
            sm.problem("disk", "read", f"diskstats: {e!r}")

    with caplog.at_level(logging.WARNING, logger="verl_exporter"):
        fail("first")
        now[0] += 10
        fail("again within the minute")  # counted, not logged
        now[0] += 60
        fail("a minute later")
        sm.problem("disk", "parse", "a bad line")  # another kind: its own first, without an exception
    records = [(r.name, r.getMessage(), bool(r.exc_info)) for r in caplog.records]
    assert records == [
        ("verl_exporter.exposition.selfmetrics", "disk: diskstats: RuntimeError('first')", True),
        ("verl_exporter.exposition.selfmetrics", "disk: diskstats: RuntimeError('a minute later')", False),
        ("verl_exporter.exposition.selfmetrics", "disk: a bad line", False),
    ]
    assert "Traceback" in caplog.text and caplog.text.count("Traceback") == 1
    assert sm.value("verl_exporter_source_errors_total", component="disk") == 4


def test_an_io_error_is_one_line_without_a_traceback(caplog):
    sm = SelfMetrics(load_spec())
    with caplog.at_level(logging.WARNING, logger="verl_exporter"):
        try:
            raise OSError(5, "Input/output error")
        except OSError as e:
            sm.problem("disk", "read", f"diskstats: {e}")
    assert [(r.getMessage(), r.exc_info) for r in caplog.records] == [("disk: diskstats: [Errno 5] Input/output error",
                                                                        None)]


def test_an_exception_passed_in_is_logged_with_its_traceback(caplog):
    sm = SelfMetrics(load_spec())
    try:
        raise RuntimeError("NVML went away")
    except RuntimeError as e:
        error = e
    with caplog.at_level(logging.WARNING, logger="verl_exporter"):
        sm.problem("gpu", "sample", "sample failed", error=error)
    (record,) = caplog.records
    assert record.exc_info and record.exc_info[1] is error


def test_the_control_reader_logs_a_bad_file_with_its_traceback_once(tmp_path, caplog):
    path = tmp_path / "control.json"
    clock = [0.0]
    reader = ControlReader(str(path), clock=lambda: clock[0])
    with caplog.at_level(logging.WARNING, logger="verl_exporter"):
        for i in range(3):
            path.write_text("{not json" + " " * i)  # a new size each time: a new file to read
            reader.poll()
            clock[0] += ControlReader.LOG_EVERY_S
    assert [bool(r.exc_info) for r in caplog.records] == [True, False, False]
    assert reader.read_failures == 3
