"""The relay's journal (relay/journal.py): what survives a crash, and that it stays small."""

from __future__ import annotations

import json
import math
import time

import pytest
from helpers import scaled
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from verl_exporter.relay.journal import COMPACT_LINES, Journal
from verl_exporter.relay.metrics import RelayMetrics


class Item:
    jid = None


def alert(i: int) -> dict:
    return {"status": "firing", "labels": {"alertname": "X", "i": str(i)}, "startsAt": "2026-01-01T00:00:00Z"}


def test_a_cut_line_costs_that_line_only(tmp_path):
    metrics = RelayMetrics()
    j = Journal(tmp_path, metrics, window=60)
    j.recover()
    j.restart([])
    ids = [j.add("dt", "r", alert(i)) for i in range(3)]
    j.done(ids[:1])
    try_id = j.attempt("dt", 1000.0)
    with open(j.path, "a") as f:
        f.write('{"add": 99, "target": "dt", "recei')  # killed (or the disk full) in the middle of a line
    again = Journal(tmp_path, metrics, window=60)
    entries, sent = again.recover()
    assert [e.alert["labels"]["i"] for e in entries] == ["1", "2"]
    assert sent == {"dt": [1000.0]} and try_id
    assert metrics.value("verl_relay_spool_errors_total", operation="read") == 1


def test_the_journal_is_compacted_under_steady_load(tmp_path):
    j = Journal(tmp_path, RelayMetrics(), window=60)
    j.recover()
    keep = Item()
    j.restart([("dt", "r", alert(-1), keep)])
    for i in range(5 * COMPACT_LINES):
        j.done([j.add("dt", "r", alert(i))])
        j.attempt("dt", 1e12 + i)  # recent attempts: kept, but only the last few per target
    lines = j.path.read_text().splitlines()
    assert len(lines) <= 2 * COMPACT_LINES
    entries, _ = Journal(tmp_path, RelayMetrics(), window=60).recover()
    assert [e.alert["labels"]["i"] for e in entries] == ["-1"]
    assert oct(j.path.stat().st_mode & 0o777) == "0o600"


def _recover_after(tmp_path, lines: list[str]):
    metrics = RelayMetrics()
    j = Journal(tmp_path, metrics, window=60)
    j.recover()
    j.restart([])
    keep = j.add("dt", "r", alert(1))
    j.attempt("dt", time.time() - 5)
    with open(j.path, "a") as f:
        f.write("".join(line + "\n" for line in lines))
    again = Journal(tmp_path, metrics, window=60)
    entries, sent = again.recover()
    return keep, entries, sent, again.full_since(), metrics.value("verl_relay_spool_errors_total", operation="read")


HOSTILE_LINES = ['{"add": 1e999, "target": "dt", "alert": {}}', '{"add": -Infinity, "target": "dt", "alert": {}}',
                 '{"add": NaN, "target": "dt", "alert": {}}', '{"add": true, "target": "dt", "alert": {}}',
                 '{"add": 1.5, "target": "dt", "alert": {}}', '{"add": "7", "target": "dt", "alert": {}}',
                 '{"add": ' + "9" * 40 + ', "target": "dt", "alert": {}}',
                 '{"done": "1"}', '{"done": [1e999]}', '{"done": 1}', '{"done": [true]}',
                 '{"try": 1e999, "target": "dt", "at": 5}', '{"try": 50, "target": "dt", "at": NaN}',
                 '{"try": 51, "target": "dt", "at": 1e300}', '{"try": 52, "target": "dt", "at": "now"}',
                 '{"try": 53, "target": ["dt"], "at": 5}',
                 '{"full": "dt", "at": Infinity}', '{"full": "dt", "at": 1e300}', '{"full": "dt", "at": NaN}',
                 '{"full": {"a": 1}, "at": 5}', "[" * 50000, "7", "null", '"add"']


