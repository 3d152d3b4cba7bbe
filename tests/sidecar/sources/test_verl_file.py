"""Following verl's file logger through everything real files do."""

from __future__ import annotations

import json
import math
import os

import pytest
from helpers import scaled
from verl_exporter.exposition.selfmetrics import SelfMetrics
from verl_exporter.sidecar.sources.verl_file import VerlFileFollower
from verl_exporter.sidecar.store import TrainingStore
from verl_exporter.spec import load_spec


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def line(step, **data) -> bytes:
    return json.dumps({"step": step, "data": data}).encode() + b"\n"


@pytest.fixture
def make(tmp_path):
    spec = load_spec()

    def build(name="run.jsonl", **kw):
        sm = SelfMetrics(spec)
        store = TrainingStore(spec, sm)
        path = tmp_path / name
        clock = Clock()
        follower = VerlFileFollower(str(path), store, sm, clock=clock, **kw)
        return path, follower, store, sm, clock

    return build


def test_file_not_existing_yet_is_waiting_and_healthy(make):
    path, f, store, sm, _ = make()
    f.poll()
    assert f.status() == "waiting"
    assert sm.value("verl_exporter_source_up", source="file") == 1
    path.write_bytes(line(1, **{"actor/grad_norm": 0.3}))
    f.poll()
    assert f.status() == "ok"
    assert store.value("verl_actor_grad_norm") == 0.3


def test_appended_lines_are_read_in_order(make):
    path, f, store, sm, clock = make()
    path.write_bytes(line(1, **{"actor/lr": 1.0}))
    f.poll()
    with open(path, "ab") as fh:
        fh.write(line(2, **{"actor/lr": 2.0}) + line(3, **{"actor/lr": 3.0}))
    clock.now = 2000.0
    f.poll()
    assert store.value("verl_actor_learning_rate") == 3.0
    assert store.step == 3 and store.step_time == 2000.0
    assert sm.value("verl_exporter_lines_parsed_total", source="file") == 3


def test_partial_last_line_waits_for_its_newline(make):
    path, f, store, _, _ = make()
    whole = line(1, **{"actor/lr": 5.0})
    path.write_bytes(whole[:20])
    f.poll()
    assert store.step is None
    with open(path, "ab") as fh:
        fh.write(whole[20:])
    f.poll()
    assert store.step == 1 and store.value("verl_actor_learning_rate") == 5.0


def test_truncation_by_a_restarted_run_is_detected(make):
    path, f, store, sm, _ = make()
    path.write_bytes(b"".join(line(s, **{"actor/lr": float(s)}) for s in range(1, 6)))
    f.poll()
    assert store.step == 5
    with open(path, "wb") as fh:  # verl opens with "wb"
        fh.write(line(1, **{"actor/lr": 0.5}))
    f.poll()
    assert store.step == 1 and store.value("verl_actor_learning_rate") == 0.5
    assert sm.value("verl_exporter_source_resets_total", reason="truncated") == 1


def test_truncate_and_regrow_past_our_offset_between_polls_is_detected(make):
    path, f, store, sm, _ = make()
    path.write_bytes(line(1, **{"actor/lr": 1.0}))
    f.poll()
    # The restarted run writes more than we had read before we look again.
    with open(path, "wb") as fh:
        fh.write(b"".join(line(s, **{"actor/lr": 100.0 + s}) for s in range(50, 55)))
    f.poll()
    assert store.step == 54 and store.value("verl_actor_learning_rate") == 154.0
    assert sm.value("verl_exporter_source_resets_total", reason="truncated") == 1
    assert sm.value("verl_exporter_lines_rejected_total", source="file", reason="malformed_json") == 0


def test_replacement_reads_the_old_file_to_its_end_then_the_new_one(make):
    path, f, store, sm, _ = make()
    path.write_bytes(line(1, **{"actor/lr": 1.0}))
    f.poll()
    with open(path, "ab") as fh:
        fh.write(line(2, **{"actor/grad_norm": 2.0}))
    os.rename(path, str(path) + ".1")  # rotated away, then a new file appears
    path.write_bytes(line(3, **{"actor/lr": 3.0}))
    f.poll()
    assert store.value("verl_actor_grad_norm") == 2.0  # the old file's last line was not lost
    assert store.step == 3 and store.value("verl_actor_learning_rate") == 3.0
    assert sm.value("verl_exporter_source_resets_total", reason="replaced") == 1


