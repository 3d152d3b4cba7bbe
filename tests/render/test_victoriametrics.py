"""The pack on VictoriaMetrics, live: real sidecars follow two replayed runs (one clean, one with NaN steps),
two sharded vmagents scrape them through the generated vmagent.yml (file_sd) and remote-write to a
single-node victoria-metrics; vmalert evaluates the generated recording and alerting rules against it and
notifies a real Alertmanager. A real Prometheus with the same rules scrapes the same sidecars and
remote-writes to a second victoria-metrics (the README's HA path).

Parity: the replay advances one step at a time, and after each step waits until both engines hold it and
have evaluated every rule group twice since; then the active alerts (name, labels, state) must be the same
on both. The replay driving is this file's own small loop (`Replay`), kept apart so that a shared replay
engine can replace it.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.parse
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from conftest import REPO, Proc, compressed_rule_files, free_port, http_get, ready, require_tool, wait_for
from helpers import scaled
from verl_exporter.tools.demo import _nonfinite_steps, demo_lines

pytestmark = pytest.mark.integration

INTERVAL = "1s"
VMAGENT_YML = REPO / "docker/victoriametrics/vmagent.yml"
LINES = demo_lines()
FAULT_STEPS = _nonfinite_steps(LINES)
FIRST_STEPPED = FAULT_STEPS[0] - 3   # steps before it are written at once; these one by one
LAST_STEP = FAULT_STEPS[-1] + 2
SIDECAR_OFF = ["--no-collector.gpu", "--no-collector.gpu_processes", "--no-collector.nvlink", "--no-collector.xid",
               "--no-collector.host", "--no-collector.disk", "--no-collector.filesystem", "--no-collector.network",
               "--no-collector.pressure", "--no-collector.checkpoint"]
# Labels one engine adds that the other does not: vmalert names the group an alert came from.
ENGINE_LABELS = {"alertgroup"}
# What both store from scrapes (not rule results): vmagent adds scrape_timeout_seconds, Prometheus 2.42 not.
SCRAPED = '{job="verl", __name__!~"scrape_timeout_seconds|ALERTS|ALERTS_FOR_STATE|.+:.+"}'


def get_json(url: str) -> dict:
    status, _, body = http_get(url, timeout=10)
    assert status == 200, f"{url}: {status} {body[:300]!r}"
    return json.loads(body)


def query(api: str, expr: str) -> list:
    doc = get_json(api + "/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert doc["status"] == "success", doc
    return doc["data"]["result"]


def clean_line(line: bytes) -> bytes:
    """The same step with every non-finite value replaced by the previous clean step's value."""
    before = json.loads(LINES[FAULT_STEPS[0] - 2])["data"]
    obj = json.loads(line)
    obj["data"] = {k: before.get(k, 0.0) if v is None else v for k, v in obj["data"].items()}
    return (json.dumps(obj) + "\n").encode()


class Replay:
    """Two runs, clean and faulty, written step by step to the logs their sidecars follow."""

    def __init__(self, root: Path):
        self.logs = {"clean": root / "clean.jsonl", "faulty": root / "faulty.jsonl"}
        for log in self.logs.values():
            log.write_bytes(b"")

    def write_until(self, step: int) -> None:
        """Every line up to and including `step` (1-based, as the demo run counts)."""
        for run, log in self.logs.items():
            have = len(log.read_bytes().splitlines())
            new = LINES[have:step]
            with log.open("ab") as f:
                f.write(b"".join(clean_line(x) if run == "clean" else x for x in new))


class Receiver:
    """Alertmanager's webhook target: keeps every alert it is sent."""

    def __init__(self):
        self.alerts: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.alerts.extend(json.loads(body).get("alerts", []))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def groups_evaluated(api: str) -> float:
    """The oldest last evaluation over every rule group (epoch seconds): Prometheus and vmalert alike."""
    groups = get_json(api + "/api/v1/rules")["data"]["groups"]
    return min(_epoch(g["lastEvaluation"]) for g in groups)


def _epoch(stamp: str) -> float:
    stamp = stamp.replace("Z", "+00:00")
    head, _, tail = stamp.partition(".")
    if tail:  # Go's nanoseconds: keep microseconds for fromisoformat
        frac = "".join(c for c in tail if c.isdigit())
        zone = tail[len(frac):]
        stamp = f"{head}.{frac[:6]}{zone}"
    return datetime.fromisoformat(stamp).timestamp()


