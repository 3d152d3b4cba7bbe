"""Checkpoint/stop requests acted on inside verl 0.9.1's REAL v1 trainer loop (``PPOTrainer.fit``).

The trainer is verl's own class for each ``trainer.v1.trainer_mode`` (built from verl's ``ppo_trainer.yaml``
through hydra, so verl's own ``build_checkpoint_callback`` builds our callback), with only the GPU work
stubbed: ``step``, ``_validate``, ``_save_checkpoint`` (it writes the folder and calls the callback, as verl's
does), ``_compute_metrics``, the replica managers and TransferQueue's ``kv_clear``. The loop itself, its
hooks, its logger (verl's file logger, followed by a real sidecar) and its exit path are verl's. Requests go
through a real ``verl-exporter serve`` with a control token, as the relay's actions would send them.
"""

from __future__ import annotations

import json
import os
import types
import urllib.request

import pytest
from conftest import sample, wait_for
from helpers import scaled

pytestmark = pytest.mark.integration  # verl's trainer


@pytest.fixture(autouse=True, scope="module")
def _verl_core():
    """Imported when a test runs, not as the module loads: collecting the unit tier must not import verl."""
    pytest.importorskip("verl.trainer.ppo.v1.trainer_base", reason="needs verl[verl-core]==0.9.1 (the test extra)")


TOKEN = "v1-loop-control-token"
CALLBACK = "verl_exporter.trainer.verl_callback.ControlledCheckpointCallback"


def compose_verl_config(*overrides: str):
    """verl's own ppo_trainer.yaml, composed by hydra as ``main_ppo`` does, with our overrides."""
    import verl
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose("ppo_trainer", overrides=list(overrides))


class Replicas:
    """Stands in for verl's checkpoint-engine managers (weight sync to the rollout replicas)."""

    def __init__(self):
        self.calls: list[tuple[str, int | None]] = []

    def __getattr__(self, name):
        def record(step=None, *args, **kwargs):
            self.calls.append((name, step))
            return {}

        return record


def post(url: str, reason: str) -> dict:
    req = urllib.request.Request(url, data=json.dumps({"reason": reason}).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=scaled(10)) as r:
        return json.loads(r.read())


def driven_trainer(mode: str, config, requests: dict[int, str], sidecar_url: str):
    """verl's trainer class for ``mode``, its GPU work stubbed; ``requests`` = {step: action to POST}."""
    from verl.trainer.ppo.v1.trainer_base import get_trainer_cls

    base = get_trainer_cls(mode)

    class Driven(base):
        def step(self, metrics, timing_raw):
            action = requests.get(self.global_steps)
            if action:
                answer = post(f"{sidecar_url}/control/{action}", "VerlNonFiniteGradNorm")
                assert answer["action"] == action
            metrics["actor/grad_norm"] = 0.5
            metrics["critic/score/mean"] = 0.1 * self.global_steps
            return types.SimpleNamespace(keys=[], partition_id="train")

        def _validate(self):
            return {}

        def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
            metrics["training/global_step"] = global_steps

        def _reissue_inflight_prompts(self, partition_id="train"):
            return 0

        def _add_prompts_to_generate(self, n):
            pass

        def _save_checkpoint(self):
            # what verl's does, minus the model: the step folder, the tracker file, then the callback
            folder = os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.global_steps}")
            os.makedirs(os.path.join(folder, "actor"), exist_ok=True)
            with open(os.path.join(folder, "actor", "model.pt"), "wb") as f:
                f.write(b"weights of step %d" % self.global_steps)
            with open(os.path.join(self.config.trainer.default_local_dir,
                                   "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(self.global_steps))
            self.saves.append(self.global_steps)
            self.checkpoint_callback.on_save(trainer=self, global_step=self.global_steps, checkpoint_dir=folder,
                                             async_save=False)

        def on_train_end(self):
            self.train_ended = True
            super().on_train_end()

    trainer = Driven(config)
    trainer.saves = []
    trainer.train_ended = False
    trainer.global_steps = 0
    trainer.steps_per_epoch = 1000
    trainer.total_training_steps = 50
    trainer.checkpoint_manager = trainer.standalone_checkpoint_manager = Replicas()
    if mode == "separate_async":
        from verl.trainer.ppo.v1.trainer_separate_async import HybridEngineMode

        trainer.current_mode = HybridEngineMode.TRAINER
    trainer._init_dump_executor()
    return trainer


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["sync", "colocate_async", "separate_async"])
def test_checkpoint_and_stop_requests_act_inside_verls_real_v1_loop(mode, serve, tmp_path, monkeypatch):
    from verl.trainer.ppo.v1 import trainer_base

    ckpt_dir, log_path = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    ckpt_dir.mkdir()
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(log_path))
    monkeypatch.delenv("VERL_EXPORTER_CONTROL_FILE", raising=False)
    monkeypatch.setattr(trainer_base.tq, "kv_clear", lambda **kwargs: None)  # TransferQueue holds no data here
    side = serve("--checkpoint-dir", str(ckpt_dir), "--verl-log", str(log_path), "--control-token-env", "VERL_CTL",
                 env={"VERL_CTL": TOKEN})
    config = compose_verl_config(
        f"trainer.checkpoint_callback_class={CALLBACK}", f"trainer.default_local_dir={ckpt_dir}",
        "trainer.logger=[file]", f"trainer.v1.trainer_mode={mode}", "trainer.save_freq=5", "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        # what separate_async checks in its __init__ (a standalone rollout pool, a real weight-sync backend)
        "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl", "data.train_batch_size=256",
        "actor_rollout_ref.actor.ppo_mini_batch_size=256", "trainer.v1.separate_async.parameter_sync_step=1")
    # step 3: a checkpoint request; step 5: one on a step verl saves itself (no second save); step 7: stop
    trainer = driven_trainer(mode, config, {3: "checkpoint", 5: "checkpoint", 7: "stop"}, side.url)
    from verl_exporter.trainer.verl_callback import ControlledCheckpointCallback

    assert isinstance(trainer.checkpoint_callback, ControlledCheckpointCallback)  # built by verl itself

    assert trainer.fit(agent_loop_manager=None) is None  # returns normally: no exception out of verl's fit()

    assert trainer.saves == [3, 5, 7]  # requested, verl's save_freq, the save before stopping
    assert trainer.checkpoint_callback.control.stopped_at == 7
    assert trainer.train_ended and trainer._dump_executor._shutdown  # verl's own exit path ran
    assert "on_step_end" not in vars(trainer)  # the hook is gone once fit() returns
    lines = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, 8))  # step 7's metrics were still logged
    # every save got its manifest from the callback, and the weight sync of each step still ran
    for step in (3, 5, 7):
        assert (ckpt_dir / f"global_step_{step}" / "verl_exporter_manifest.json").is_file()
    assert [s for name, s in trainer.checkpoint_manager.calls if name == "update_weights"] == list(range(1, 8))
    # the sidecar followed verl's file logger all along
    wait_for(lambda: sample(side.metrics(), "verl_training_step") == 7, timeout=15)