def test_deleted_file_goes_back_to_waiting(make):
    path, f, store, _, _ = make()
    path.write_bytes(line(1, **{"actor/lr": 1.0}))
    f.poll()
    path.unlink()
    f.poll()
    assert f.status() == "waiting" and store.step == 1


@pytest.mark.parametrize("bad,reason", [
    (b"this is not json\n", "malformed_json"),
    (b'{"step": 1, "data": {"a": \n', "malformed_json"),
    (b"\xff\xfe\x00garbage\n", "malformed_json"),
    (b"[1, 2, 3]\n", "not_an_object"),
    (b'{"step": 1}\n', "no_data"),
    (b'{"step": 1, "data": [1]}\n', "no_data"),
])
def test_bad_lines_are_rejected_by_reason_and_lose_nothing_around_them(make, bad, reason):
    path, f, store, sm, _ = make()
    path.write_bytes(line(1, **{"actor/lr": 1.0}) + bad + line(2, **{"actor/grad_norm": 0.7}))
    f.poll()
    assert sm.value("verl_exporter_lines_rejected_total", source="file", reason=reason) == 1
    assert store.value("verl_actor_learning_rate") == 1.0
    assert store.value("verl_actor_grad_norm") == 0.7 and store.step == 2


def test_blank_lines_are_ignored(make):
    path, f, store, sm, _ = make()
    path.write_bytes(b"\n  \n" + line(1, **{"actor/lr": 1.0}))
    f.poll()
    assert store.step == 1
    assert sm.value("verl_exporter_lines_rejected_total", source="file", reason="malformed_json") == 0


def test_null_values_become_nan(make):
    path, f, store, _, _ = make()
    path.write_bytes(b'{"step":7,"data":{"actor/grad_norm":null,"actor/pg_loss":0.1}}\n')
    f.poll()
    assert math.isnan(store.value("verl_actor_grad_norm"))
    assert store.nonfinite_counts() == {"verl_actor_grad_norm": 1.0}


def test_very_long_lines_are_rejected_with_bounded_memory(make):
    path, f, store, sm, _ = make(max_line_bytes=1000)
    huge = json.dumps({"step": 1, "data": {"x": "y" * 50_000}}).encode() + b"\n"
    path.write_bytes(huge + line(2, **{"actor/lr": 2.0}))
    f.poll()
    assert sm.value("verl_exporter_lines_rejected_total", source="file", reason="too_long") == 1
    assert store.step == 2
    assert f._lines.pending == 0


def test_a_long_line_arriving_in_pieces_is_skipped_to_its_end(make):
    path, f, store, sm, _ = make(max_line_bytes=100)
    path.write_bytes(b'{"step": 1, "data": {"x": "' + b"z" * 150)
    f.poll()
    assert f._lines.pending <= 100
    with open(path, "ab") as fh:
        fh.write(b"z" * 500 + b'"}}\n' + line(2, **{"actor/lr": 2.0}))
    f.poll()
    assert sm.value("verl_exporter_lines_rejected_total", source="file", reason="too_long") == 1
    assert store.step == 2


def test_sidecar_restart_recovers_latest_values_from_the_tail_with_file_mtime(make):
    path, f, store, sm, clock = make(recover_bytes=2000)
    lines = [line(s, **{"actor/lr": float(s), "timing_s/gen": 1.0}) for s in range(1, 500)]
    path.write_bytes(b"".join(lines))
    os.utime(path, (1234.0, 1234.0))
    clock.now = 2000.0
    f.poll()
    assert store.step == 499 and store.value("verl_actor_learning_rate") == 499.0
    parsed = sm.value("verl_exporter_lines_parsed_total", source="file")
    assert 0 < parsed < 100  # only the tail was read, not from step 0
    assert sm.value("verl_exporter_lines_rejected_total", source="file", reason="malformed_json") == 0
    assert store.step_time == 1234.0  # a dead trainer must not look freshly alive
    with open(path, "ab") as fh:
        fh.write(line(500, **{"actor/lr": 500.0}))
    clock.now = 5000.0
    f.poll()
    assert store.step_time == 5000.0