def active_alerts(doc: dict) -> set[tuple]:
    out = set()
    for a in doc["data"]["alerts"] or []:  # vmalert answers null for none
        labels = {k: v for k, v in a["labels"].items() if k not in ENGINE_LABELS}
        out.add((a["state"], tuple(sorted(labels.items()))))
    return out


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    binaries = {name: require_tool(name) for name in
                ("victoria-metrics", "vmagent", "vmalert", "prometheus", "prometheus-alertmanager")}
    root = tmp_path_factory.mktemp("vm")
    procs: list[Proc] = []
    receiver = Receiver()

    def start(name, argv, health):
        procs.append(Proc(name, argv, root / f"{name}.log"))
        wait_for(lambda: ready(health, procs[-1]), timeout=30)

    try:
        replay = Replay(root)
        replay.write_until(FIRST_STEPPED - 1)
        targets = []
        for run in ("clean", "faulty"):
            port = free_port()
            targets.append(f"127.0.0.1:{port}")
            # the clean run's sidecar also serves two fake GPUs, so the cross-rank recording rules have data
            program = [str(REPO / "tests/fake_gpu_sidecar.py"), "--gpus", "all"] if run == "clean" else \
                ["-m", "verl_exporter", "serve"]
            off = [f for f in SIDECAR_OFF if run != "clean" or f != "--no-collector.gpu"]
            start(f"sidecar-{run}", [sys.executable, *program, "--listen", targets[-1], "--verl-log",
                                     str(replay.logs[run]), "--run", run, "--rank", "0", "--poll-interval", "0.1",
                                     *off], f"http://{targets[-1]}/healthz")
        file_sd = root / "file_sd"
        file_sd.mkdir()
        (file_sd / "verl-test.json").write_text(json.dumps([{"targets": targets}]))

        # the VictoriaMetrics path: two vmagent shards -> victoria-metrics <- vmalert -> Alertmanager
        vm, vm_ha = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        for name, addr in (("victoria-metrics", vm), ("victoria-metrics-ha", vm_ha)):
            start(name, [binaries["victoria-metrics"], f"-storageDataPath={root / name}", f"-httpListenAddr={addr}",
                         "-search.latencyOffset=0s", "-loggerLevel=WARN"], f"http://{addr}/health")
        config = yaml.safe_load(VMAGENT_YML.read_text())
        config["global"].update(scrape_interval=INTERVAL, scrape_timeout=INTERVAL)
        (job,) = config["scrape_configs"]
        job.pop("static_configs")  # the generated single-node target (localhost:9477)
        job["file_sd_configs"][0]["files"] = [str(file_sd / "verl-*.json")]
        (root / "vmagent.yml").write_text(yaml.safe_dump(config))
        shards = []
        for member in (0, 1):
            addr = f"127.0.0.1:{free_port()}"
            shards.append(f"http://{addr}")
            start(f"vmagent-{member}", [
                binaries["vmagent"], f"-promscrape.config={root / 'vmagent.yml'}", f"-httpListenAddr={addr}",
                "-promscrape.cluster.membersCount=2", f"-promscrape.cluster.memberNum={member}",
                f"-remoteWrite.url=http://{vm}/api/v1/write", f"-remoteWrite.tmpDataPath={root / f'vmagent{member}'}",
                "-promscrape.fileSDCheckInterval=1s", "-remoteWrite.flushInterval=200ms", "-loggerLevel=WARN"],
              f"{shards[-1]}/health")

        am = yaml.safe_load((REPO / "alertmanager/alertmanager.yml").read_text())
        am["route"]["group_wait"] = am["route"]["group_interval"] = "1s"
        for r in am["receivers"]:
            for hook in r.get("webhook_configs", []):
                hook["url"] = receiver.url + urllib.parse.urlsplit(hook["url"]).path
        (root / "am.yml").write_text(yaml.safe_dump(am))
        aport = free_port()
        start("alertmanager", [binaries["prometheus-alertmanager"], f"--config.file={root / 'am.yml'}",
                               f"--storage.path={root / 'am'}", f"--web.listen-address=127.0.0.1:{aport}",
                               "--cluster.listen-address="], f"http://127.0.0.1:{aport}/-/ready")
        vmalert = f"127.0.0.1:{free_port()}"
        rule_files = compressed_rule_files(root)
        start("vmalert", [binaries["vmalert"], *[f"-rule={p}" for p in rule_files], f"-httpListenAddr={vmalert}",
                          f"-datasource.url=http://{vm}", f"-remoteWrite.url=http://{vm}",
                          f"-notifier.url=http://127.0.0.1:{aport}", f"-evaluationInterval={INTERVAL}",
                          "-remoteWrite.flushInterval=200ms", "-loggerLevel=WARN"], f"http://{vmalert}/health")

        # the Prometheus path, remote-writing everything to the second victoria-metrics
        prom_config = {
            "global": {"scrape_interval": INTERVAL, "scrape_timeout": INTERVAL, "evaluation_interval": INTERVAL},
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [{"job_name": "verl", "file_sd_configs": [
                {"files": [str(file_sd / "verl-*.json")], "refresh_interval": "1s"}]}],
            "remote_write": [{"url": f"http://{vm_ha}/api/v1/write"}],
        }
        (root / "prometheus.yml").write_text(yaml.safe_dump(prom_config))
        pport = free_port()
        start("prometheus", [binaries["prometheus"], f"--config.file={root / 'prometheus.yml'}",
                             f"--storage.tsdb.path={root / 'tsdb'}", f"--web.listen-address=127.0.0.1:{pport}"],
              f"http://127.0.0.1:{pport}/-/ready")
        yield {"replay": replay, "prometheus": f"http://127.0.0.1:{pport}", "vm": f"http://{vm}",
               "vm_ha": f"http://{vm_ha}", "vmalert": f"http://{vmalert}", "shards": shards, "targets": targets,
               "receiver": receiver, "procs": procs}
    finally:
        for p in reversed(procs):
            p.stop()
        receiver.server.shutdown()


