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

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from verl_exporter.core.selfmetrics import SelfMetrics
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
    if not line.strip():
        return "blank"
    if len(line) > MAX_LINE:
        return "rejected"
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError):
        return "rejected"
    return "parsed" if isinstance(obj, dict) and isinstance(obj.get("data"), dict) else "rejected"


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
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