def test_unreadable_file_is_an_error_counted_and_recovered(make):
    if os.geteuid() == 0:
        # root reads anything; a directory at the path gives the same kind of error.
        path, f, store, sm, _ = make()
        path.mkdir()
        f.poll()
        f.poll()
        assert f.status().startswith("error")
        assert sm.value("verl_exporter_source_up", source="file") == 0
        assert sm.value("verl_exporter_source_errors_total", component="verl_file") >= 1
        path.rmdir()
    else:
        path, f, store, sm, _ = make()
        path.write_bytes(line(1, **{"actor/lr": 1.0}))
        path.chmod(0)
        f.poll()
        assert f.status().startswith("error")
        assert sm.value("verl_exporter_source_errors_total", component="verl_file") >= 1
        path.chmod(0o644)
        path.unlink()
    path.write_bytes(line(1, **{"actor/lr": 1.0}))
    f.poll()
    assert f.status() == "ok" and store.step == 1
    assert sm.value("verl_exporter_source_up", source="file") == 1


def test_the_thread_survives_unexpected_errors(make, monkeypatch):
    import time

    path, f, store, sm, _ = make(poll_interval=0.01)
    calls = {"n": 0}
    original = f.poll

    def flaky():
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        original()

    monkeypatch.setattr(f, "poll", flaky)
    path.write_bytes(line(1, **{"actor/lr": 1.0}))
    f.start()
    try:
        deadline = time.monotonic() + scaled(5)
        while store.step is None and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        f.stop()
    assert store.step == 1
    assert sm.value("verl_exporter_source_errors_total", component="verl_file") == 1


def nan_run(steps: int, nan_steps: set[int]) -> bytes:
    return b"".join(line(s, **{"actor/grad_norm": None if s in nan_steps else 0.5, "actor/pg_loss": 0.1,
                               "timing_s/gen": 1.0}) for s in range(1, steps + 1))


def test_a_sidecar_restart_rebuilds_the_nan_count_from_the_whole_file(make):
    # NaNs early in the run (outside the recovered tail) and late (inside it).
    path, f, store, _, clock = make(recover_bytes=3000)
    path.write_bytes(nan_run(400, {3, 50, 120, 390, 395, 396, 399}))
    f.poll()
    before = store.nonfinite_counts()
    assert before == {"verl_actor_grad_norm": 7.0}
    _, restarted, store2, sm2, _ = make(recover_bytes=3000)
    restarted.poll()
    assert store2.nonfinite_counts() == before  # not 4: Prometheus would read a reset and 4 new NaNs
    assert store2.step == 400
    assert sm2.value("verl_exporter_lines_parsed_total", source="file") < 100  # values still from the tail only


def test_a_restart_rebuilds_the_nan_count_of_a_key_standing_in_for_another(make):
    # Older verl logs the entropy as actor/entropy_loss (no actor/entropy): a null there counts for both
    # metrics live, and must count the same when a restarted sidecar rebuilds the count from the file.
    path, f, store, _, _ = make(recover_bytes=3000)
    lines = [{"step": s, "data": {"actor/entropy_loss": None if s in (5, 390) else 0.5, "actor/pg_loss": 0.1}}
             for s in range(1, 401)]
    path.write_bytes(b"".join(json.dumps(line).encode() + b"\n" for line in lines))
    f.poll()
    before = store.nonfinite_counts()
    assert before == {"verl_actor_entropy_loss": 2.0, "verl_actor_entropy": 2.0}
    _, restarted, store2, _, _ = make(recover_bytes=3000)
    restarted.poll()
    assert store2.nonfinite_counts() == before