def steps_seen(api: str) -> dict[str, float]:
    return {r["metric"]["run"]: float(r["value"][1]) for r in query(api, 'verl_training_step{job="verl"}')}


def same_series(a: str, b: str, timeout: float = 30) -> None:
    """Wait until both hold the same scraped series (the series API also lists a series whose only sample
    is NaN, which MetricsQL drops from query results)."""
    deadline = time.monotonic() + scaled(timeout)
    while True:
        start = time.time() - 30
        on_a, on_b = series(a, SCRAPED, start), series(b, SCRAPED, start)
        if on_a == on_b:
            return
        assert time.monotonic() < deadline, f"only on {a}: {on_a - on_b}; only on {b}: {on_b - on_a}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def parity(stack):
    """The active alerts on both engines after every stepped step."""
    prom, vm, vmalert = stack["prometheus"], stack["vm"], stack["vmalert"]
    out = {}
    for step in range(FIRST_STEPPED - 1, LAST_STEP + 1):
        stack["replay"].write_until(step)
        want = {"clean": float(step), "faulty": float(step)}
        for p in stack["procs"]:
            p.alive()
        wait_for(lambda want=want: steps_seen(prom) == want and steps_seen(vm) == want, timeout=30)
        # and every series the step created (a first NaN's counter) is searchable on both
        same_series(prom, vm)
        # two evaluations of every group after the step is stored: the second sees the first's recordings
        seen = time.time()
        wait_for(lambda seen=seen: groups_evaluated(prom) > seen + 1, timeout=30)
        wait_for(lambda seen=seen: groups_evaluated(vmalert) > seen + 1, timeout=30)
        out[step] = (active_alerts(get_json(prom + "/api/v1/alerts")),
                     active_alerts(get_json(vmalert + "/api/v1/alerts")))
    return out


def scraped_by_shards(shards: list[str]) -> list[str]:
    out = []
    for shard in shards:
        doc = get_json(shard + "/api/v1/targets")
        out += [t["labels"]["instance"] for t in doc["data"]["activeTargets"] if t["health"] == "up"]
    return sorted(out)


def test_every_sidecar_is_scraped_by_exactly_one_vmagent_shard(stack):
    wait_for(lambda: scraped_by_shards(stack["shards"]) == sorted(stack["targets"]), timeout=20)


def test_vmalert_fires_the_same_alerts_at_the_same_steps_as_prometheus(parity):
    for step, (on_prometheus, on_vmalert) in parity.items():
        assert on_vmalert == on_prometheus, f"step {step}: Prometheus {on_prometheus} vs vmalert {on_vmalert}"
    firing = {dict(labels)["alertname"] for state, labels in parity[LAST_STEP][0] if state == "firing"}
    assert "VerlNonFiniteGradNorm" in firing, firing
    for step, (alerts, _) in parity.items():
        # the clean run is the faulty one without its NaNs (its grad-norm climb and the demo's slow memory
        # creep stay, and are alerted on): it must raise no NaN alert, and nothing may fire before the fault
        firing = {labels for state, labels in alerts if state == "firing"}
        clean_nan = [a for a in firing if dict(a).get("run") == "clean" and "NonFinite" in dict(a)["alertname"]]
        assert not clean_nan, f"step {step}: the clean run fired {clean_nan}"
        if step < FAULT_STEPS[0]:
            early = [a for a in firing if dict(a)["alertname"] not in ("VerlMemoryLeak", "VerlGradNormGrowing")]
            assert not early, f"step {step}, before the fault: {early}"


def test_vmalert_notifies_alertmanager(stack, parity):
    wait_for(lambda: any(a["labels"]["alertname"] == "VerlNonFiniteGradNorm" and a["labels"].get("run") == "faulty"
                         for a in stack["receiver"].alerts), timeout=30)


def series(api: str, match: str, start: float) -> set[tuple]:
    url = api + "/api/v1/series?" + urllib.parse.urlencode({"match[]": match, "start": start, "end": time.time()})
    return {tuple(sorted(s.items())) for s in get_json(url)["data"]}


def test_vmagent_stores_the_same_series_as_prometheus_scrapes(stack, parity):
    start = time.time() - 60
    prom = series(stack["prometheus"], SCRAPED, start)
    assert any(dict(s)["__name__"] == "verl_training_step" for s in prom)
    wait_for(lambda: series(stack["vm"], SCRAPED, start) == prom, timeout=20)


def test_prometheus_remote_write_to_victoriametrics_keeps_every_series(stack, parity):
    """The HA path: everything Prometheus holds (scraped, recorded, ALERTS) arrives in VictoriaMetrics."""
    start = time.time() - 60
    prom = series(stack["prometheus"], '{__name__=~".+"}', start)
    names = {dict(s)["__name__"] for s in prom}
    assert "ALERTS" in names and any(n.startswith(("rank:", "job_run:")) for n in names), names
    wait_for(lambda: series(stack["vm_ha"], '{__name__=~".+"}', start) == prom, timeout=20)
