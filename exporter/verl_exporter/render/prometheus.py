"""A minimal prometheus.yml that scrapes the sidecars (static targets and file_sd) with the generated rules.

It is its own file, not verl's: verl's rollout Prometheus integration rewrites the prometheus.yml it
manages on every node, so our job and discovery file must live elsewhere.
"""

from __future__ import annotations

from typing import Any

from ..spec import Spec
from .promql import equality_matchers
from .rules import ALERTS_FILE, RECORDING_FILE
from .templating import render


def render_prometheus(spec: Spec) -> dict[str, str]:
    job = equality_matchers(spec.rules.selector).get("job", "verl")
    rule_files = [f"/etc/prometheus/{RECORDING_FILE}", f"/etc/prometheus/{ALERTS_FILE}"]
    return {"docker/prometheus/prometheus.yml": render(
        "prometheus.yml.j2", job=job, rule_files=rule_files, evaluation_interval=spec.rules.evaluation_interval)}


# The engines verl's rollout integration knows: actor_rollout_ref.rollout.name.
ENGINES = ("vllm", "sglang")
VERL_ROLLOUT_JOB = "rollout"  # verl/workers/rollout/utils.py update_prometheus_config


def engine_file_sd(verl_config: dict[str, Any], run: str, engine: str) -> list[dict[str, Any]]:
    """file_sd entries for the servers of the prometheus.yml verl writes, labelled with the run (so the engine
    series join the run's training series) and the engine (which the engine alerts select on)."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, not {engine!r}")
    targets = [t for job in verl_config.get("scrape_configs") or () if job.get("job_name") == VERL_ROLLOUT_JOB
               for static in job.get("static_configs") or () for t in static.get("targets") or ()]
    return [{"targets": targets, "labels": {"run": run, "rollout_engine": engine}}] if targets else []