@pytest.mark.parametrize("down_minutes", [1, 25])
@pytest.mark.integration
def test_a_sidecar_restart_raises_no_nan_alert_in_a_promtool_replay(make, tmp_path, down_minutes):
    from promreplay import NONFINITE, firing_minutes, nonfinite_alert_exprs, restart_values

    path, f, store, _, _ = make(recover_bytes=3000)
    path.write_bytes(nan_run(400, {3, 50, 120, 390, 395, 396, 399}))
    f.poll()
    before = store.nonfinite_counts()["verl_actor_grad_norm"]
    _, restarted, store2, _, _ = make(recover_bytes=3000)
    restarted.poll()
    after = store2.nonfinite_counts()["verl_actor_grad_norm"]
    with open(path, "ab") as fh:  # a real NaN after the restart must still fire
        fh.write(nan_run(1, {1}))
    restarted.poll()
    later = store2.nonfinite_counts()["verl_actor_grad_norm"]
    series = f'{NONFINITE}{{job="verl", instance="n:9477", run="r", rank="0", metric="verl_actor_grad_norm"}}'
    # 20 quiet minutes after the NaNs, the restart, 30 minutes on the recovered count, then one new NaN.
    values = restart_values([before] * 20, down_minutes, [after] * 30 + [later] * 5)
    restart_at, new_nan_at = 20 + down_minutes, 20 + down_minutes + 30
    expr = nonfinite_alert_exprs()["VerlNonFiniteGradNorm"]
    fired = firing_minutes(tmp_path, series, values, expr, range(11, len(values)))
    assert [m for m in fired if m < new_nan_at] == [], f"the restart at minute {restart_at} fired the alert"
    assert new_nan_at in fired


def test_the_nan_count_is_per_file_so_a_restart_after_a_truncation_rebuilds_it(make):
    path, f, store, _, _ = make()
    path.write_bytes(nan_run(10, {2, 3}))
    f.poll()
    with open(path, "wb") as fh:  # verl restarted: a new file, one NaN so far
        fh.write(nan_run(4, {4}))
    f.poll()
    assert store.nonfinite_counts() == {"verl_actor_grad_norm": 1.0}
    _, restarted, store2, _, _ = make()
    restarted.poll()
    assert store2.nonfinite_counts() == store.nonfinite_counts()


@pytest.mark.parametrize("bad,reason", [
    (b'{"step": 2, "data": {"a": ' + b"[" * 2000 + b"]" * 2000 + b"}}\n", "too_deep"),
    (b'{"step": 2, "data": {"a": 1' + b"0" * 5000 + b"}}\n", "malformed_json"),  # over Python's digit limit
])
def test_one_bad_line_costs_only_itself_not_the_rest_of_the_read(make, bad, reason):
    path, f, store, sm, _ = make()
    path.write_bytes(line(1, **{"actor/lr": 1.0}) + bad + line(3, **{"actor/grad_norm": None}) + line(4, x=1.0))
    f.poll()
    assert sm.value("verl_exporter_lines_rejected_total", source="file", reason=reason) == 1
    assert store.step == 4 and store.nonfinite_counts() == {"verl_actor_grad_norm": 1.0}
    assert sm.value("verl_exporter_source_errors_total", component="verl_file") == 0


@pytest.mark.parametrize("step,value", [(10**400, 1.0), (5, 10**400)], ids=["step", "value"])
def test_a_huge_integer_step_or_value_is_rejected_alone(make, step, value):
    path, f, store, sm, _ = make()
    huge = json.dumps({"step": step, "data": {"actor/lr": value, "actor/grad_norm": 0.25}}).encode() + b"\n"
    path.write_bytes(line(1, **{"actor/lr": 1.0}) + huge + line(7, **{"actor/pg_loss": None}))
    f.poll()
    assert store.step == 7 and store.nonfinite_counts() == {"verl_actor_pg_loss": 1.0}
    assert store.value("verl_actor_grad_norm") == 0.25  # the rest of the line is kept
    rejected = "bad_step" if step != 5 else "out_of_range"
    assert sm.value("verl_exporter_values_rejected_total", reason=rejected) == 1
    assert sm.value("verl_exporter_source_errors_total", component="verl_file") == 0


def test_a_file_from_the_future_does_not_make_the_recovered_step_recent(make):
    path, f, store, _, clock = make()
    path.write_bytes(line(1, **{"actor/lr": 1.0}))
    os.utime(path, (clock.now + 7200, clock.now + 7200))  # a shared file system whose clock runs ahead
    f.poll()
    assert store.step_time == clock.now


