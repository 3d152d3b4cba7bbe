"""Every verl key listed in the shared verl facts (verl 0.9.1) maps to the metric and labels we expect."""

from __future__ import annotations

import pytest
from verl_exporter.sidecar.mapper import KeyMapper, unmapped_name
from verl_exporter.spec import load_spec

GIB = 1024.0**3

# key -> (metric, {label: value}, scale)
EXPECTED = {
    "actor/pg_loss": ("verl_actor_pg_loss", {}, 1),
    "actor/entropy": ("verl_actor_entropy", {}, 1),
    "actor/entropy_loss": ("verl_actor_entropy_loss", {}, 1),
    "actor/ppo_kl": ("verl_actor_ppo_kl", {}, 1),
    "actor/pg_clipfrac": ("verl_actor_pg_clip_ratio", {"bound": "upper"}, 1),
    "actor/pg_clipfrac_lower": ("verl_actor_pg_clip_ratio", {"bound": "lower"}, 1),
    "actor/grad_norm": ("verl_actor_grad_norm", {}, 1),
    "actor/lr": ("verl_actor_learning_rate", {}, 1),
    "actor/kl_loss": ("verl_actor_kl_loss", {}, 1),
    "actor/kl_coef": ("verl_actor_kl_coef", {}, 1),
    "actor/reward_kl_penalty": ("verl_actor_reward_kl_penalty", {}, 1),
    "actor/reward_kl_penalty_coeff": ("verl_actor_reward_kl_penalty_coef", {}, 1),
    "actor/mfu": ("verl_mfu_ratio", {"role": "actor", "source": "update"}, 1),
    "actor/loss": ("verl_actor_loss", {}, 1),
    "critic/vf_loss": ("verl_critic_vf_loss", {}, 1),
    "critic/vf_clipfrac": ("verl_critic_vf_clip_ratio", {}, 1),
    "critic/vf_explained_var": ("verl_critic_vf_explained_variance", {}, 1),
    "critic/vpred_mean": ("verl_critic_vpred_mean", {}, 1),
    "critic/mfu": ("verl_mfu_ratio", {"role": "critic", "source": "update"}, 1),
    "critic/grad_norm": ("verl_critic_grad_norm", {}, 1),
    "critic/lr": ("verl_critic_learning_rate", {}, 1),
    "response_length/clip_ratio": ("verl_response_length_clip_ratio", {"subset": "all"}, 1),
    "response_length_non_aborted/clip_ratio": ("verl_response_length_clip_ratio", {"subset": "non_aborted"}, 1),
    "prompt_length/clip_ratio": ("verl_prompt_length_clip_ratio", {}, 1),
    "response/aborted_ratio": ("verl_response_aborted_ratio", {}, 1),
    "timing_s/agent_loop/generate_sequences/max": (
        "verl_agent_loop_timing_seconds", {"section": "generate_sequences", "stat": "max"}, 1),
    "timing_s/agent_loop/tool_calls/mean": ("verl_agent_loop_timing_seconds",
                                            {"section": "tool_calls", "stat": "mean"}, 1),
    "perf/throughput": ("verl_perf_throughput_tokens_per_second", {}, 1),
    "perf/time_per_step": ("verl_perf_time_per_step_seconds", {}, 1),
    "perf/total_num_tokens": ("verl_perf_step_tokens", {}, 1),
    "perf/max_memory_allocated_gb": ("verl_perf_max_memory_allocated_bytes", {}, GIB),
    "perf/max_memory_reserved_gb": ("verl_perf_max_memory_reserved_bytes", {}, GIB),
    "perf/cpu_memory_used_gb": ("verl_perf_cpu_memory_used_bytes", {}, GIB),
    "training/global_step": ("verl_training_global_step", {}, 1),
    "training/epoch": ("verl_training_epoch", {}, 1),
    "training/off_policy/is_weight_mean": ("verl_training_off_policy", {"quantity": "is_weight_mean"}, 1),
    "training/filter_groups/num_gen_batches": ("verl_training_filter_groups", {"quantity": "num_gen_batches"}, 1),
    "training/rollout_failure/evicted_samples": ("verl_training_rollout_evicted_samples", {}, 1),
    "rollout/spec_accept_rate": ("verl_rollout_spec_accept_rate_ratio", {}, 1),
    "rollout/spec_accept_length": ("verl_rollout_spec_accept_length_tokens", {}, 1),
    "rollout/moe/max_vio/max": ("verl_rollout_moe_load_violation", {"kind": "max", "stat": "max"}, 1),
    "rollout/moe/avg_vio/layer_12": ("verl_rollout_moe_layer_load_violation", {"kind": "avg", "layer": "12"}, 1),
    "timing_s/agent_loop/slowest/prompt_length": ("verl_agent_loop_slowest_length_tokens", {"part": "prompt"}, 1),
    "timing_s/agent_loop/num_preempted/max": ("verl_agent_loop_preempted", {"stat": "max"}, 1),
    "checkpoint_engine/payload_mbytes": ("verl_checkpoint_engine_payload_bytes", {}, 1024.0**2),
    "train/total_tokens(B)": ("verl_sft_consumed_tokens", {}, 1e9),
    "val-core/openai/gsm8k/reward/mean@4": (
        "verl_validation_score",
        {"kind": "core", "data_source": "openai/gsm8k", "variable": "reward", "stat": "mean@4"}, 1),
    "val-core/openai/gsm8k/acc/best@4/mean": (
        "verl_validation_score",
        {"kind": "core", "data_source": "openai/gsm8k", "variable": "acc", "stat": "best@4/mean"}, 1),
    "val-aux/lighteval/MATH/reward/maj@8/std": (
        "verl_validation_score",
        {"kind": "aux", "data_source": "lighteval/MATH", "variable": "reward", "stat": "maj@8/std"}, 1),
    "val-aux/gsm8k/score/custom": (
        "verl_validation_score", {"kind": "aux", "data_source": "gsm8k", "variable": "score", "stat": "custom"}, 1),
    "val-aux/num_turns/max": ("verl_validation_num_turns", {"stat": "max"}, 1),
}

