"""The NaN count is a function of the followed file's bytes: a restarted sidecar's recount of the lines before
the tail it recovers gives the number the live follower had counted, whatever the file holds.

The alerts VerlNonFiniteGradNorm/Loss fire on any change of verl_training_nonfinite_values_total, so a restart
that counts differently pages someone at night. Here Hypothesis writes files of good lines, null/NaN/Infinity
values, float literals that overflow to Inf, deep nesting, over-long lines (some with a JSON line after the
read boundary), invalid UTF-8, other encodings, blank and partial lines, and truncations by a resumed run
(verl opens the file "wb"). A live follower reads the file as it grows, in random pieces and read sizes; at
random cut points a restarted follower (random tail size and read size) must show the same counts, and one
restarted follower goes on following the file to its end beside the live one.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from verl_exporter.exposition.selfmetrics import SelfMetrics
from verl_exporter.sidecar.sources.verl_file import VerlFileFollower, may_be_nonfinite
from verl_exporter.sidecar.store import TrainingStore
from verl_exporter.spec import load_spec

SPEC = load_spec()
MAX_LINE = 300
# Mapped and unmapped keys, a key standing in for another (entropy_loss), one too long to export.
KEYS = ["actor/grad_norm", "actor/pg_loss", "actor/entropy_loss", "custom/x", "val-core/gsm8k/reward/mean@1",
        "a/b", "k" * 260]
NONFINITE = [None, float("nan"), float("inf"), float("-inf")]

scalars = st.one_of(st.sampled_from(NONFINITE), st.floats(allow_nan=False), st.booleans(), st.text(max_size=3),
                    st.integers(min_value=-(10**30), max_value=10**30), st.just(10**400))
values = st.recursive(scalars, lambda inner: st.dictionaries(st.sampled_from(KEYS), inner, max_size=2), max_leaves=4)


@st.composite
def overflow_literal(draw) -> bytes:
    """A JSON float literal near or past a float's range, in every spelling JSON allows."""
    digits = draw(st.integers(min_value=1, max_value=420))
    mantissa = draw(st.sampled_from("19")) + draw(st.sampled_from("09")) * (digits - 1)
    frac = draw(st.sampled_from(["", ".0", ".5", "." + "9" * 30]))
    exp = ""
    if draw(st.booleans()) or not frac:
        e = draw(st.integers(min_value=-400, max_value=400))
        sign = "-" if e < 0 else draw(st.sampled_from(["", "+"]))
        exp = draw(st.sampled_from("eE")) + sign + "0" * draw(st.integers(0, 2)) + str(abs(e))
    return (draw(st.sampled_from(["", "-"])) + mantissa + frac + exp).encode()


def nested(depth: int, value) -> dict:
    out = {"grad_norm": value}
    for level in range(depth - 1):
        out = {f"n{level}": out}
    return out


def dumps(step, data) -> bytes:
    return json.dumps({"step": step, "data": data}).encode()  # json writes NaN and Infinity: both must count


steps = st.integers(min_value=0, max_value=10**6)
good = st.builds(dumps, steps, st.dictionaries(st.sampled_from(KEYS), values, max_size=4))
line = st.one_of(
    good,
    st.builds(lambda key, lit: b'{"step": 3, "data": {"' + key.encode() + b'": ' + lit + b"}}",
              st.sampled_from(KEYS[:4]), overflow_literal()),
    st.builds(lambda d, v: dumps(5, nested(d, v)), st.integers(1, 12), st.sampled_from([None, 1.5])),
    # Too long, and valid JSON with a null: live it is rejected, so a restart must not count it either.
    st.builds(lambda n: b'{"step": 7, ' + b" " * n + b'"data": {"actor/grad_norm": null}}',
              st.integers(MAX_LINE - 40, MAX_LINE + 200)),
    # Too long, and its bytes after any read boundary may form a JSON line.
    st.builds(lambda n, g: b'"' + b"x" * n + g, st.integers(0, MAX_LINE + 100), good),
    st.builds(lambda g, at: g[:at] + b"\xff" + g[at:], good, st.integers(0, 80)),          # invalid UTF-8
    st.builds(lambda g: g.decode().encode("utf-16-le"), good),                           # not UTF-8 at all
    st.just(b'{"step": 9, "data": {"c\\ud800": null, "actor/grad_norm\\udfff": NaN}}'),  # lone surrogates
    st.sampled_from([b"", b"  ", b"\r", b"null", b"[null]", b'{"data": null}', b"{" * 2000]),
    st.binary(max_size=40),
)
content = st.lists(line, max_size=14).map(lambda lines: b"".join(x.replace(b"\n", b" ") + b"\n" for x in lines))


def follower(path: Path, recover: int, chunk: int) -> tuple[VerlFileFollower, TrainingStore]:
    sm = SelfMetrics(SPEC)
    store = TrainingStore(SPEC, sm)
    return VerlFileFollower(str(path), store, sm, max_line_bytes=MAX_LINE, recover_bytes=recover,
                            chunk_bytes=chunk), store


chunks = st.one_of(st.integers(min_value=1, max_value=64), st.just(1 << 20))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(first=content, second=st.one_of(st.none(), content), data=st.data())
def test_a_restart_counts_the_nans_the_live_follower_counted(first, second, data):
    with tempfile.TemporaryDirectory() as tmp:
        path, snapshot = Path(tmp) / "run.jsonl", Path(tmp) / "snapshot.jsonl"
        live, live_store = follower(path, recover=1 << 30, chunk=data.draw(chunks, "live chunk"))
        # The file's life: the first run's bytes, then maybe a resumed run that truncates it ("wb") and writes
        # its own (heads that differ, as the resumed step's first line does).
        files = [b'{"run": 1}\n' + first] + ([b'{"run": 2}\n' + second] if second is not None else [])
        later: tuple[VerlFileFollower, TrainingStore] | None = None
        for content_ in files:
            cuts = sorted(data.draw(st.lists(st.integers(0, len(content_)), max_size=6), "cuts")) + [len(content_)]
            path.write_bytes(b"")
            written = 0
            for cut in cuts:
                with open(path, "ab") as fh:
                    fh.write(content_[written:cut])
                written = cut
                live.poll()
                expected = live_store.nonfinite_counts()
                if data.draw(st.booleans(), "restart here"):
                    shutil.copyfile(path, snapshot)
                    restarted, store = follower(snapshot, data.draw(st.integers(0, cut + 5), "tail bytes"),
                                                data.draw(chunks, "restart chunk"))
                    restarted.poll()
                    assert store.nonfinite_counts() == expected, f"restart at byte {cut} of {content_!r}"
                if later is None and data.draw(st.booleans(), "a restart that goes on following"):
                    tail = data.draw(st.integers(0, cut + 5), "its tail")
                    later = follower(path, tail, data.draw(chunks, "its chunk"))
                if later is not None:
                    later[0].poll()
                    assert later[1].nonfinite_counts() == expected


@settings(max_examples=500, deadline=None)
@given(overflow_literal())
def test_the_recount_prefilter_matches_every_literal_that_reads_as_inf(literal):
    text = b'{"step": 1, "data": {"actor/grad_norm": ' + literal + b"}}"
    value = json.loads(text)["data"]["actor/grad_norm"]
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        assert may_be_nonfinite(text)
