"""The rollout engines' series the spec's alerts name are the ones vLLM and SGLang define.

tests/data/engine_metrics.json holds each definition's exact source lines from the pinned packages
(tests/engine_metrics.py PINNED: vllm 0.33.0, sglang 0.5.23); the unit tests check the spec against it, and the
integration test re-derives it from the real wheels (downloaded with pip, skipped without network).
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import textwrap
import zipfile

import pytest
from engine_metrics import PINNED, derive, extract
from helpers import DATA, scaled
from verl_exporter.spec import SpecError, load_spec, parse_spec

EXTRACT = DATA / "engine_metrics.json"
# an engine series named in PromQL: vllm:... or sglang:... (colons are legal in Prometheus metric names)
ENGINE_SERIES_RE = re.compile(r"\b((?:vllm|sglang):[a-z0-9_]+)")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def _exposed() -> dict[str, str]:
    """Every series name the extracted definitions put on the wire, with its metric type."""
    out = {}
    for pkg in json.loads(EXTRACT.read_text()).values():
        for m in pkg["metrics"].values():
            names = [m["exposed"] + s for s in HISTOGRAM_SUFFIXES] if m["type"] == "histogram" else [m["exposed"]]
            out.update(dict.fromkeys(names, m["type"]))
    return out


def test_the_extract_is_of_the_pinned_versions_and_complete():
    data = json.loads(EXTRACT.read_text())
    assert {p: (d["version"], d["path"], tuple(sorted(d["metrics"]))) for p, d in data.items()} == {
        p: (v, path, tuple(sorted(names))) for p, (v, path, names) in PINNED.items()}


def _declared_labels(pkg: dict, m: dict) -> list[str]:
    """The label names a definition gives: vLLM's shared list (labelnames=labelnames), or the names written in
    its labelnames= (SGLang's are added to its collector's labels.keys(), which the extract does not resolve)."""
    call = ast.parse(textwrap.dedent("\n".join(m["lines"]))).body[0].value
    given = next(k.value for k in call.keywords if k.arg == "labelnames")
    if isinstance(given, ast.Name):
        shared = pkg["labelnames_source"][0].split("=", 1)[1]
        return ast.literal_eval(shared.strip())
    return [n.value for n in ast.walk(given) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def test_each_engine_entry_is_named_typed_and_labelled_as_its_engine_defines_it():
    data = json.loads(EXTRACT.read_text())
    defined = {m["exposed"]: (pkg, m["type"], _declared_labels(data[pkg], m))
               for pkg, d in data.items() for m in d["metrics"].values()}
    declared = {m.name: (m.scraped_from, m.type, list(m.labels)) for m in load_spec().metrics if m.scraped_from}
    assert declared == defined


@pytest.mark.parametrize(("entry", "message"), [
    ({"name": "vllm:x", "type": "gauge", "collector": "gpu"}, "another engine's name needs scraped_from"),
    ({"name": "verl_x_seconds", "type": "histogram", "collector": "gpu"}, "got 'histogram'"),
    ({"name": "sglang:x", "type": "gauge", "scraped_from": "vllm"}, "the name must start with vllm:"),
])
def test_engine_names_and_histograms_need_scraped_from(entry, message):
    with pytest.raises(SpecError, match=message):
        parse_spec({"version": 1, "metrics": [{"help": "h.", "layer": "compute", **entry}]})


def test_every_engine_series_the_alerts_name_is_defined_by_its_engine():
    exposed = _exposed()
    spec = load_spec()
    exprs = {a.alert: a.promql(spec.rules.selector) for a in spec.alerts()}  # every kind's PromQL as rendered
    named = {a: set(ENGINE_SERIES_RE.findall(e)) for a, e in exprs.items() if ENGINE_SERIES_RE.search(e)}
    assert len(named) >= 6, named  # the engine alerts of 55-rollout-engines.yaml but EngineDown (on up)
    unknown = {a: sorted(n - set(exposed)) for a, n in named.items() if n - set(exposed)}
    assert not unknown, f"series no pinned engine defines: {unknown}"
    # rate() of counters and histogram buckets only; a gauge is never rated
    for alert, expr in exprs.items():
        for series in re.findall(r"rate\(((?:vllm|sglang):[a-z0-9_]+)", expr):
            assert exposed[series] in ("counter", "histogram"), (alert, series)


def test_extract_reads_names_types_and_counter_suffix():
    src = ('from prometheus_client import Counter, Histogram\n'
           'c = self._counter_cls(name="vllm:x", documentation="d", labelnames=["engine"])\n'
           'h = Histogram(name="sglang:y_seconds", documentation="d", buckets=[1, 2])\n')
    got = extract(src, ("vllm:x", "sglang:y_seconds"))
    assert {n: (m["type"], m["exposed"], m["line"]) for n, m in got.items()} == {
        "vllm:x": ("counter", "vllm:x_total", 2), "sglang:y_seconds": ("histogram", "sglang:y_seconds", 3)}


@pytest.mark.integration
def test_the_extract_matches_the_real_wheels(tmp_path):
    for pkg, (version, *_rest) in PINNED.items():
        got = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                              f"{pkg}=={version}", "-d", str(tmp_path)], capture_output=True, timeout=scaled(900))
        if got.returncode:
            pytest.skip(f"cannot download {pkg}=={version}: {got.stderr.decode()[-200:]}")
    wheels = {w.name.split("-")[0]: zipfile.ZipFile(w) for w in tmp_path.glob("*.whl")}
    assert derive(lambda pkg, path: wheels[pkg].read(path).decode()) == json.loads(EXTRACT.read_text())
