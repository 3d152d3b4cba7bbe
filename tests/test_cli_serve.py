"""`verl-exporter serve` as a real subprocess: endpoints, formats, flags, config, promtool."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO, http_get, parse_metrics, require_tool, sample, wait_for
from helpers import scaled
from verl_exporter.sidecar.config import ConfigError, build_config, read_config_file

pytestmark = pytest.mark.integration  # starts servers or programs


def verl_line(step, **data):
    return json.dumps({"step": step, "data": data}) + "\n"


def test_endpoints_and_a_written_line_on_metrics(tmp_path, serve):
    log = tmp_path / "run.jsonl"
    side = serve("--verl-log", str(log), "--run", "exp1", "--rank", "0")
    status, _, body = http_get(side.url + "/healthz")
    assert status == 200 and json.loads(body)["sources"]["verl_log"]["state"] == "waiting"
    status, headers, body = http_get(side.url + "/")
    assert status == 200 and b'href="metrics"' in body and b'href="healthz"' in body
    assert http_get(side.url + "/nope")[0] == 404

    # (How fast a line shows up is measured by bench/foundation.py, not asserted here.)
    log.write_text(verl_line(3, **{"actor/grad_norm": 0.5, "timing_s/step": 61.0}))
    wait_for(lambda: sample(side.metrics(), "verl_training_step") == 3, timeout=10)
    m = side.metrics()
    assert sample(m, "verl_actor_grad_norm", run="exp1", rank="0") == 0.5
    assert sample(m, "verl_timing_seconds", phase="step") == 61.0
    assert json.loads(http_get(side.url + "/healthz")[2])["step"] == 3


def test_openmetrics_when_the_scraper_asks_for_it(serve, tmp_path):
    side = serve()
    status, headers, body = http_get(side.url + "/metrics",
                                     headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert status == 200
    assert headers["Content-Type"].startswith("application/openmetrics-text")
    assert body.decode().rstrip().endswith("# EOF")
    status, headers, body = http_get(side.url + "/metrics")
    assert headers["Content-Type"].startswith("text/plain")


def test_self_metrics_and_no_gpu_needed(serve):
    side = serve()
    m = side.metrics()
    assert sample(m, "verl_exporter_build_info") == 1
    # The previous scrape's render time is exported on the next one.
    m = side.metrics()
    assert sample(m, "verl_exporter_last_scrape_duration_seconds") > 0


def test_healthz_fails_when_the_log_cannot_be_read(tmp_path, serve):
    log = tmp_path / "adir"
    log.mkdir()  # a directory where the log should be
    side = serve("--verl-log", str(log))
    status = wait_for(lambda: http_get(side.url + "/healthz")[0] == 503 and 503, timeout=5)
    assert status == 503
    assert sample(side.metrics(), "verl_exporter_source_up", source="file") == 0
    # ... and it keeps serving metrics all the same.
    assert sample(side.metrics(), "verl_exporter_build_info") == 1


def test_promtool_finds_nothing_to_complain_about(tmp_path, serve):
    promtool = require_tool("promtool")
    log = tmp_path / "run.jsonl"
    side = serve("--verl-log", str(log), "--run", "lint", "--rank", "1", "--label", "team=rl")
    from verl_exporter.tools.demo import demo_lines

    log.write_bytes(b"".join(demo_lines()[:60]) + b"garbage line\n")
    wait_for(lambda: sample(side.metrics(), "verl_training_step") == 60, timeout=10)
    text = side.text()
    assert 'team="rl"' in text
    proc = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "" and proc.stderr.strip() == "", proc.stdout + proc.stderr


def test_bad_flags_exit_with_a_clear_message(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "verl_exporter", "serve", *args], capture_output=True,
                              text=True, timeout=scaled(30))

    p = run("--listen", "nonsense")
    assert p.returncode == 2 and "--listen must be HOST:PORT" in p.stderr
    p = run("--label", "job=x", "--listen", "127.0.0.1:0")
    assert p.returncode == 2 and "label name 'job' is not allowed" in p.stderr
    cfg = tmp_path / "c.yaml"
    cfg.write_text("listen: 127.0.0.1:0\npoll_intervall: 1\n")
    p = run("--config", str(cfg))
    assert p.returncode == 2 and f"{cfg}:2: poll_intervall: unknown key" in p.stderr


def test_config_file_values_and_flag_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "2")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("run: from-file\nmax_unmapped: 7\nlabels: {team: rl}\n")
    c = build_config(read_config_file(str(cfg)), {"run": "from-flag", "labels": ["zone=a"]})
    assert c.run == "from-flag" and c.max_unmapped == 7 and c.rank == 5 and c.local_rank == 2
    assert c.labels == {"zone": "a"}  # flags replace the file's labels
    assert c.listen == "0.0.0.0:9479"  # default port + local rank
    assert c.const_labels() == {"run": "from-flag", "rank": "5", "zone": "a"}


@pytest.mark.parametrize("values,fragment", [
    ({"rank": -1}, "rank: Input should be greater than or equal to 0"),
    ({"poll_interval": 0}, "poll_interval: Input should be greater than or equal to 0.01"),
    ({"labels": ["novalue"]}, "--label takes KEY=VALUE"),
    ({"labels": {"rank": "1"}}, "is set by --rank"),
    ({"listen": "host"}, "--listen must be HOST:PORT"),
])
def test_config_problems_name_the_setting(values, fragment):
    with pytest.raises(ConfigError, match=fragment):
        build_config({}, values)


def test_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read it"):
        read_config_file(str(tmp_path / "none.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        read_config_file(str(bad))


def test_every_problem_of_a_config_file_is_reported_with_its_line(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("run: exp\nlabels:\n  team: rl\n  bad-name: x\ninterval: 0\npoll_intervall: 1\n")
    with pytest.raises(ConfigError) as e:
        read_config_file(str(cfg))
    assert e.value.problems == [f"{cfg}:4: labels.bad-name: the name 'bad-name': not a Prometheus label name",
                                f"{cfg}:5: interval: Input should be greater than or equal to 0.1",
                                f"{cfg}:6: poll_intervall: unknown key"]


def test_the_control_endpoint_may_take_its_file_from_the_flags(tmp_path):
    # the file alone lacks where the control file goes; the merged config has it
    values = {"control_token_env": "TOKEN"}
    assert build_config(values, {"control_file": str(tmp_path / "c.json")}).control_token_env == "TOKEN"
    with pytest.raises(ConfigError, match="the control endpoint needs"):
        build_config(values, {})


def test_the_example_config_is_one_serve_accepts(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    c = build_config(read_config_file(str(REPO / "docker" / "verl-exporter-serve.example.yaml")), {})
    assert c.run and c.labels and c.collectors and c.watch_paths and c.control_token_env
    assert c.listen == "0.0.0.0:9477" and c.control_file_mode == "0644"


def test_metrics_parse_after_every_kind_of_bad_line(tmp_path, serve):
    log = tmp_path / "run.jsonl"
    side = serve("--verl-log", str(log))
    log.write_bytes(b"{bad\n[1]\n" + b'{"step":1,"data":{"actor/lr":null,"x":"y","l":[1]}}\n' + b'{"step":2,"da')
    wait_for(lambda: sample(side.metrics(), "verl_training_step") == 1, timeout=5)
    m = parse_metrics(side.text())
    assert sample(m, "verl_exporter_lines_rejected_total", source="file", reason="malformed_json") == 1
    assert sample(m, "verl_exporter_lines_rejected_total", source="file", reason="not_an_object") == 1
    assert sample(m, "verl_exporter_values_rejected_total", reason="string") == 1
    out = side.stop()
    assert "malformed_json" in out  # logged once
