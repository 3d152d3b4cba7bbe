
"""The scale-path examples stay valid: the HA replica's Prometheus config, with the generated rules."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml
from conftest import REPO, require_tool
from verl_exporter.render.promql import all_recordings
from verl_exporter.spec import load_spec

pytestmark = pytest.mark.integration  # starts servers or programs

REPLICA = REPO / "docker/prometheus/scale/prometheus-replica.yml"


def test_replica_config_passes_promtool(tmp_path):
    promtool = require_tool("promtool")
    shutil.copytree(REPO / "rules", tmp_path / "rules")
    (tmp_path / "file_sd").mkdir()
    (tmp_path / "prometheus.yml").write_text(REPLICA.read_text().replace("/etc/prometheus/", ""))
    run = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_replica_config_keeps_what_the_rules_and_dashboards_need():
    doc = yaml.safe_load(REPLICA.read_text())
    assert doc["global"]["external_labels"]["__replica__"]  # HA deduplication in the long-term store
    assert {"action": "labeldrop", "regex": "__replica__"} in doc["alerting"]["alert_relabel_configs"]
    keep = doc["remote_write"][0]["write_relabel_configs"][0]["regex"]
    for name in ("verl_training_step", "up", "rank:verl_x:avg_over_time_1h", "job_run:verl_x:avg"):
        assert re.fullmatch(keep, name), name
    spec = load_spec()
    recorded = [r.record for r in all_recordings(spec)]
    assert [name for name in recorded if not re.fullmatch(keep, name)] == []  # every recording rule is kept
    # and every series the rules read, the rollout engines' scraped ones included
    assert [m.name for m in spec.metrics if not re.fullmatch(keep, m.name)] == []