def test_a_file_rewritten_then_rotated_between_polls_is_read_from_its_new_start(make):
    path, f, store, sm, _ = make()
    path.write_bytes(b"".join(line(s, **{"actor/lr": float(s)}) for s in range(1, 6)))
    f.poll()
    with open(path, "wb") as fh:  # verl restarted and rewrote the file ...
        fh.write(line(1, **{"actor/lr": 0.5}))
    os.rename(path, str(path) + ".1")  # ... which was then rotated away before our next poll
    f.poll()
    assert store.value("verl_actor_learning_rate") == 0.5
    assert sm.value("verl_exporter_source_resets_total", reason="truncated") == 1


def test_a_file_rewritten_to_exactly_the_size_we_had_read_is_detected(make):
    path, f, store, sm, _ = make()
    first = line(1, **{"actor/lr": 1.0})
    path.write_bytes(first)
    f.poll()
    rewritten = line(2, **{"actor/lr": 2.0})
    assert len(rewritten) == len(first)
    path.write_bytes(rewritten)
    f.poll()
    assert store.step == 2 and store.value("verl_actor_learning_rate") == 2.0
    assert sm.value("verl_exporter_source_resets_total", reason="truncated") == 1


# ---------------------------------------------------------------- the NaN count after a restart (issue 22, F2)
def filler(steps: int) -> bytes:
    return b"".join(line(s, **{"actor/pg_loss": 0.1, "timing_s/gen": 1.0}) for s in range(1, steps + 1))


def counts_live_and_after_a_restart(make, content: bytes, **kw) -> tuple[dict, dict]:
    """The NaN counts of a follower that read the file from its start, and of a restarted one that recounts
    everything before the last 2,000 bytes."""
    path, live, store, _, _ = make(recover_bytes=len(content) + 1, **kw)
    path.write_bytes(content)
    live.poll()
    _, restarted, store2, _, _ = make(recover_bytes=2000, **kw)
    restarted.poll()
    assert store2.step == store.step  # the restarted one did read the tail
    return store.nonfinite_counts(), store2.nonfinite_counts()


def test_a_too_long_line_crossing_a_read_chunk_is_skipped_alike_by_the_recount(make):
    # The bytes of an over-long line after the recount's 1 MiB read boundary form a JSON line with a null:
    # the live follower rejects the whole line (too_long); a restart must not count that null.
    head = filler(20)
    pad = (1 << 20) - len(head) - 1
    long_line = b'"' + b"x" * pad + line(99, **{"actor/grad_norm": None})  # one line, no newline until its end
    live, restarted = counts_live_and_after_a_restart(make, head + long_line + filler(60), max_line_bytes=10_000)
    assert live == {} and restarted == live


@pytest.mark.parametrize("literal", [b"1" + b"0" * 310 + b".0", b"9" * 210 + b"e99", b"1" + b"0" * 400 + b"e-50",
                                     b"1e0309", b"-2E+308"])
def test_a_float_literal_that_overflows_to_inf_is_counted_alike_after_a_restart(make, literal):
    bad = b'{"step": 21, "data": {"actor/grad_norm": ' + literal + b"}}\n"
    live, restarted = counts_live_and_after_a_restart(make, filler(20) + bad + filler(60))
    assert live == {"verl_actor_grad_norm": 1.0} and restarted == live


@pytest.mark.parametrize("depth", [7, 8, 9, 10])
def test_a_nan_nested_deep_is_counted_alike_after_a_restart(make, depth):
    nested: dict = {"grad_norm": None}
    for level in range(depth - 1):
        nested = {f"k{level}": nested}
    deep = json.dumps({"step": 21, "data": nested}).encode() + b"\n"
    live, restarted = counts_live_and_after_a_restart(make, filler(20) + deep + filler(60))
    assert restarted == live
    assert sum(live.values()) == (1.0 if depth <= 9 else 0.0)  # deeper than 9 levels is not flattened


