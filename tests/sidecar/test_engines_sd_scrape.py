"""A real Prometheus scrapes rollout-engine metric families through the generated scrape config.

No vLLM or SGLang server can run here (no GPU): two endpoints serve, with prometheus_client on loopback, the
families vLLM 0.33.0 and SGLang 0.5.23 define (names, types, label names and default buckets from
tests/data/engine_metrics.json, read from the packages' source), one engine per run. Each run's servers are
registered by the sidecar's --engines-from (sidecar/engines_sd.py), which writes the file_sd entry from the
prometheus.yml verl itself writes. The test checks the engine series arrive with the run label, that the engine
alerts' selections find them, and that every engine recording and panel has data.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import re
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from helpers import DATA, REPO, free_port, scaled
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder
from verl_exporter.exposition.selfmetrics import SelfMetrics
from verl_exporter.render import render_all
from verl_exporter.render.dashboards import ENGINES
from verl_exporter.render.promql import ENGINE_GROUP, all_recordings
from verl_exporter.sidecar.config import ConfigError, build_config
from verl_exporter.sidecar.engines_sd import EnginesSd
from verl_exporter.spec import load_spec

pytestmark = pytest.mark.integration
EXTRACT = json.loads((DATA / "engine_metrics.json").read_text())
CLASSES = {"gauge": Gauge, "counter": Counter, "histogram": Histogram}
LABEL_VALUES = {"model_name": "m", "engine": "0", "is_streaming": "false"}


def _registry(pkg: str) -> tuple[CollectorRegistry, dict]:
    """An engine's families as its source declares them. vLLM: labels [model_name, engine] (labelnames=labelnames),
    buckets a default family of vllm/v1/metrics/buckets.py (buckets=<family>_buckets). SGLang: its collector's
    labels.keys(), of which the extract resolves none, are given as model_name (the first key of both its
    collectors' label dicts), plus the names a definition adds; buckets its bucket_* defaults."""
    engine = EXTRACT[pkg]
    if pkg == "vllm":
        assert any('labelnames = ["model_name", "engine"]' in line for line in engine["labelnames_source"])
    registry, metrics = CollectorRegistry(), {}
    for name, m in engine["metrics"].items():
        text = "".join(m["lines"])
        labels = ["model_name", "engine"] if pkg == "vllm" else ["model_name", *re.findall(r'"(is_streaming)"', text)]
        kwargs = {}
        if m["type"] == "histogram":
            found = re.search(r"buckets=(\w+)", text).group(1)
            family = found.upper().removesuffix("_BUCKETS") + "_BUCKETS" if pkg == "vllm" else found
            kwargs["buckets"] = engine["buckets"]["families"][family]
        # prometheus_client adds _total to a counter itself, as in both engines
        metric = CLASSES[m["type"]](name, f"from {pkg}", labels, registry=registry, **kwargs)
        metrics[name] = metric.labels(*(LABEL_VALUES[label] for label in labels))
    return registry, metrics


def _serve(registry: CollectorRegistry) -> http.server.HTTPServer:
    """/metrics as vLLM serves it: prometheus_client picks the format from the scraper's Accept header, and its
    OpenMetrics output (Prometheus 2.x's first choice) spells vllm:x as vllm_x; the generated scrape job's
    metric_relabel_configs give the names their colons back."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
            body = encoder(registry)
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.end_headers()
            self.wfile.write(body)
            formats.append(content_type.split(";")[0])

        def log_message(self, *args):
            pass

    formats: list[str] = []
    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    server.formats = formats
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _query(port: int, expr: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=scaled(5)) as r:
        return json.load(r)["data"]["result"]


@contextlib.contextmanager
def _prometheus(tmp_path, config: dict) -> Iterator[tuple[subprocess.Popen, int]]:
    """A real Prometheus with this config on a free port, stopped at the end."""
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    prom = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        yield prom, port
    finally:
        prom.terminate()
        prom.wait(timeout=scaled(30))


def _first_answer(prom: subprocess.Popen, port: int, expr: str, timeout: float = 60) -> list[dict]:
    """The query's first non-empty answer within the timeout ([] if none), waiting for Prometheus to listen."""
    deadline, found = time.monotonic() + scaled(timeout), []
    while time.monotonic() < deadline and not found:
        time.sleep(1)
        try:
            found = _query(port, expr)
        except urllib.error.HTTPError:
            raise
        except OSError:  # not listening yet
            assert prom.poll() is None, prom.stderr.read().decode()[-2000:]
    return found


def _verl_prometheus_yml(port: int) -> str:
    """The prometheus.yml verl writes (verl/workers/rollout/utils.py update_prometheus_config)."""
    servers = {"job_name": "rollout", "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
    return yaml.safe_dump({"scrape_configs": [{"job_name": "ray", "file_sd_configs": [{"files": ["x.json"]}]},
                                              servers]})


def test_engines_from_counts_bad_input_keeps_the_last_entry_and_follows_changes(tmp_path):
    sm = SelfMetrics(load_spec())
    source, out = tmp_path / "prometheus.yml", tmp_path / "file_sd"
    sd = EnginesSd(str(source), str(out), "r/1", "sglang", sm.problem)
    errors = lambda: sm.value("verl_exporter_source_errors_total", component="engines_sd")  # noqa: E731
    assert (sd.update(), sd.update(), errors()) == (False, False, 1)  # missing: counted once, not per poll
    for bad in ("scrape_configs: [", "- a list\n", "scrape_configs: [{job_name: ray}]\n",
                "scrape_configs: [{job_name: rollout, static_configs: 3}]\n"):
        source.write_text(bad)
        assert sd.update() is False
    assert errors() == 5 and not out.exists()
    source.write_text(_verl_prometheus_yml(8000))
    assert sd.update() is True
    written = json.loads((out / "rollout-r_1.json").read_text())
    assert written == [{"targets": ["127.0.0.1:8000"], "labels": {"run": "r/1", "rollout_engine": "sglang"}}]
    source.write_text("scrape_configs: [")  # verl rewriting its file: the last good entry stays
    assert (sd.update(), json.loads((out / "rollout-r_1.json").read_text())) == (False, written)
    source.write_text(_verl_prometheus_yml(8001))
    assert sd.update() is True and "127.0.0.1:8001" in (out / "rollout-r_1.json").read_text()


def test_engines_from_needs_file_sd_and_run():
    with pytest.raises(ConfigError, match="--engines-from needs --file-sd"):
        build_config({}, {"engines_from": "prometheus.yml", "run": "r1"})
    config = build_config({}, {"engines_from": "p.yml", "run": "r1", "file_sd": "d", "rollout_engine": "sglang"})
    assert (config.engines_from, config.rollout_engine) == ("p.yml", "sglang")


def test_prometheus_scrapes_the_engines_verl_registers_with_the_run_label(tmp_path):
    if not shutil.which("prometheus"):
        pytest.skip("prometheus is not installed")
    served = {pkg: _registry(pkg) for pkg in EXTRACT}  # one run per engine: r1 vLLM, r2 SGLang
    served["vllm"][1]["vllm:kv_cache_usage_perc"].set(0.99)
    for pkg, (_, metrics) in served.items():
        metrics[f"{pkg}:time_to_first_token_seconds"].observe(0.3)
    servers = {pkg: _serve(registry) for pkg, (registry, _) in served.items()}
    ports = {pkg: server.server_address[1] for pkg, server in servers.items()}
    runs = {"vllm": "r1", "sglang": "r2"}
    sm = SelfMetrics(load_spec())
    # the sidecar's --engines-from: r1's verl file is garbage at first (verl writing it), then the real one
    for pkg in runs:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "prometheus.yml").write_text("scrape_configs: [" if pkg == "vllm" else
                                                       _verl_prometheus_yml(ports[pkg]))
    watchers = [EnginesSd(str(tmp_path / pkg / "prometheus.yml"), str(tmp_path / "file_sd"), run, pkg, sm.problem,
                          poll=0.2).start() for pkg, run in runs.items()]
    config = yaml.safe_load(render_all(load_spec(), REPO)["docker/prometheus/prometheus.yml"])
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    config["rule_files"] = [str(REPO / "rules/verl-recording.yaml"), str(REPO / "rules/verl-alerts.yaml")]
    config.pop("alerting")
    engines = next(j for j in config["scrape_configs"] if j["job_name"] == "rollout")
    engines["file_sd_configs"][0]["files"] = [str(tmp_path / "file_sd/rollout-*.json")]
    engines["file_sd_configs"][0]["refresh_interval"] = "1s"
    config["scrape_configs"] = [engines]
    try:
        with _prometheus(tmp_path, config) as (prom, port):
            _scrape_and_check(prom, port, sm, ports, runs, servers, tmp_path)
    finally:
        for w in watchers:
            w.stop()
        for server in servers.values():
            server.shutdown()


def _scrape_and_check(prom: subprocess.Popen, port: int, sm: SelfMetrics, ports: dict, runs: dict, servers: dict,
                      tmp_path: Path) -> None:
    """The engines registered through --engines-from, scraped with their run, every recording and panel with data."""
    assert sm.value("verl_exporter_source_errors_total", component="engines_sd") == 1
    (tmp_path / "vllm/prometheus.yml").write_text(_verl_prometheus_yml(ports["vllm"]))
    found = _first_answer(prom, port,
                          'max by (run, instance) (vllm:kv_cache_usage_perc or sglang:token_usage) > 0.95')
    assert [r["metric"] for r in found] == [{"run": "r1", "instance": f"127.0.0.1:{ports['vllm']}"}]
    deadline, up = time.monotonic() + scaled(30), []
    while time.monotonic() < deadline and len(up) < 2:
        time.sleep(1)
        up = _query(port, 'up{rollout_engine=~"vllm|sglang"}')
    assert sorted((r["metric"]["run"], r["metric"]["rollout_engine"], r["value"][1]) for r in up) == [
        ("r1", "vllm", "1"), ("r2", "sglang", "1")]
    for pkg, run in runs.items():
        buckets = _query(port, f'count({pkg}:time_to_first_token_seconds_bucket{{run="{run}"}})')
        family = "TIME_TO_FIRST_TOKEN_BUCKETS" if pkg == "vllm" else "bucket_time_to_first_token"
        assert int(buckets[0]["value"][1]) == len(EXTRACT[pkg]["buckets"]["families"][family]) + 1  # and +Inf
        assert "application/openmetrics-text" in servers[pkg].formats  # the escaping case was the one scraped
    assert _query(port, 'count({__name__=~"(vllm|sglang)_.+"})') == []  # no name left without its colon
    # every engine recording and every panel of the engines dashboard
    recorded = [r.record for r in all_recordings(load_spec()) if r.group == ENGINE_GROUP]
    dashboard = json.loads((REPO / f"dashboards/verl-{ENGINES}.json").read_text())
    variables = {f"${v['name']}": v["allValue"] for v in dashboard["templating"]["list"] if v["type"] == "query"}
    panels = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert any(":sglang_" in r for r in recorded) and any("sglang:" in p for p in panels)
    deadline, empty = time.monotonic() + scaled(30), ["?"]
    while time.monotonic() < deadline and empty:
        time.sleep(1)
        empty = [n for n in recorded if not _query(port, n)]
        for expr in panels:
            runnable = re.sub(r"\$\w+", lambda m: variables.get(m[0], "5s"), expr)  # $__rate_interval: 5s
            empty += [] if _query(port, runnable) else [expr]
    assert not empty, f"no data: {empty}"


def test_the_rl_insight_example_gives_rl_insights_engine_targets_the_labels_the_alerts_need(tmp_path):
    """docker/prometheus/rl-insight.yml: promtool accepts it, and its `vllm` job, fed a file_sd entry as
    RL-Insight writes them (labels rl_insight_job, project, experiment_name), gives a served vLLM endpoint the
    labels run and rollout_engine."""
    if not shutil.which("prometheus"):
        pytest.skip("prometheus is not installed")
    text = (REPO / "docker/prometheus/rl-insight.yml").read_text().replace("/etc/prometheus/", "")
    (tmp_path / "prometheus.yml").write_text(text)
    shutil.copytree(REPO / "rules", tmp_path / "rules")
    run = subprocess.run(["promtool", "check", "config", str(tmp_path / "prometheus.yml")],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    registry, metrics = _registry("vllm")
    metrics["vllm:kv_cache_usage_perc"].set(0.99)
    server = _serve(registry)
    target = f"127.0.0.1:{server.server_address[1]}"
    (tmp_path / "targets.yml").write_text(yaml.safe_dump([{"targets": [target], "labels": {
        "rl_insight_job": "vllm", "project": "p", "experiment_name": "exp1"}}]))
    config = yaml.safe_load(text)
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "vllm")
    # what `rl-insight server start` makes of it: the targets from its file_sd, job from rl_insight_job
    job.pop("static_configs")
    job["file_sd_configs"] = [{"files": [str(tmp_path / "targets.yml")], "refresh_interval": "1s"}]
    job["relabel_configs"] = [{"source_labels": ["rl_insight_job"], "target_label": "job"},
                              {"regex": "rl_insight_job", "action": "labeldrop"}, *job["relabel_configs"]]
    job.update(scrape_interval="1s", scrape_timeout="1s")
    config["scrape_configs"], config["rule_files"] = [job], []
    try:
        with _prometheus(tmp_path, config) as (prom, port):
            found = _first_answer(prom, port, 'max by (job, run, instance) (vllm:kv_cache_usage_perc) > 0.95')
            assert [r["metric"] for r in found] == [{"job": "vllm", "run": "exp1", "instance": target}]
            up = _query(port, 'up{rollout_engine=~"vllm|sglang"}')
            assert [(r["metric"]["run"], r["metric"]["project"], r["value"][1]) for r in up] == [("exp1", "p", "1")]
    finally:
        server.shutdown()