@pytest.mark.parametrize("line", HOSTILE_LINES)
def test_a_hostile_journal_line_costs_that_line_only(tmp_path, line):
    keep, entries, sent, full, errors = _recover_after(tmp_path, [line])
    assert [e.alert["labels"]["i"] for e in entries] == ["1"]  # the good entry is kept, none removed
    assert all(math.isfinite(t) and t <= time.time() + 1 for ts in sent.values() for t in ts)
    assert all(math.isfinite(t) and t <= time.time() + 1 for t in full.values())
    assert list(sent) in ([], ["dt"]) and list(full) in ([], ["dt"])
    assert errors == 1


journal_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(10**20), 10**20), st.floats(), st.text(max_size=6),
              st.just("dt")),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["add", "done", "try", "full", "target", "at", "alert", "receiver"]), inner, max_size=4),
    max_leaves=10)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(journal_values.map(json.dumps), max_size=6))
def test_any_journal_lines_are_recovered_without_raising(tmp_path, lines):
    for f in tmp_path.iterdir():
        f.unlink()
    _, entries, sent, full, _ = _recover_after(tmp_path, lines)
    assert all(isinstance(e.target, str) and isinstance(e.receiver, str) for e in entries)
    assert all(math.isfinite(t) and t <= time.time() + 1 for ts in sent.values() for t in ts)
    assert all(math.isfinite(t) and t <= time.time() + 1 for t in full.values())


def test_a_spool_file_that_is_a_fifo_or_nested_past_the_decoder_is_set_aside_and_the_good_ones_resent(tmp_path):
    import os
    import threading

    from verl_exporter.relay.config import parse_config
    from verl_exporter.relay.dispatch import SPOOL_PREFIX, Dispatcher

    good = {"version": 1, "alerts": [{"target": "dt", "receiver": "r", "alert": alert(7)}]}
    (tmp_path / f"{SPOOL_PREFIX}1.json").write_text(json.dumps(good))
    (tmp_path / f"{SPOOL_PREFIX}2.json").write_text("[" * 100000)
    os.mkfifo(tmp_path / f"{SPOOL_PREFIX}3.json")  # no writer: reading it would block the start for ever
    config = parse_config({"spool_dir": str(tmp_path), "targets": {"dt": {"type": "dingtalk", "token_env": "T"}},
                           "routes": [{"targets": ["dt"]}]}, environ={"T": "t"})
    metrics = RelayMetrics()
    dispatcher = Dispatcher(config, metrics)
    loaded: list[int] = []
    loader = threading.Thread(target=lambda: loaded.append(dispatcher.load_spool()), daemon=True)
    loader.start()
    loader.join(timeout=scaled(20))
    assert not loader.is_alive() and loaded == [1]
    assert metrics.value("verl_relay_spool_errors_total", operation="read") == 2
    assert sorted(p.name for p in tmp_path.glob("*.bad")) == [f"{SPOOL_PREFIX}2.bad", f"{SPOOL_PREFIX}3.bad"]


@pytest.mark.parametrize("make", ["fifo", "folder"])
def test_a_fifo_or_folder_in_the_journals_place_is_set_aside_and_the_relay_starts(tmp_path, make):
    """A FIFO there blocked the relay's start in open() on every restart (no webhook, no /healthz); a folder made
    the journal's rewrite fail, so the relay refused to start."""
    import os
    import threading

    metrics = RelayMetrics()
    j = Journal(tmp_path, metrics, window=60)
    os.mkfifo(j.path) if make == "fifo" else j.path.mkdir()
    got: list[tuple] = []
    reader = threading.Thread(target=lambda: got.append(j.recover()), daemon=True)
    reader.start()
    reader.join(timeout=5)
    blocked = reader.is_alive()
    if blocked:  # let the blocked open() go before failing
        os.close(os.open(j.path, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(timeout=5)
    assert not blocked and got == [([], {})]
    assert metrics.value("verl_relay_spool_errors_total", operation="read") == 1
    j.restart([])  # the relay's start goes on: the journal is written anew
    j.add("dt", "r", alert(1))
    entries, _ = Journal(tmp_path, RelayMetrics(), window=60).recover()
    assert [e.alert["labels"]["i"] for e in entries] == ["1"]
    assert j.path.is_file() and (tmp_path / (j.path.name + ".bad")).exists()
