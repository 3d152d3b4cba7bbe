"""Every metric key the installed verl can log resolves to a spec metric, never to verl_unmapped_*.

The keys are read from verl's own source with ``ast``: every string literal shaped like a metric key
(``segment/segment...``), and every f-string of that shape expanded with representative values for its
placeholders. verl builds a few families by prefixing inner keys (``fully_async/{key}``,
``rollout_corr/{key}``, ``timing_s/{name}``); the tables below say, with the place in verl that shows it,
which inner keys each prefix takes. A literal or template that is not a metric key must be listed, with the
reason, in NOT_KEYS / NOT_KEY_TEMPLATES; a template with a placeholder the tables do not know fails the
test, so a new key family in a new verl is noticed.

Run with ``-s`` to print the keys found and what each maps to.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import itertools
import re
from collections import defaultdict
from pathlib import Path

import pytest
from verl_exporter.sidecar.mapper import KeyMapper
from verl_exporter.spec import load_spec

_FOUND = importlib.util.find_spec("verl")
pytestmark = [pytest.mark.integration,  # reads the installed verl's source
              pytest.mark.skipif(_FOUND is None, reason="verl is not installed")]

KEY_RE = re.compile(r"^[A-Za-z_][\w\-@.()]*(?:/[\w\-@.()]+)+$")
PLACEHOLDER_RE = re.compile(r"\{([^{}]+)\}")

# Key-shaped literals that are provably not metric keys, and why.
NOT_KEYS = {
    # data_source names compared in verl/utils/reward_score/__init__.py to pick a scoring function
    "openai/gsm8k": "data source name", "lighteval/MATH": "data source name",
    "DigitalLearningGmbH/MATH-lighteval": "data source name", "HuggingFaceH4/MATH-500": "data source name",
    "hiyouga/geometry3k": "data source name",
    "application/json": "HTTP content type (sandbox_fusion)",
    "N/A": "placeholder text in a sandbox_fusion message",
    "outputs/profile": "default profiler output directory",
    "v1/completions": "HTTP endpoint of the reward loop", "v1/embeddings": "HTTP endpoint of the reward loop",
    "v1/models": "HTTP endpoint of the SGLang server",
    "version/version": "the file holding verl's version string",
    "val/generations": "a table of generations sent to wandb/swanlab/trackio, never to the file logger",
    "_staleness/mean": "a suffix v1/utils.py splits off a key to find its sample count",
    "rollout/moe": "the default prefix argument of the MoE metric helpers (expanded in their f-strings)",
}

# Key-shaped f-strings that are not metric keys: URLs and file paths.
NOT_KEY_TEMPLATES = {
    "{base_url}/health": "URL", "{base_url}/health_generate": "URL", "{base_url}/flush_cache": "URL",
    "{worker_url}/{endpoint}": "URL",
    "logs/log_{torch.distributed.get_rank()}": "log file path",
    "tensorboard_log/{project_name}/{experiment_name}": "tensorboard directory",
}

# Representative values of f-string placeholders, by "<file under verl/>:<placeholder expression>", or by the
# expression alone where several files build the same keys (the legacy, v1 and separation trainers).
PLACEHOLDERS = {
    # metric_utils.compute_timing_metrics: timing_per_token_ms only for these sections (num_tokens_of_section)
    "trainer/ppo/metric_utils.py:name@timing_per_token_ms": ["gen", "ref", "values", "adv", "update_critic",
                                                             "update_actor"],
    # metric_utils: MoE load metrics, default prefix "rollout/moe", one key per layer
    "trainer/ppo/metric_utils.py:prefix": ["rollout/moe"],
    "trainer/ppo/metric_utils.py:i": ["0", "47"],
    # metric_utils.process_validation_metrics: best@N/mean etc. are parts of a val-core metric name
    "trainer/ppo/metric_utils.py:n": ["4"],
    # val-core/val-aux keys in the trainers: {metric_sec}/{data_source}/{var_name}/{metric_name}
    "metric_sec": ["val-core", "val-aux"],
    "data_source": ["openai/gsm8k", "aime24"],
    "var_name": ["acc", "reward"],
    "metric_name": ["mean@1", "std@4", "best@4/mean", "maj@4/std", "worst@4/mean"],
    # ray_trainer: GDPO reward components come from algorithm.gdpo_reward_keys
    "trainer/ppo/ray_trainer.py:key": ["accuracy", "format"],
    # seqlen_balancing.log_seqlen_unbalance(prefix="global_seqlen") in both trainers
    "utils/seqlen_balancing.py:prefix": ["global_seqlen"],
    # v1 replay buffer: _metrics_prefix() is "training" or "validation"
    "trainer/ppo/v1/replay_buffer.py:prefix": ["training", "validation"],
    "trainer/ppo/v1/replay_buffer.py:self._metrics_prefix(partition_id)": ["training", "validation"],
    # sft_trainer: for k in ["loss", "grad_norm", "lr", "mfu"]: metrics[f"train/{k}"]
    "trainer/sft_trainer.py:k": ["loss", "grad_norm", "lr", "mfu"],
    # distillation: the policy loss's metrics with "actor/" stripped (core_algos' pg metrics, checked below)
    "trainer/distillation/losses.py:k[len('actor/'):]": ["pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"],
    # megatron_utils: Megatron's MTP loss names, "mtp_<n> loss" with the space replaced
    "utils/megatron_utils.py:key.replace(' ', '_')": ["mtp_1_loss"],
    # rollout_corr_helper: rejection-sampling option names (token_k*, seq_sum_k*, seq_mean_k*, seq_max_k*)
    "trainer/ppo/rollout_corr_helper.py:option_name": ["token_k1", "seq_mean_k3", "seq_max_k2"],
    "trainer/ppo/rollout_corr_helper.py:prefix": ["rollout_rs_token_k1", "rollout_rs_seq_sum_k2"],
}

# Templates whose whole tail is one placeholder: verl re-prefixes inner keys with them. Each names the
# literals (by their first segment) it takes, and where the other inner keys come from.
REPREFIX = {
    # detach_utils.assemble_batch_from_rollout_samples: the rollouter's get_statistics() keys and the
    # processing_time stats get "fully_async/"
    "fully_async/{key}": ("count/", "monitor/", "static/", "processing_time/"),
    # compute_timing_metrics: every timing_raw name, incl. the agent loop's "agent_loop/..." timing
    "timing_s/{name}": ("agent_loop/",),
    # rollout_corr_helper: the keys stored into its metrics dicts (collected by _rollout_corr_inner_keys)
    "rollout_corr/{key}": (),
}
# the phase names verl times with marked_timer/simple_timer become timing_s/<name> (collected below)
TIMERS = ("marked_timer", "simple_timer", "_timer")
# rename_dict(worker_metrics, "<role>/") prefixes the keys a worker stores into its metrics dicts: the
# actor's come from the PPO loss (losses.py) and the engine worker, the critic's from the engine worker.
RENAMED = {"actor/": ("workers/utils/losses.py", "workers/engine_workers.py"),
           "critic/": ("workers/engine_workers.py",)}


def _verl_root() -> Path:
    return Path(_FOUND.origin).parent


def _render(node: ast.JoinedStr) -> str:
    out = []
    for v in node.values:
        if isinstance(v, ast.Constant):
            out.append(str(v.value))
        else:
            out.append("{" + ast.unparse(v.value) + "}")
    return "".join(out)


def _key_shaped_template(text: str) -> bool:
    return bool(KEY_RE.match(PLACEHOLDER_RE.sub("x", text)))


@functools.cache
def scan_verl() -> tuple[dict[str, set[str]], dict[tuple[str, str], set[str]], set[str], dict[str, set[str]],
                         set[str]]:
    """(literal keys -> places, (file, template) -> places, timer names, file -> keys stored into its
    metrics dicts without a prefix, rename_dict prefixes)."""
    root = _verl_root()
    literals: dict[str, set[str]] = defaultdict(set)
    templates: dict[tuple[str, str], set[str]] = defaultdict(set)
    timers: set[str] = set()
    inner: dict[str, set[str]] = defaultdict(set)
    renames: set[str] = set()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        in_fstring = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
        for node in ast.walk(tree):
            where = f"verl/{rel}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.JoinedStr):
                text = _render(node)
                if _key_shaped_template(text):
                    templates[(rel, text)].add(where)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in in_fstring:
                if KEY_RE.match(node.value):
                    literals[node.value].add(where)
            elif isinstance(node, ast.Call) and node.args:
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                first = node.args[0]
                if name in TIMERS and isinstance(first, ast.Constant) and isinstance(first.value, str):
                    timers.add(first.value)
                last = node.args[-1]
                if name == "rename_dict" and isinstance(last, ast.Constant) and isinstance(last.value, str):
                    renames.add(last.value)
            inner[rel] |= _inner_keys(node)
    return literals, templates, timers, inner, renames


def _inner_keys(node: ast.AST) -> set[str]:
    """Keys stored into a dict named *metrics* (metrics["kl"] = ..., metrics[f"{prefix}_mean"] = ...)."""
    if not isinstance(node, ast.Assign):
        return set()
    out = set()
    for target in node.targets:
        if not (isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name)
                and "metrics" in target.value.id):
            continue
        key = target.slice
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            out.add(key.value)
        elif isinstance(key, ast.JoinedStr):
            out.add(_render(key))
    return {k for k in out if "/" not in k}  # the prefixed keys themselves are not inner keys


def _expand(rel: str, template: str, tag: str = "") -> list[str]:
    """Every combination of the representative values of a template's placeholders."""
    names = PLACEHOLDER_RE.findall(template)
    choices = []
    for name in names:
        values = (PLACEHOLDERS.get(f"{rel}:{name}@{tag}") or PLACEHOLDERS.get(f"{rel}:{name}")
                  or PLACEHOLDERS.get(name))
        if values is None:
            raise LookupError(f"verl/{rel}: no representative values for {{{name}}} in {template!r}")
        choices.append(values)
    parts = PLACEHOLDER_RE.split(template)  # literal text and placeholder names, alternating
    out = []
    for combo in itertools.product(*choices):
        out.append("".join(part if i % 2 == 0 else combo[i // 2] for i, part in enumerate(parts)))
    return out


@functools.cache
def verl_keys() -> tuple[dict[str, str], tuple[str, ...]]:
    """Every metric key the scan finds, each with where it comes from; and the templates it cannot expand."""
    literals, templates, timers, inner_keys, renames = scan_verl()
    keys: dict[str, str] = {}
    problems: list[str] = []
    consumed = tuple(p for prefixes in REPREFIX.values() for p in prefixes)
    for lit, places in literals.items():
        if lit not in NOT_KEYS and not lit.startswith(consumed):
            keys[lit] = sorted(places)[0]
    for (rel, template), places in templates.items():
        where = sorted(places)[0]
        if template in NOT_KEY_TEMPLATES:
            continue
        if template in REPREFIX:
            inner = [lit for lit in literals if lit.startswith(REPREFIX[template])]
            if template == "timing_s/{name}":
                inner += [t for t in timers if "/" not in t]
            if template == "rollout_corr/{key}":
                inner += [k for raw in inner_keys[rel] for k in _expand(rel, raw)]
            assert inner, f"{where}: no inner keys known for {template!r}"
            for k in inner:
                keys[template.split("{")[0] + k] = where
            continue
        if re.fullmatch(r"(best|maj|worst)@\{n\}/(mean|std)", template):
            continue  # metric-name parts of val-core keys, expanded with {metric_name} above
        tag = "timing_per_token_ms" if template.startswith("timing_per_token_ms/") else ""
        try:
            for k in _expand(rel, template, tag):
                keys[k] = where
        except LookupError as e:
            problems.append(str(e))
    if renames != set(RENAMED):
        problems.append(f"rename_dict prefixes {sorted(renames)}, RENAMED knows {sorted(RENAMED)}")
    for prefix, files in RENAMED.items():
        for rel in files:
            for k in inner_keys[rel]:
                if "{" not in k:
                    keys[prefix + k] = f"verl/{rel} via rename_dict"
    for t in timers:  # timer names that are already full keys
        if "/" in t:
            keys.setdefault(t, "a marked_timer name")
    return keys, tuple(sorted(problems))


def test_every_key_template_is_known():
    _, problems = verl_keys()
    assert not problems, "\n".join(problems)


def test_scan_finds_the_known_key_families():
    keys, _ = verl_keys()
    for key in ("actor/pg_loss", "timing_s/gen", "timing_per_token_ms/update_actor", "rollout_corr/kl",
                "rollout_corr/rollout_is_eff_sample_size", "rollout_corr/rollout_rs_token_k1_mean",
                "fully_async/count/dropped_stale_samples", "fully_async/trainer/idle_ratio",
                "fully_async/processing_time/tp99", "training/num_turns/mean",
                "training/rollout_actor_probs_pearson_corr", "rollout/moe/max_vio/layer_0",
                "rollout/spec_accept_rate", "val-core/openai/gsm8k/acc/best@4/mean",
                "timing_s/agent_loop/slowest/prompt_length", "distillation/ppo_kl"):
        assert key in keys, key


def test_distillation_placeholder_matches_core_algos():
    """distillation/{k[len('actor/'):]} strips "actor/" from the policy loss's metrics: keep the list honest."""
    literals = scan_verl()[0]
    pg = {lit for lit, places in literals.items()
          if lit.startswith("actor/") and any("core_algos.py" in p for p in places)}
    assert {"actor/" + k for k in PLACEHOLDERS["trainer/distillation/losses.py:k[len('actor/'):]"]} == pg


def test_every_verl_key_maps_to_a_spec_metric(capsys):
    mapper = KeyMapper(load_spec())
    keys, _ = verl_keys()
    rows, unmapped = [], []
    for key in sorted(keys):
        resolved = mapper.resolve(key)
        if resolved is None:
            unmapped.append(f"{key}  ({keys[key]})")
            continue
        labels = ",".join(f"{n}={v}" for n, v in zip(resolved.metric.labels, resolved.label_values, strict=True))
        rows.append(f"{key} -> {resolved.metric.name}{{{labels}}}")
    with capsys.disabled():
        print(f"\n{len(keys)} verl keys found:\n  " + "\n  ".join(rows))
    assert not unmapped, f"{len(unmapped)} verl key(s) no spec entry matches:\n  " + "\n  ".join(unmapped)


def test_every_scanned_key_written_by_verls_file_logger_is_exported_typed(tmp_path, monkeypatch):
    """verl's own FileLogger writes every key the scan found; the real follower and store map them all."""
    from verl.utils.tracking import Tracking
    from verl_exporter.exposition.selfmetrics import SelfMetrics
    from verl_exporter.sidecar.sources.verl_file import VerlFileFollower
    from verl_exporter.sidecar.store import TrainingStore

    keys, _ = verl_keys()
    log = tmp_path / "verl.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(log))
    tracker = Tracking(project_name="keys", experiment_name="all", default_backend=["file"])
    tracker.log({key: 0.5 for key in keys}, step=1)
    tracker.finish()
    spec = load_spec()
    sm = SelfMetrics(spec)
    store = TrainingStore(spec, sm, max_unmapped=10_000)
    VerlFileFollower(str(log), store, sm).poll()
    assert store.step == 1
    assert sm.value("verl_exporter_unmapped_values_total") in (None, 0)
    assert sm.value("verl_exporter_series_dropped_total", reason="series_cap") in (None, 0)
    series = {(metric.name, labels): value for metric, rows in store.series() for labels, value in rows.items()}
    mapper = KeyMapper(spec)
    for key in keys:
        r = mapper.resolve(key)
        assert series[(r.metric.name, r.label_values)] == pytest.approx(0.5 * r.scale), key
