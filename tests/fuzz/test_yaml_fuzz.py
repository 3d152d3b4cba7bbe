"""Fuzzing the one YAML loader and the loaders built on it (overrides, relay config, sidecar config, spec):
arbitrary text and YAML-ish structures (anchors, aliases, tags, merge keys, deep nesting, odd scalars) either
load or raise the loader's own error naming the file; nothing else escapes and nothing hangs."""

from __future__ import annotations

import contextlib
import signal
import tempfile
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from verl_exporter.core.models import FileError, parse_yaml
from verl_exporter.relay.config import load_config
from verl_exporter.sidecar.config import read_config_file
from verl_exporter.spec import load_spec
from verl_exporter.spec.overrides import load_overrides

LOADERS = [
    load_overrides,
    lambda p: load_config(p, environ={}, secrets_needed=False),
    read_config_file,
    load_spec,
]

# Pieces of YAML that reach the parser's, composer's and constructor's corners.
FRAGMENTS = [
    "a", "b", "version", "alerts", "targets", "routes", "listen", "run", "1", "-1", "0x1f", "0o7", "1e3", "3e9",
    ".inf", ".nan", "~", "null", "true", "no", "2001-12-14", "2001-13-45", "12:30:00", "'q'", '"\\x41"', '"\\u12"',
    ": ", ":", "- ", "-", "? ", "[", "]", "{", "}", ",", "&x ", "&y ", "*x", "*y", "*z", "<<: ", "!!str ", "!!int ",
    "!!float ", "!!binary ", "!!timestamp ", "!!set ", "!!omap ", "!!python/object:os.system ", "!custom ", "|",
    ">", "#c", "---", "...", "%YAML 1.1", "\n", "\n  ", "\n    ", "\t", " ", "1" * 60, "\x00", "\ufeff", "é",
]

yamlish = st.lists(st.sampled_from(FRAGMENTS), max_size=60).map("".join)
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20))
documents = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=10), inner, max_size=5)), max_leaves=40)


@contextlib.contextmanager
def bounded(seconds: int = 20):
    """A hang guard, not a timing goal: an example that runs this long has hung."""
    def hung(*_):
        raise AssertionError(f"the loader ran for more than {seconds} s: it hangs")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def check_text(text: str) -> None:
    with bounded():
        try:
            parse_yaml(text, "fuzz.yaml")
        except FileError as e:
            assert e.problems and all(p.startswith("fuzz.yaml") for p in e.problems), e.problems
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.yaml"
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        for load in LOADERS:
            with bounded():
                try:
                    load(path)
                except FileError as e:
                    assert str(path) in str(e), str(e)


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.text(max_size=300))
def test_arbitrary_text(text):
    check_text(text)


@FUZZ
@given(yamlish)
def test_yaml_fragments(text):
    check_text(text)


@FUZZ
@given(documents, st.sampled_from(["version: 1\n", "", "targets: {}\nroutes: []\n"]))
def test_documents_of_any_shape(doc, head):
    check_text(head + yaml.safe_dump({"x": doc}))
    check_text(yaml.safe_dump(doc))


@FUZZ
@given(st.integers(1, 12), st.integers(1, 12))
def test_alias_bombs_of_any_size_are_refused(levels, width):
    lines = ["version: 1", "l0: &l0 [" + ", ".join(['"lol"'] * width) + "]"]
    lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]" for i in range(1, levels)]
    text = "\n".join(lines) + "\n"
    check_text(text)
    if levels > 1:
        with bounded():
            try:
                parse_yaml(text, "fuzz.yaml")
                raise AssertionError("an alias bomb was accepted")
            except FileError as e:
                assert e.problems[0].startswith("fuzz.yaml:3: alias *l0"), e.problems


@FUZZ
@given(st.integers(1, 200), st.sampled_from(["[", "{a: ", "- ", "k:\n "]))
def test_deep_nesting(depth, opener):
    closer = {"[": "]", "{a: ": "}"}.get(opener, "")
    check_text(opener * depth + "1" + closer * depth)