def test_a_line_in_another_unicode_encoding_is_rejected_alike_live_and_after_a_restart(make):
    # json.loads(bytes) guesses UTF-16 from the NUL bytes: live it parsed (and counted the null) while the
    # recount's search for b"null" could not see it. The log is UTF-8: such a line is malformed in both.
    utf16 = json.dumps({"step": 21, "data": {"actor/grad_norm": None}}).encode("utf-16-le") + b"\n"
    path, live, store, sm, _ = make()
    path.write_bytes(filler(20) + utf16 + filler(60))
    live.poll()
    assert store.nonfinite_counts() == {}
    assert sm.value("verl_exporter_lines_rejected_total", source="file", reason="malformed_json") == 1
    live_counts, restarted = counts_live_and_after_a_restart(make, filler(20) + utf16 + filler(60))
    assert restarted == live_counts


def test_a_lone_surrogate_in_a_key_does_not_break_the_scrape(make):
    # "\ud800" is valid JSON text, but no UTF-8 can encode the key it makes: every scrape failed on it.
    path, f, store, sm, _ = make()
    path.write_bytes(b'{"step": 1, "data": {"val-core/\\ud800/reward/mean@1": 0.5, "c\\udfff": null}}\n'
                     + line(2, **{"actor/lr": 2.0}))
    f.poll()
    store.render().encode("utf-8")  # raised UnicodeEncodeError
    assert store.step == 2 and store.value("verl_actor_learning_rate") == 2.0
    assert sum(store.nonfinite_counts().values()) == 1.0
    # escaped where it enters the store (as for the Monitor's keys), and counted
    assert sm.value("verl_exporter_label_values_escaped_total", reason="not_utf8") == 1


@pytest.mark.parametrize("bad,reason", [(b"\xff\xfe garbage", "malformed_json"), (b"not json", "malformed_json"),
                                        (b"[" * 3000, "too_deep"), (b"[1]", "not_an_object"),
                                        (b'{"step": 1}', "no_data")])
def test_a_bad_line_logs_one_clear_line_without_a_traceback(make, caplog, bad, reason):
    import logging

    path, f, store, sm, _ = make()
    path.write_bytes(bad + b"\n" + line(2, **{"actor/lr": 2.0}))
    with caplog.at_level(logging.WARNING, logger="verl_exporter"):
        f.poll()
    records = [r for r in caplog.records if "rejected a line" in r.getMessage()]
    assert len(records) == 1 and reason in records[0].getMessage()
    assert records[0].exc_info is None and "Traceback" not in caplog.text
    assert sm.value("verl_exporter_lines_rejected_total", source="file", reason=reason) == 1
    assert store.value("verl_actor_learning_rate") == 2.0


def test_a_rewrite_with_the_same_first_bytes_that_regrew_past_our_offset_is_detected(make):
    # A resumed run whose first lines read like the old run's (the same first 256 bytes and more), and which
    # wrote past our offset before our next poll: the size and the head alone cannot tell.
    common = b"".join(line(s, **{"actor/pg_loss": 0.1}) for s in range(1, 10))
    path, f, store, sm, _ = make()
    path.write_bytes(common + nan_run(30, {20}))
    f.poll()
    assert store.nonfinite_counts() == {"verl_actor_grad_norm": 1.0}
    with open(path, "wb") as fh:
        fh.write(common + b"".join(line(s, **{"actor/grad_norm": None, "actor/lr": float(s)}) for s in range(10, 80)))
    f.poll()
    assert sm.value("verl_exporter_source_resets_total", reason="truncated") == 1
    assert store.nonfinite_counts() == {"verl_actor_grad_norm": 70.0}  # the new file's, as a restart counts
    assert store.step == 79 and store.value("verl_actor_learning_rate") == 79.0


def test_a_file_system_error_logs_one_clear_line_without_a_traceback(make, caplog):
    import logging

    path, f, store, sm, _ = make()
    path.write_bytes(b"")
    blocked = path.parent / "not_a_dir"
    blocked.write_bytes(b"")
    f.path = str(blocked / "run.jsonl")  # stat: Not a directory
    with caplog.at_level(logging.WARNING, logger="verl_exporter"):
        f.poll()
    assert f.status().startswith("error: cannot stat")
    assert [r.exc_info for r in caplog.records] == [None] and "Traceback" not in caplog.text
    assert sm.value("verl_exporter_source_errors_total", component="verl_file") == 1
