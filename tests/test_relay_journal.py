"""The relay's journal (relay/journal.py): what survives a crash, and that it stays small."""

from __future__ import annotations

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
