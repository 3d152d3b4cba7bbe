"""A real Prometheus scrapes rollout-engine metric families through the generated scrape config.

No vLLM or SGLang server can run here (no GPU): the endpoint serves, with prometheus_client on loopback, the
families vLLM 0.33.0 defines (names, types, label names and default buckets from tests/data/engine_metrics.json,
read from the package source), registered through the file_sd entry engine_file_sd writes from the prometheus.yml
verl itself writes. The test checks the engine series arrive with the run label and that the engine alerts'
selections find them.
"""

from __future__ import annotations

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
from pathlib import Path

import pytest
import yaml
from helpers import free_port
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder
from verl_exporter.render import render_all
from verl_exporter.render.dashboards import ENGINES
from verl_exporter.render.prometheus import engine_file_sd
from verl_exporter.render.promql import ENGINE_GROUP, all_recordings
from verl_exporter.spec import load_spec

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[1]
EXTRACT = json.loads((REPO / "tests/data/engine_metrics.json").read_text())
CLASSES = {"gauge": Gauge, "counter": Counter, "histogram": Histogram}


def _vllm_registry() -> tuple[CollectorRegistry, dict]:
    """vLLM's families as its loggers.py declares them: labels [model_name, engine] (labelnames=labelnames)."""
    vllm = EXTRACT["vllm"]
    assert any('labelnames = ["model_name", "engine"]' in line for line in vllm["labelnames_source"])
    registry, metrics = CollectorRegistry(), {}
    for name, m in vllm["metrics"].items():
        kwargs = {}
        if m["type"] == "histogram":  # buckets=<family>_buckets, a default family of vllm/v1/metrics/buckets.py
            family = re.search(r"buckets=(\w+)_buckets", "".join(m["lines"])).group(1).upper() + "_BUCKETS"
            kwargs["buckets"] = vllm["buckets"]["families"][family]
        # prometheus_client adds _total to a counter itself, as in vLLM
        metrics[name] = CLASSES[m["type"]](name, "from vllm", ["model_name", "engine"], registry=registry,
                                           **kwargs).labels("m", "0")
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
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.load(r)["data"]["result"]


def test_prometheus_scrapes_the_engines_verl_registers_with_the_run_label(tmp_path):
    if not shutil.which("prometheus"):
        pytest.skip("prometheus is not installed")
    registry, metrics = _vllm_registry()
    metrics["vllm:kv_cache_usage_perc"].set(0.99)
    metrics["vllm:time_to_first_token_seconds"].observe(0.3)
    server = _serve(registry)
    engine_port = server.server_address[1]
    # the prometheus.yml verl writes (verl/workers/rollout/utils.py update_prometheus_config)
    servers = {"job_name": "rollout", "static_configs": [{"targets": [f"127.0.0.1:{engine_port}"]}]}
    verl_written = {"scrape_configs": [{"job_name": "ray", "file_sd_configs": [{"files": ["x.json"]}]}, servers]}
    (tmp_path / "file_sd").mkdir()
    (tmp_path / "file_sd/rollout-r1.json").write_text(json.dumps(engine_file_sd(verl_written, "r1", "vllm")))
    config = yaml.safe_load(render_all(load_spec(), REPO)["docker/prometheus/prometheus.yml"])
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    config["rule_files"] = [str(REPO / "rules/verl-recording.yaml"), str(REPO / "rules/verl-alerts.yaml")]
    config.pop("alerting")
    engines = next(j for j in config["scrape_configs"] if j["job_name"] == "rollout")
    engines["file_sd_configs"][0]["files"] = [str(tmp_path / "file_sd/rollout-*.json")]
    engines["file_sd_configs"][0]["refresh_interval"] = "1s"
    config["scrape_configs"] = [engines]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    prom = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline, found = time.monotonic() + 60, []
        while time.monotonic() < deadline and not found:
            time.sleep(1)
            try:
                found = _query(port, 'max by (run, instance) (vllm:kv_cache_usage_perc or sglang:token_usage) > 0.95')
            except urllib.error.HTTPError:
                raise
            except OSError:  # not listening yet
                assert prom.poll() is None, prom.stderr.read().decode()[-2000:]
        assert [r["metric"] for r in found] == [{"run": "r1", "instance": f"127.0.0.1:{engine_port}"}]
        up = _query(port, 'up{rollout_engine=~"vllm|sglang"}')
        assert [(r["metric"]["run"], r["value"][1]) for r in up] == [("r1", "1")]
        buckets = _query(port, 'count(vllm:time_to_first_token_seconds_bucket{run="r1"})')
        ttft = EXTRACT["vllm"]["buckets"]["families"]["TIME_TO_FIRST_TOKEN_BUCKETS"]
        assert int(buckets[0]["value"][1]) == len(ttft) + 1  # and +Inf
        assert "application/openmetrics-text" in server.formats  # the escaping case was the one scraped
        assert _query(port, 'count({__name__=~"vllm_.+"})') == []  # no name left without its colon
        # vLLM's recordings and the engines dashboard's vLLM panels (SGLang's: no SGLang families are served)
        recorded = [r.record for r in all_recordings(load_spec()) if r.group == ENGINE_GROUP and ":vllm_" in r.record]
        dashboard = json.loads((REPO / f"dashboards/verl-{ENGINES}.json").read_text())
        variables = {f"${v['name']}": v["allValue"] for v in dashboard["templating"]["list"] if v["type"] == "query"}
        panels = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", []) if "vllm:" in t["expr"]]
        assert recorded and panels
        deadline, empty = time.monotonic() + 30, ["?"]
        while time.monotonic() < deadline and empty:
            time.sleep(1)
            empty = [n for n in recorded if not _query(port, n)]
            for expr in panels:
                runnable = re.sub(r"\$\w+", lambda m: variables.get(m[0], "5s"), expr)  # $__rate_interval: 5s
                empty += [] if _query(port, runnable) else [expr]
        assert not empty, f"no data: {empty}"
    finally:
        prom.terminate()
        prom.wait(timeout=30)
        server.shutdown()