for stat in ("mean", "max", "min"):
    for group, metric in (("score", "verl_critic_score"), ("rewards", "verl_critic_rewards"),
                          ("advantages", "verl_critic_advantages"), ("returns", "verl_critic_returns"),
                          ("values", "verl_critic_values")):
        EXPECTED[f"critic/{group}/{stat}"] = (metric, {"stat": stat}, 1)
    EXPECTED[f"response_length/{stat}"] = ("verl_response_length_tokens", {"stat": stat, "subset": "all"}, 1)
    EXPECTED[f"response_length_non_aborted/{stat}"] = (
        "verl_response_length_tokens", {"stat": stat, "subset": "non_aborted"}, 1)
    EXPECTED[f"prompt_length/{stat}"] = ("verl_prompt_length_tokens", {"stat": stat}, 1)
    EXPECTED[f"num_turns/{stat}"] = ("verl_num_turns", {"stat": stat}, 1)
    EXPECTED[f"tool_call_counts/{stat}"] = ("verl_tool_calls", {"stat": stat}, 1)
for stat in ("min", "max", "minmax_diff"):
    EXPECTED[f"global_seqlen/{stat}"] = ("verl_global_seqlen_tokens", {"stat": stat}, 1)
for stat in ("mean", "max", "std", "valid"):
    EXPECTED[f"training/rollout_probs_diff_{stat}"] = ("verl_training_rollout_probs_diff", {"stat": stat}, 1)
for phase in ("step", "gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor",
              "update_weights", "save_checkpoint", "testing", "param_sync", "wait_for_enough_samples"):
    EXPECTED[f"timing_s/{phase}"] = ("verl_timing_seconds", {"phase": phase}, 1)
    EXPECTED[f"timing_per_token_ms/{phase}"] = ("verl_timing_per_token_seconds", {"phase": phase}, 1e-3)
for role in ("actor", "critic", "actor_infer"):
    EXPECTED[f"perf/mfu/{role}"] = ("verl_mfu_ratio", {"role": role, "source": "perf"}, 1)


@pytest.fixture(scope="module")
def mapper():
    return KeyMapper(load_spec())


@pytest.mark.parametrize("key", sorted(EXPECTED))
def test_every_verl_key_maps_to_its_metric(mapper, key):
    metric, labels, scale = EXPECTED[key]
    resolved = mapper.resolve(key)
    assert resolved is not None, f"{key} is unmapped"
    assert resolved.metric.name == metric
    assert dict(zip(resolved.metric.labels, resolved.label_values, strict=True)) == labels
    assert resolved.scale == pytest.approx(scale)


def test_allow_list_falls_through_to_the_next_entry(mapper):
    # response_length/{stat} only takes mean/max/min; clip_ratio is its own metric.
    assert mapper.resolve("response_length/p99") is None
    assert mapper.resolve("response_length/clip_ratio").metric.name == "verl_response_length_clip_ratio"


@pytest.mark.parametrize("key,name", [
    ("my/custom.metric-1", "verl_unmapped_my_custom_metric_1"),
    ("Weird Key!!", "verl_unmapped_weird_key"),
    ("///", "verl_unmapped_empty"),
])
def test_unknown_keys_get_a_sanitised_name(mapper, key, name):
    assert mapper.resolve(key) is None
    assert unmapped_name(key) == name


def test_every_key_of_the_demo_run_is_mapped():
    import json

    from verl_exporter.tools.demo import demo_lines

    mapper = KeyMapper(load_spec())
    keys = set()
    for line in demo_lines():
        keys.update(json.loads(line)["data"])
    unmapped = sorted(k for k in keys if mapper.resolve(k) is None)
    # The demo carries one deliberately custom, string-valued key.
    assert unmapped == ["training/note"]
