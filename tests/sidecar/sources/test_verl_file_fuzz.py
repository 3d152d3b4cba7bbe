"""Property-based fuzzing of the verl file follower: random bytes, JSON shapes and file events.

Invariants after every poll: the follower never raises; what the sidecar serves parses with client_python's
parser; memory stays bounded; the latest valid line of the followed file is what is exported; every line
the follower has read is either parsed or counted as rejected.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
from helpers import scaled
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from verl_exporter.exposition.selfmetrics import SelfMetrics
from verl_exporter.sidecar.mapper import MAX_KEY_LENGTH
from verl_exporter.sidecar.sources.verl_file import VerlFileFollower
from verl_exporter.sidecar.store import TrainingStore
from verl_exporter.spec import load_spec

SPEC = load_spec()
MAX_LINE = 400
MAX_UNMAPPED = 5
KEYS = ["actor/grad_norm", "actor/pg_loss", "timing_s/gen", "val-core/gsm8k/reward/mean@1", "custom/x", "a.b",
        "a/b", "", "x" * (MAX_KEY_LENGTH + 1), "val-core/" + "d" * 200 + "/reward/mean@1"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(10**400), max_value=10**400),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=5))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.sampled_from(KEYS), inner, max_size=3), max_leaves=8)
steps = st.one_of(st.none(), st.integers(min_value=-5, max_value=10**30), st.floats(), st.text(max_size=3))


@st.composite
def valid_lines(draw):
    """A line the follower must export: actor/lr carries a value unique to this line (filled in later)."""
    data = draw(st.dictionaries(st.sampled_from(KEYS), values, max_size=4))
    return {"step": draw(st.integers(min_value=0, max_value=10**6)), "data": data}


segment = st.one_of(
    valid_lines(),
    st.binary(max_size=60),                                             # garbage, maybe with newlines
    st.builds(lambda v: json.dumps(v).encode() + b"\n", values),         # any JSON shape
    st.builds(lambda d, s: json.dumps({"step": s, "data": d}).encode() + b"\n",
              st.dictionaries(st.sampled_from(KEYS), values, max_size=3), steps),
    st.just(b"[" * 3000 + b"\n"),                                        # nested too deep
    st.just(b"z" * (MAX_LINE + 50)),                                     # too long, newline maybe later
    st.just(b"\n"),
)
event = st.one_of(
    st.tuples(st.just("append"), st.lists(segment, min_size=1, max_size=4)),
    st.tuples(st.just("truncate"), st.lists(segment, max_size=3)),
    st.tuples(st.just("rotate"), st.lists(segment, max_size=3)),
    st.just(("poll",)),
)


def classify(line: bytes) -> str:
    """What the follower must make of one complete line: blank, parsed or rejected."""
    reason = expected_reason(line)
    return "parsed" if reason is None else "blank" if reason == "blank" else "rejected"


class Model:
    """The files as written, and which complete lines of them the follower has had the chance to read."""

    def __init__(self, path: Path):
        self.path = path
        self.followed: bytes | None = None  # content of the file the follower holds (None: not opened yet)
        self.followed_is_current = True
        self.read_lines = 0                 # complete lines of `followed` already accounted for
        self.current = b""
        self.exists = False
        self.counts = {"blank": 0, "parsed": 0, "rejected": 0}
        self.resets = 0                     # a partial too-long line may be counted before a reset drops it
        self.latest_lr: float | None = None

    def account(self, content: bytes) -> None:
        lines = content.split(b"\n")[:-1]  # the last piece has no newline yet
        for raw in lines[self.read_lines:]:
            kind = classify(raw)
            self.counts[kind] += 1
            if kind == "parsed":
                lr = json.loads(raw)["data"].get("actor/lr")
                if isinstance(lr, float):
                    self.latest_lr = lr
        self.read_lines = len(lines)

    def poll(self) -> None:
        if self.followed is not None and not self.followed_is_current:
            self.account(self.followed)  # a rotated file is read to its end first
            self.read_lines, self.resets = 0, self.resets + 1
        if self.exists:
            self.followed, self.followed_is_current = self.current, True
            self.account(self.current)

    def early_rejects(self) -> int:
        """Too-long lines counted before their newline arrived (the newline may never come)."""
        partial = self.followed.rsplit(b"\n", 1)[-1] if self.followed is not None else b""
        return self.resets + (len(partial) > MAX_LINE)


def render(segments: list, counter: list[int]) -> bytes:
    out = []
    for seg in segments:
        if isinstance(seg, dict):
            counter[0] += 1
            seg = {**seg, "data": {**seg["data"], "actor/lr": counter[0] + 0.5}}
            seg = json.dumps(seg).encode() + b"\n"
        out.append(seg)
    return b"".join(out)


def served_text(store: TrainingStore, sm: SelfMetrics) -> str:
    registry = CollectorRegistry()
    registry.register(sm)
    return store.render() + generate_latest(registry).decode()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(event, min_size=1, max_size=12))
def test_the_follower_survives_any_stream_of_bytes_and_file_events(events):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.jsonl"
        sm = SelfMetrics(SPEC)
        store = TrainingStore(SPEC, sm, max_unmapped=MAX_UNMAPPED)
        follower = VerlFileFollower(str(path), store, sm, max_line_bytes=MAX_LINE)
        model, counter, rotations = Model(path), [0], 0
        for ev in [*events, ("poll",)]:
            if ev[0] != "poll":
                model.exists = True
            if ev[0] == "append":
                data = render(ev[1], counter)
                with open(path, "ab") as fh:
                    fh.write(data)
                model.current += data
                if model.followed_is_current and model.followed is not None:
                    model.followed = model.current
            elif ev[0] == "truncate":
                data = b'{"truncated": %d}\n' % counter[0] + render(ev[1], counter)  # a head of its own
                counter[0] += 1
                path.write_bytes(data)
                if model.followed_is_current and model.followed is not None:
                    model.read_lines, model.resets = 0, model.resets + 1
                    model.followed = data
                model.current = data
            elif ev[0] == "rotate":
                if path.exists():
                    rotations += 1
                    os.rename(path, f"{path}.{rotations}")
                    model.followed_is_current = model.followed is None
                data = render(ev[1], counter)
                path.write_bytes(data)
                model.current = data
                if model.followed is None:
                    model.followed_is_current = True
            else:
                follower.poll()  # never raises
                model.poll()
                check(follower, store, sm, model)


def check(follower: VerlFileFollower, store: TrainingStore, sm: SelfMetrics, model: Model) -> None:
    text = served_text(store, sm)
    families = list(text_string_to_metric_families(text))  # valid exposition
    assert families
    assert follower._lines.pending <= MAX_LINE
    assert len(store._unmapped) <= MAX_UNMAPPED and len(store._nonfinite) <= 256
    assert follower.status() in ("ok", "waiting")
    assert sm.value("verl_exporter_source_errors_total", component="verl_file") == 0
    if model.latest_lr is not None:
        assert store.value("verl_actor_learning_rate") == model.latest_lr
    parsed = sm.value("verl_exporter_lines_parsed_total", source="file")
    rejected = sum(v for k, v in sm.snapshot()["verl_exporter_lines_rejected_total"].items())
    assert parsed == model.counts["parsed"]
    assert model.counts["rejected"] <= rejected <= model.counts["rejected"] + model.early_rejects()


@pytest.mark.integration
def test_promtool_accepts_what_is_served_after_every_kind_of_bad_input(tmp_path):
    import subprocess

    from conftest import require_tool

    promtool = require_tool("promtool")
    sm = SelfMetrics(SPEC, {"run": "r", "rank": "0"})
    store = TrainingStore(SPEC, sm, {"run": "r", "rank": "0"}, max_unmapped=MAX_UNMAPPED)
    path = tmp_path / "run.jsonl"
    follower = VerlFileFollower(str(path), store, sm, max_line_bytes=MAX_LINE)
    bad = [b"[" * 3000, b"z" * (MAX_LINE + 5), b"\xff\xfe", b'{"step": 1e308, "data": {"a": 1' + b"0" * 400 + b"}}",
           b'{"step": -5, "data": {"odd\\n\\"key": null, "' + b"k" * 300 + b'": 1}}',
           json.dumps({"step": 2, "data": {key: None for key in KEYS}}).encode()]
    path.write_bytes(b"\n".join(bad) + b"\n")
    follower.poll()
    text = served_text(store, sm)
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True,
                            timeout=scaled(60))
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------- arbitrary lines (issue 22, item 8)
def expected_reason(raw: bytes) -> str | None:
    """What the follower must make of one complete line, written from the log's contract (UTF-8 JSON objects
    with a "data" object, at most MAX_LINE bytes): None when it is a step, "blank", or the rejection reason."""
    if not raw.strip():
        return "blank"
    if len(raw) > MAX_LINE:
        return "too_long"
    try:
        obj = json.loads(raw.decode("utf-8-sig"))
    except RecursionError:
        return "too_deep"
    except ValueError:  # also UnicodeDecodeError
        return "malformed_json"
    if not isinstance(obj, dict):
        return "not_an_object"
    return None if isinstance(obj.get("data"), dict) else "no_data"


any_line = st.one_of(
    st.binary(max_size=80),
    st.text(max_size=40).map(str.encode),
    st.builds(lambda v: json.dumps(v).encode(), values),
    st.builds(lambda d, s: json.dumps({"step": s, "data": d}).encode(),
              st.dictionaries(st.sampled_from(KEYS), values, max_size=3), steps),
    st.builds(lambda g, at, b: g[:at] + b + g[at:], st.just(b'{"step": 1, "data": {"k": 1}}'), st.integers(0, 30),
              st.binary(min_size=1, max_size=3)),
    st.sampled_from([b"[" * 3000, b'{"data": {"a": ' + b"[" * 2000 + b"]" * 2000 + b"}}", b"\xef\xbb\xbf{}",
                     b'{"data": {"a": 1' + b"0" * 5000 + b"}}", b'{"data": {"\\ud800": 1, "v\\udc00x": null}}',
                     b'{"step": 1, "data": {"actor/grad_norm": 1' + b"0" * 400 + b"}}", b"z" * (MAX_LINE + 1)]),
).map(lambda b: b.replace(b"\n", b" "))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.booleans(), any_line), max_size=12), st.integers(min_value=1, max_value=4096))
def test_arbitrary_lines_never_crash_the_follower_and_cost_only_themselves(lines, chunk):
    import logging

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.jsonl"
        sm = SelfMetrics(SPEC)
        store = TrainingStore(SPEC, sm, max_unmapped=MAX_UNMAPPED)
        follower = VerlFileFollower(str(path), store, sm, max_line_bytes=MAX_LINE, chunk_bytes=chunk)
        ingested: list = []
        ingest = store.ingest
        store.ingest = lambda step, data, seen_at: (ingested.append(step), ingest(step, data, seen_at))
        # Each arbitrary line between two good ones, whose steps are unique: 10**9 + i.
        body, expected, good_steps = [], {}, []
        for i, (good_first, raw) in enumerate(lines):
            good = b'{"step": %d, "data": {"actor/lr": %d.5}}' % (10**9 + i, i)
            for piece in ([good, raw] if good_first else [raw, good]):
                body.append(piece + b"\n")
                reason = expected_reason(piece)
                expected[reason] = expected.get(reason, 0) + 1
            good_steps.append(10**9 + i)
        path.write_bytes(b"".join(body))
        records: list[logging.LogRecord] = []
        handler = logging.Handler()
        handler.emit = records.append
        logging.getLogger("verl_exporter").addHandler(handler)
        try:
            follower.poll()  # never raises
        finally:
            logging.getLogger("verl_exporter").removeHandler(handler)
        assert follower.status() == "ok"
        assert sm.value("verl_exporter_source_errors_total", component="verl_file") == 0
        assert not [r for r in records if r.exc_info], "ordinary bad input logged a traceback"
        rejected = {reason: v for (_, reason), v in sm.snapshot()["verl_exporter_lines_rejected_total"].items() if v}
        assert rejected == {k: v for k, v in expected.items() if k not in (None, "blank")}
        assert sm.value("verl_exporter_lines_parsed_total", source="file") == expected.get(None, 0)
        assert [s for s in ingested if s in good_steps] == good_steps  # every good line around them, in order
        if lines:
            assert store.value("verl_actor_learning_rate") == len(lines) - 1 + 0.5
        text = served_text(store, sm)
        text.encode("utf-8")  # what the scrape sends
        assert list(text_string_to_metric_families(text))