def test_a_trainer_without_our_callback_runs_verls_fit_untouched(tmp_path, monkeypatch):
    from verl.trainer.ppo.v1 import trainer_base

    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "m.jsonl"))
    monkeypatch.setattr(trainer_base.tq, "kv_clear", lambda **kwargs: None)
    # our hook is installed on verl's base class once any ControlledCheckpointCallback was built
    compose_and_build = compose_verl_config(f"trainer.checkpoint_callback_class={CALLBACK}",
                                            f"trainer.default_local_dir={tmp_path}")
    from verl.trainer.ppo.checkpoint_callback import build_checkpoint_callback

    assert build_checkpoint_callback(compose_and_build).control is not None
    config = compose_verl_config(f"trainer.default_local_dir={tmp_path}", "trainer.logger=[file]",
                                 "trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.val_before_train=false")
    trainer = driven_trainer("sync", config, {}, "http://127.0.0.1:9")
    trainer.total_training_steps = 4
    assert trainer.fit(agent_loop_manager=None) is None
    assert trainer.saves == [] and (tmp_path / "m.jsonl").read_text().count("\n") == 4


@pytest.mark.integration
def test_a_resumed_run_is_not_stopped_by_run_1s_stop_but_by_a_new_one(serve, tmp_path, monkeypatch):
    from verl.trainer.ppo.v1 import trainer_base

    ckpt_dir, log_path = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    ckpt_dir.mkdir()
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(log_path))
    monkeypatch.delenv("VERL_EXPORTER_CONTROL_FILE", raising=False)
    monkeypatch.setattr(trainer_base.tq, "kv_clear", lambda **kwargs: None)
    side = serve("--checkpoint-dir", str(ckpt_dir), "--control-token-env", "VERL_CTL", env={"VERL_CTL": TOKEN})
    config = compose_verl_config(
        f"trainer.checkpoint_callback_class={CALLBACK}", f"trainer.default_local_dir={ckpt_dir}",
        "trainer.logger=[file]", "trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.val_before_train=false")
    run1 = driven_trainer("sync", config, {3: "stop"}, side.url)
    run1.fit(agent_loop_manager=None)
    assert run1.checkpoint_callback.control.stopped_at == 3 and run1.saves == [3]
    # run 2 resumes in the same checkpoint directory (verl's resume keeps it, control file included)
    run2 = driven_trainer("sync", config, {6: "stop"}, side.url)
    run2.global_steps = 3  # verl's _load_checkpoint resumes after the saved step
    assert run2.fit(agent_loop_manager=None) is None
    assert run2.checkpoint_callback.control.stopped_at == 6 and run2.saves == [6]  # not stopped at step 4
    assert run2.train_ended
    metrics = side.metrics()
    assert sample(metrics, "verl_exporter_control_requests_total", action="stop", result="accepted") == 2
