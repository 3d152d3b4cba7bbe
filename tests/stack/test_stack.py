"""The whole pack, live and real: a sidecar follows a replayed run (with an injected NaN), a real Prometheus
scrapes it with the generated rules, a real Alertmanager with the generated config posts to the relay, the
relay delivers to a DingTalk stand-in and asks the sidecar's control endpoint for a checkpoint, and the
training side's Monitor sees the request.

Also the generator's live check: every dashboard panel's query parses and returns data, and every
recording rule yields data.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.parse
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from conftest import (
    REPO,
    Proc,
    compressed_rule_files,
    free_port,
    http_get,
    post_json,
    ready,
    require_tool,
    wait_for,
)
from fabric_tree import healthy_node
from helpers import suite_module
from robots import FakeDingTalk
from verl_exporter import Monitor
from verl_exporter.checkpoint.manifest import write_manifest
from verl_exporter.relay.app import Relay
from verl_exporter.relay.config import parse_config
from verl_exporter.render.dashboards import ENGINES
from verl_exporter.render.promql import ENGINE_GROUP, all_recordings
from verl_exporter.spec import load_spec
from verl_exporter.tools.demo import demo_lines

pytestmark = pytest.mark.integration  # starts servers or programs

CONTROL_TOKEN = "stack-control-token"
DT_TOKEN, DT_SECRET = "dt-access-token", "SECstacksecret"
NAN_ALERT = "VerlNonFiniteGradNorm"


def with_every_verl_key(lines: list[bytes]) -> list[bytes]:
    """The demo's lines, two of them also carrying every key verl 0.9.1 can log that the demo run lacks.

    The demo is a plain PPO run; verl's optional families (rollout correction, fully async, distillation,
    MoE, ...) feed panels too, and every panel must show data. Keys come from the scan of the installed verl.
    """
    keys = sorted(suite_module("verl/test_verl_keys.py").verl_keys()[0])
    out = list(lines)
    for i, value in ((-40, 0.25), (-10, 0.5)):  # two points, so rate()/deriv() panels have data
        doc = json.loads(out[i])
        doc["data"].update({k: value for k in keys if k not in doc["data"]})
        out[i] = json.dumps(doc).encode() + b"\n"
    return out


def checkpoint_dir(root: Path) -> Path:
    """verl's layout: global_step_N/{actor,critic}/..., data.pt, and the tracker file; with a manifest."""
    ckpt = root / "ckpt"
    step = ckpt / "global_step_50"
    (step / "actor").mkdir(parents=True)
    (step / "actor" / "model_world_size_1_rank_0.pt").write_bytes(os.urandom(4096))
    (step / "data.pt").write_bytes(os.urandom(512))
    (ckpt / "latest_checkpointed_iteration.txt").write_text("50")
    write_manifest(step)
    return ckpt


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    prometheus = require_tool("prometheus")
    alertmanager = require_tool("prometheus-alertmanager")
    root = tmp_path_factory.mktemp("stack")
    procs: list[Proc] = []
    robot = FakeDingTalk(DT_TOKEN, DT_SECRET).start()
    relay = monitor = None
    try:
        # -- the sidecar, following a replayed run up to just after the NaN steps, plus one garbage line
        log = root / "verl.jsonl"
        lines = with_every_verl_key(demo_lines()[:240])
        log.write_bytes(b"".join(lines[:-2]) + b"this line is garbage\n")
        ckpt = checkpoint_dir(root)
        sport = free_port()
        sidecar_url = f"http://127.0.0.1:{sport}"
        procs.append(Proc("sidecar", [
            sys.executable, str(REPO / "tests/fake_gpu_sidecar.py"), "--listen", f"127.0.0.1:{sport}",
            "--verl-log", str(log), "--checkpoint-dir", str(ckpt), "--checkpoint-verify", "--run", "demo",
            "--rank", "0", "--gpus", "all", "--interval", "0.5", "--slow-interval", "2",
            "--trainer-pid", str(os.getpid()), "--control-token-env", "VERL_CTL",
            "--forensics-dir", str(root / "forensics"), "--no-forensics-native",
            "--state-dir", str(root / "state"), "--planned-steps", "300",
            "--sysfs-root", str(healthy_node(root / "sys"))], env={"VERL_CTL": CONTROL_TOKEN}))
        wait_for(lambda: ready(sidecar_url + "/healthz", procs[-1]), timeout=30)
        for line in lines[-2:]:  # two steps seen live, a second apart: the step time the ETA needs
            time.sleep(1.1)
            with log.open("ab") as f:
                f.write(line)
        # one stack capture of this process (real py-spy), so the dashboards' forensics panel has its series
        status, answer = post_json(sidecar_url + "/control/forensics", b"{}",
                                   {"Authorization": f"Bearer {CONTROL_TOKEN}"}, timeout=60)
        assert status == 200 and answer.get("applied"), answer
        # -- the training side: a Monitor reading the control file the sidecar writes, started before any alert
        monitor = Monitor(sidecar_file=str(root / "monitor.jsonl"),
                          control_file=str(ckpt / ".verl-exporter-control.json"))

        # -- the relay, delivering to the DingTalk stand-in, with the automated checkpoint on NaN
        relay = Relay(parse_config({
            "listen": "127.0.0.1:0",
            "targets": {"dt": {"type": "dingtalk", "url": robot.url, "token_env": "DT_TOKEN",
                               "secret_env": "DT_SECRET"}},
            "routes": [{"targets": ["dt"]}],
            "actions": [{"matchers": {"alertname": NAN_ALERT}, "action": "checkpoint", "url": sidecar_url,
                         "token_env": "VERL_CTL"}],
        }, environ={"DT_TOKEN": DT_TOKEN, "DT_SECRET": DT_SECRET, "VERL_CTL": CONTROL_TOKEN})).start()

        # -- a real Alertmanager with the generated config, pointed at the relay, notifying within a second
        am = yaml.safe_load((REPO / "alertmanager/alertmanager.yml").read_text())
        am["route"]["group_wait"] = am["route"]["group_interval"] = "1s"
        for receiver in am["receivers"]:
            for hook in receiver.get("webhook_configs", []):
                hook["url"] = relay.url + urlsplit(hook["url"]).path
        (root / "am.yml").write_text(yaml.safe_dump(am))
        aport = free_port()
        procs.append(Proc("alertmanager", [
            alertmanager, f"--config.file={root / 'am.yml'}", f"--storage.path={root / 'am'}",
            f"--web.listen-address=127.0.0.1:{aport}", "--cluster.listen-address="]))
        wait_for(lambda: ready(f"http://127.0.0.1:{aport}/-/ready", procs[-1]), timeout=30)

        # -- a real Prometheus with the generated rules, scraping the sidecar every second
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(p) for p in compressed_rule_files(root)],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{aport}"]}]}]},
            "scrape_configs": [{"job_name": "verl", "static_configs": [{"targets": [f"127.0.0.1:{sport}"]}]}],
        }
        (root / "prometheus.yml").write_text(yaml.safe_dump(config))
        pport = free_port()
        api = f"http://127.0.0.1:{pport}"
        procs.append(Proc("prometheus", [
            prometheus, f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={root / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{pport}"]))
        wait_for(lambda: ready(api + "/-/ready", procs[-1]), timeout=30)
        # enough scrapes for rates, and the collectors' second samples (disk ratios, checkpoint verify)
        wait_for(lambda: len(query(api, "verl_training_step")) == 1, timeout=30)
        wait_for(lambda: query(api, "count_over_time(verl_exporter_build_info[1m]) >= 8"), timeout=30)
        yield {"api": api, "sidecar": sidecar_url, "robot": robot, "relay": relay, "ckpt": ckpt, "root": root,
               "monitor": monitor}
    finally:
        if monitor is not None:
            monitor.close()
        for p in reversed(procs):
            p.stop()
        if relay is not None:
            relay.stop(drain_seconds=1)
        robot.stop()


def query(api: str, expr: str) -> list:
    url = api + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    status, _, body = http_get(url, timeout=10)
    doc = json.loads(body)
    if status != 200 or doc.get("status") != "success":
        raise AssertionError(f"query failed ({status}): {expr}: {doc.get('error')}")
    return doc["data"]["result"]


def dashboard_queries():
    """(where, expr, the dashboard's variables) of every panel query; the rollout engines' dashboard is
    sidecar/test_engines_sd_scrape.py's (this stack runs no engine)."""
    for path in sorted(p for p in (REPO / "dashboards").glob("*.json") if p.name != f"verl-{ENGINES}.json"):
        doc = json.loads(path.read_text())
        for panel in doc["panels"]:
            for t in panel.get("targets", []):
                yield f"{path.name}: {panel['title']} [{t['refId']}]", t["expr"], doc["templating"]["list"]


def as_runnable(expr: str, variables: list[dict]) -> str:
    """Grafana's variables as an 'All' selection, and a rate interval that fits a test's minute of data."""
    for v in variables:
        if v["type"] == "query":
            expr = expr.replace(f"${v['name']}", v["allValue"])
    return expr.replace("$__rate_interval", "15s")


def test_every_dashboard_query_parses_and_returns_data(stack):
    empty = []
    for where, expr, variables in dashboard_queries():
        if not query(stack["api"], as_runnable(expr, variables)):
            empty.append(f"{where}: {expr}")
    assert not empty, "panels without data:\n" + "\n".join(empty)


def test_every_recording_rule_yields_data(stack):
    # the engines' recordings are sidecar/test_engines_sd_scrape.py's (this stack runs no engine)
    names = [r.record for r in all_recordings(load_spec()) if r.group != ENGINE_GROUP]
    assert any(n.startswith("job_run:") for n in names)  # adaptive baselines are step-domain gauges now
    missing = [n for n in names if not query(stack["api"], n)]
    assert not missing, f"recording rules without data: {missing}"


def test_the_injected_nan_fires_its_alert_and_reaches_dingtalk(stack):
    wait_for(lambda: query(stack["api"], f'ALERTS{{alertname="{NAN_ALERT}", alertstate="firing"}}'), timeout=30)
    robot = stack["robot"]
    wait_for(lambda: any(NAN_ALERT in m.get("markdown", {}).get("text", "") for m in robot.messages), timeout=30)
    message = next(m for m in robot.messages if NAN_ALERT in m["markdown"]["text"])
    assert "run demo" in message["markdown"]["text"]
    assert all(r.get("errcode") == 0 for r in robot.requests)  # signed correctly, within limits


def test_automation_asks_the_sidecar_for_a_checkpoint_and_the_trainer_sees_it(stack):
    control_file = stack["ckpt"] / ".verl-exporter-control.json"
    monitor = stack["monitor"]
    assert wait_for(monitor.should_checkpoint, timeout=40)
    state = json.loads(control_file.read_text())
    assert state["checkpoint_seq"] >= 1 and state["reason"] == NAN_ALERT and not state.get("stop")
    assert not monitor.should_stop()
    metrics = http_get(stack["relay"].url + "/metrics")[2].decode()
    assert 'verl_relay_actions_total{action="checkpoint",result="done"}' in metrics


def test_sidecar_serves_the_checkpoint_and_gpu_signals(stack):
    api = stack["api"]
    assert query(api, "verl_checkpoint_latest_step == 50")
    assert query(api, 'verl_checkpoint_manifest_verified{step="50"} == 1')
    assert query(api, 'verl_gpu_xid_errors_total{xid="79"} == 1')
    assert query(api, 'verl_gpu_clock_event_active{reason="hw_thermal_slowdown", gpu="1"} == 1')
    assert query(api, 'verl_exporter_lines_rejected_total{reason="malformed_json"} == 1')
