"""Hang forensics: stacks captured with the real py-spy, the ways a capture cannot run (made to happen, not
mocked), the bounded directory, the stall trigger (the spec's own stall alerts on the sidecar's store) and the
verdict across ranks."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import REPO
from hypothesis import given, settings
from hypothesis import strategies as st
from verl_exporter.core.verdict import (
    flight_recorder_verdict,
    merge,
    ranges,
    read_captures,
    read_flight_recorder,
    verdict,
)
from verl_exporter.exposition.selfmetrics import SelfMetrics
from verl_exporter.sidecar.forensics import HINTS, Forensics, ForensicsSettings, StallWatch, classify
from verl_exporter.sidecar.store import TrainingStore
from verl_exporter.spec import load_spec

SPEC = load_spec()


def py_spy() -> str:
    path = Path(sys.executable).parent / "py-spy"
    if not path.exists():
        pytest.skip("py-spy is not installed (pip install 'verl-exporter[forensics]')")
    return str(path)


@pytest.fixture
def sleeper(tmp_path):
    """A real Python process waiting in a function of its own, as a hung reward function would."""
    script = tmp_path / "sleeper.py"
    script.write_text(textwrap.dedent("""\
        import sys, time
        def slow_reward():
            print("ready", flush=True)
            time.sleep(600)
        slow_reward()
        """))
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, env={**os.environ, "RANK": "3"})
    assert p.stdout.readline().strip() == b"ready"
    yield p
    p.kill()
    p.wait()


def forensics(tmp_path, trainer_pid=None, **settings) -> tuple[Forensics, SelfMetrics]:
    metrics = SelfMetrics(SPEC)
    settings = {"py_spy": py_spy(), **settings}
    return Forensics(ForensicsSettings(str(tmp_path / "forensics"), **settings), metrics, trainer_pid,
                     {"run": "r1", "rank": "0"}), metrics


@pytest.mark.integration
def test_a_capture_holds_the_real_stack_in_a_private_file(tmp_path, sleeper):
    f, metrics = forensics(tmp_path, sleeper.pid)
    doc = f.capture("request", "by hand")
    [proc] = doc["processes"]
    assert proc["pid"] == sleeper.pid and proc["rank"] == "3" and "reason" not in proc
    assert doc["verdict"] == "rank 3 is in <module> → slow_reward (sleeper.py)"
    path = Path(doc["path"])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert json.loads(path.read_text())["processes"][0]["threads"][0]["frames"]
    assert metrics.value("verl_exporter_forensics_captures_total", trigger="request") == 1
    assert metrics.value("verl_exporter_forensics_last_capture_timestamp_seconds") == doc["time"]
    assert f.last["verdict"] == doc["verdict"]


@pytest.mark.integration
def test_a_process_that_is_not_there_is_counted_with_why(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid, now free
    f, metrics = forensics(tmp_path, dead.pid)
    doc = f.capture("stall")
    [proc] = doc["processes"]
    assert proc["reason"] == "no_process" and proc["hint"] == HINTS["no_process"]
    assert metrics.value("verl_exporter_forensics_failures_total", reason="no_process") == 1
    assert doc["verdict"].startswith("no Python stack captured")
    assert doc["path"]  # the failure itself is evidence: written, counted as a capture
    assert metrics.value("verl_exporter_forensics_captures_total", trigger="stall") == 1


@pytest.mark.integration
def test_a_missing_py_spy_says_how_to_install_it(tmp_path, sleeper):
    f, metrics = forensics(tmp_path, sleeper.pid, py_spy=str(tmp_path / "no" / "py-spy"))
    [proc] = f.capture("request")["processes"]
    assert proc["reason"] == "no_binary" and "pip install" in proc["hint"]
    assert metrics.value("verl_exporter_forensics_failures_total", reason="no_binary") == 1


# What py-spy 0.4 writes when ptrace is refused: EPERM (yama ptrace_scope 2/3, no CAP_SYS_PTRACE) and EACCES.
PTRACE_ERRORS = ["Error: Operation not permitted (os error 1)",
                 "Error: Permission Denied: Try running again with elevated permissions by going 'sudo env "
                 "\"PATH=$PATH\" !!'"]


@pytest.mark.parametrize("error", PTRACE_ERRORS)
@pytest.mark.integration
def test_a_refused_ptrace_names_the_capability_and_kubernetes(tmp_path, sleeper, error):
    fake = tmp_path / "py-spy"
    fake.write_text(f"#!/bin/sh\ncat >&2 <<'EOF'\n{error}\nEOF\nexit 1\n")
    fake.chmod(0o755)
    f, metrics = forensics(tmp_path, sleeper.pid, py_spy=str(fake))
    [proc] = f.capture("stall")["processes"]
    assert proc["reason"] == "permission" and proc["error"] == error
    assert "CAP_SYS_PTRACE" in proc["hint"] and "shareProcessNamespace" in proc["hint"]
    assert metrics.value("verl_exporter_forensics_failures_total", reason="permission") == 1


@pytest.mark.integration
def test_a_py_spy_that_hangs_is_timed_out(tmp_path, sleeper):
    fake = tmp_path / "py-spy"
    fake.write_text("#!/bin/sh\nexec sleep 30\n")
    fake.chmod(0o755)
    f, metrics = forensics(tmp_path, sleeper.pid, py_spy=str(fake), timeout_s=0.5)
    [proc] = f.capture("stall")["processes"]
    assert proc["reason"] == "timeout"
    assert metrics.value("verl_exporter_forensics_failures_total", reason="timeout") == 1


@pytest.mark.integration
def test_an_unwritable_directory_is_counted_not_raised(tmp_path, sleeper):
    blocker = tmp_path / "forensics"
    blocker.write_text("a file where the folder should be")
    f, metrics = forensics(tmp_path, sleeper.pid)
    doc = f.capture("request")
    assert doc["path"] is None
    assert metrics.value("verl_exporter_forensics_failures_total", reason="write") == 1
    assert metrics.value("verl_exporter_forensics_captures_total", trigger="request") == 0


def test_classify_reads_py_spys_error_texts():
    assert classify("Error: Failed to get process executable name. Check that the process is running.") == \
        "no_process"
    assert classify("Error: Failed to find python version from target process") == "failed"


def test_the_folder_keeps_the_newest_captures_within_its_caps(tmp_path):
    clock = iter(range(1_000_000, 1_000_100)).__next__
    f = Forensics(ForensicsSettings(str(tmp_path / "f"), py_spy=str(tmp_path / "none"), max_files=2),
                  SelfMetrics(SPEC), None, clock=lambda: float(clock()))
    paths = [f.capture("request")["path"] for _ in range(3)]
    assert sorted(p.name for p in (tmp_path / "f").iterdir()) == sorted(Path(p).name for p in paths[1:])


def test_requests_within_the_gap_get_the_latest_capture(tmp_path):
    now = [1000.0]
    f = Forensics(ForensicsSettings(str(tmp_path / "f"), py_spy=str(tmp_path / "none")), SelfMetrics(SPEC), None,
                  clock=lambda: now[0])
    first = f.requested("a")
    now[0] += 1
    assert f.requested("b") is first
    now[0] += 10
    assert f.requested("c")["path"] != first["path"]


@pytest.mark.integration
def test_a_request_during_a_capture_gets_that_capture(tmp_path):
    """The relay's request comes while the stall's capture runs (a native dump takes seconds): it waits for it
    instead of pausing the trainer a second time."""
    import threading

    slow = tmp_path / "py-spy"
    slow.write_text("#!/bin/sh\nsleep 1\necho '[]'\n")
    slow.chmod(0o755)
    target = subprocess.Popen(["sleep", "30"])
    try:
        f = Forensics(ForensicsSettings(str(tmp_path / "f"), py_spy=str(slow), native=False), SelfMetrics(SPEC),
                      target.pid)
        stall = threading.Thread(target=f.capture, args=("stall",))
        stall.start()
        while f._lock.acquire(blocking=False):  # until the capture holds the lock
            f._lock.release()
        answer = f.requested("VerlTrainingStalled")
        stall.join()
    finally:
        target.kill()
        target.wait()
    assert answer["trigger"] == "stall" and len(list((tmp_path / "f").iterdir())) == 1


@pytest.mark.integration
def test_the_stall_trigger_is_the_specs_stall_alerts_on_the_store(tmp_path, sleeper):
    store = TrainingStore(SPEC, SelfMetrics(SPEC))
    for step in range(1, 13):
        store.ingest(step, {"timing_s/step": 60.0}, 1000.0 + 60 * step)
    f, metrics = forensics(tmp_path, sleeper.pid)
    watch = StallWatch(SPEC, store, f)
    assert {a.alert for a in watch.alerts} == {"VerlTrainingStalled", "VerlTrainingStalledRelative"}
    last = store.step_time
    relative = next(a for a in watch.alerts if a.alert == "VerlTrainingStalledRelative")
    assert watch.check(last + relative.at_least - 1) is None  # under the alert's floor: no stall yet
    doc = watch.check(last + relative.at_least + 1)
    assert doc["trigger"] == "stall" and doc["reason"].startswith("VerlTrainingStalledRelative: no step for")
    assert doc["step"] == 12 and "slow_reward" in doc["verdict"]
    assert watch.check(last + 3600) is None  # once per stall
    store.ingest(13, {"timing_s/step": 60.0}, last + 3600)
    assert watch.check(last + 3601) is None  # the run moved
    assert watch.check(last + 3600 + relative.at_least + 1)["step"] == 13  # a new stall, a new capture
    assert metrics.value("verl_exporter_forensics_captures_total", trigger="stall") == 2


# ---------------------------------------------------------------- the verdict across ranks
def thread(*frames: tuple[str, str], name="MainThread") -> dict:
    return {"thread_name": name, "frames": [{"name": n, "short_filename": f, "module": None} for n, f in frames]}


COLLECTIVE = [("all_reduce", "torch/distributed/distributed_c10d.py"),
              ("wrapper", "torch/distributed/c10d_logger.py"), ("update_actor", "verl/workers/fsdp_workers.py")]
REWARD = [("compute_score", "my_reward.py"), ("reward_fn", "verl/trainer/ppo/reward.py")]


def test_the_verdict_names_the_odd_rank():
    procs = [{"rank": str(r), "pid": 100 + r, "threads": [thread(*COLLECTIVE)]} for r in range(7)]
    procs.append({"rank": "7", "pid": 107, "threads": [thread(("wait", "threading.py"), name="Thread-1"),
                                                       thread(*REWARD)]})
    assert verdict(procs) == ("ranks 0-6 wait in all_reduce (torch/distributed/distributed_c10d.py), called from "
                              "update_actor (verl/workers/fsdp_workers.py); rank 7 is in reward_fn → compute_score "
                              "(my_reward.py)")


def test_the_verdict_of_ranks_all_alike_and_of_ranks_without_a_stack():
    procs = [{"rank": str(r), "threads": [thread(*COLLECTIVE)]} for r in (0, 1, 2)]
    procs.append({"rank": "5", "reason": "permission"})
    procs.append({"rank": None, "pid": 9, "threads": [thread(("_try_wait", "subprocess.py"))]})  # the launcher
    assert verdict(procs) == ("all ranks 0-2 wait in all_reduce (torch/distributed/distributed_c10d.py), called "
                              "from update_actor (verl/workers/fsdp_workers.py); no stack from 5")


def test_native_frames_are_left_out_of_the_verdict():
    native = {"name": "pthread_cond_wait", "short_filename": "libc.so.6", "module": "/lib/libc.so.6"}
    t = thread(*REWARD)
    t["frames"].insert(0, native)
    assert verdict([{"rank": "0", "threads": [t]}]) == "rank 0 is in reward_fn → compute_score (my_reward.py)"


def test_ranges():
    assert ranges(["3", "0", "1", "2", "7", "9", "10"]) == "0-3, 7, 9-10"
    # an iterator is read once: the labels that are not numbers were lost to the pass over the numbers
    assert ranges(iter(["1", "0", "pid 7"])) == "0-1, pid 7"


def test_captures_of_several_sidecars_merge_into_one_verdict(tmp_path):
    """A shared forensics directory: each sidecar's latest capture counts, each rank once."""
    def capture(host, t, ranks, frames):
        doc = {"host": host, "run": "r1", "rank": ranks[0], "time": t,
               "processes": [{"rank": r, "threads": [thread(*frames)]} for r in ranks]}
        (tmp_path / f"capture-{host}-{t}.json").write_text(json.dumps(doc))

    capture("node0", 1, ["0", "1"], REWARD)  # older: replaced by node0's next capture
    capture("node0", 2, ["0", "1"], COLLECTIVE)
    capture("node1", 2, ["2", "3"], COLLECTIVE)
    capture("node2", 2, ["4"], REWARD)
    (tmp_path / "capture-broken.json").write_text("{not json")
    assert verdict(merge(read_captures([str(tmp_path)]))) == (
        "ranks 0-3 wait in all_reduce (torch/distributed/distributed_c10d.py), called from update_actor "
        "(verl/workers/fsdp_workers.py); rank 4 is in reward_fn → compute_score (my_reward.py)")


def fr_dump(*seqs: int) -> dict:
    """The part of a Flight Recorder dump the verdict reads, as torch 2.13's _dump_fr_trace_json writes it for a
    gloo group (the real dumps are read in test_forensics_hang.py)."""
    return {"version": "2.10", "entries": [{"collective_seq_id": s, "pg_id": 0, "profiling_name": "gloo:all_reduce",
                                           "state": "scheduled"} for s in seqs]}


def test_the_cli_gives_the_verdict_of_a_shared_folder(tmp_path, capsys):
    from verl_exporter.cli import main

    for host, ranks, frames in (("node0", ["0", "1"], COLLECTIVE), ("node1", ["2"], REWARD)):
        doc = {"host": host, "time": 1, "processes": [{"rank": r, "threads": [thread(*frames)]} for r in ranks]}
        (tmp_path / f"capture-{host}.json").write_text(json.dumps(doc))
    assert main(["forensics", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("ranks 0-1 wait in all_reduce")
    assert main(["forensics", str(tmp_path / "empty")]) == 1


def test_flight_recorder_names_the_rank_and_the_collective_where_ranks_diverge(tmp_path):
    for rank, last in enumerate([5, 4, 5, 5]):
        (tmp_path / f"fr_rank_{rank}.json").write_text(json.dumps(fr_dump(*range(1, last + 1))))
    (tmp_path / "fr_rank_9.pickle").write_bytes(b"not read")
    dumps = read_flight_recorder(str(tmp_path / "fr_rank_"))
    assert sorted(dumps) == [0, 1, 2, 3]
    assert flight_recorder_verdict(dumps) == ("Flight Recorder: ranks 0, 2-3 entered collective #5 "
                                              "(gloo:all_reduce); rank 1 never did (last: 1 at #4)")
    assert flight_recorder_verdict({0: fr_dump(1, 2), 1: fr_dump(1, 2)}) is None  # in step: nothing to name


def test_stacks_are_never_captured_unless_switched_on(tmp_path):
    from verl_exporter.sidecar.config import build_config
    from verl_exporter.sidecar.sidecar import Sidecar

    side = Sidecar(build_config({}, {"listen": "127.0.0.1:0"}))
    assert side.forensics is None and side.stall_watch is None
    assert "forensics" not in side.health()[1]


def test_the_kubernetes_patch_switches_forensics_on_with_what_ptrace_needs():
    import yaml
    from verl_exporter.cli import build_parser
    from verl_exporter.sidecar.config import build_config, flag_values

    doc = yaml.safe_load((REPO / "docker/kubernetes/sidecar-forensics.patch.yaml").read_text())
    pod = doc["spec"]["template"]["spec"]
    [sidecar] = pod["initContainers"]
    assert pod["shareProcessNamespace"] is True
    assert sidecar["securityContext"]["capabilities"]["add"] == ["SYS_PTRACE"]
    args = vars(build_parser().parse_args(sidecar["args"]))
    config = build_config({}, flag_values(args))
    assert config.forensics_dir in {m["mountPath"] for m in sidecar["volumeMounts"]}
    assert {v["name"] for v in pod["volumes"]} >= {m["name"] for m in sidecar["volumeMounts"]}


@pytest.mark.parametrize("name, cmdline, expected", [
    ("ray::TaskRunner", ["ray::TaskRunner.run"], True),  # verl's driver runs in this actor
    ("python", ["ray::WorkerDict.actor_rollout_generate_sequences"], True),
    ("python3", ["python3", "/venv/lib/python3.11/site-packages/ray/_private/workers/default_worker.py"], True),
    ("raylet", ["/venv/lib/ray/core/src/ray/raylet/raylet"], False),
    ("python3", ["python3", "-m", "verl.trainer.main_ppo", "ray_kwargs.ray_init.num_cpus=8"], False),
])
def test_the_nodes_ray_workers_are_found_by_command_line(name, cmdline, expected):
    from verl_exporter.sidecar.collectors.gpu_processes import looks_like_ray_worker

    assert looks_like_ray_worker(name, cmdline) is expected


@pytest.mark.integration
def test_a_sidecar_in_the_trainers_tree_does_not_dump_itself(tmp_path, sleeper):
    from verl_exporter.sidecar.forensics import targets

    pids = [p.pid for p in targets(os.getppid())]  # this test's parent: its tree holds this process
    assert os.getpid() not in pids and os.getppid() in pids


# ---------------------------------------------------------------- capture files as hostile input
def _good_capture(tmp_path, host="node0", ranks=("0", "1")):
    doc = {"host": host, "time": 1, "processes": [{"rank": r, "threads": [thread(*COLLECTIVE)]} for r in ranks]}
    (tmp_path / f"capture-{host}.json").write_text(json.dumps(doc))


BAD_CAPTURES = {
    "deep": "[" * 100000 + "]" * 100000,
    "deep_object": '{"processes": ' + "[" * 100000 + "]" * 100000 + "}",
    "not_json": "{not json",
    "a_list": "[1, 2]",
    "huge_int": '{"time": ' + "9" * 5000 + "}",
    "not_utf8": "\udcff",
}


def test_a_deeply_nested_or_broken_capture_is_one_line_and_the_verdict_is_still_given(tmp_path, capsys):
    from verl_exporter.cli import main

    _good_capture(tmp_path)
    for name, text in BAD_CAPTURES.items():
        (tmp_path / f"capture-{name}.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    assert main(["forensics", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("all ranks 0-1 wait in all_reduce")
    lines = err.strip().splitlines()
    assert len(lines) == len(BAD_CAPTURES) and "Traceback" not in err
    for name in BAD_CAPTURES:
        assert sum(f"capture-{name}.json" in line for line in lines) == 1


ODD_PROCESSES = [None, 5, "x", [], {"rank": [1], "threads": 3}, {"rank": {"a": 1}, "threads": {"frames": 1}},
                 {"rank": "9" * 5000, "threads": [{"frames": 7}]}, {"rank": True, "threads": [{"frames": [5, None]}]},
                 {"rank": 1e400, "pid": [], "threads": [{"thread_name": "MainThread", "frames": [{"name": []}]}]}]


@pytest.mark.parametrize("odd", ODD_PROCESSES)
def test_a_capture_of_odd_values_costs_only_itself(tmp_path, odd):
    doc = {"host": "node0", "time": "yesterday", "processes": [odd, {"rank": "0", "threads": [thread(*COLLECTIVE)]}]}
    other = {"host": [1], "run": {"a": 1}, "time": [2], "processes": {"rank": "1"}}
    (tmp_path / "capture-a.json").write_text(json.dumps(doc))
    (tmp_path / "capture-b.json").write_text(json.dumps(other))
    text = verdict(merge(read_captures([str(tmp_path)])))
    assert "in all_reduce" in text and len(text) <= 600


def test_odd_flight_recorder_dumps_are_skipped(tmp_path):
    for rank, last in enumerate([5, 4]):
        (tmp_path / f"fr_rank_{rank}.json").write_text(json.dumps(fr_dump(*range(1, last + 1))))
    (tmp_path / "fr_rank_2.json").write_text("[" * 100000 + "]" * 100000)
    (tmp_path / "fr_rank_3.json").write_text(json.dumps({"entries": [{"collective_seq_id": "x"},
                                                                     {"collective_seq_id": None}, 5]}))
    (tmp_path / "fr_rank_4.json").write_text(json.dumps({"entries": [{"collective_seq_id": 1e300}]}))
    dumps = read_flight_recorder(str(tmp_path / "fr_rank_"))
    assert "rank 1 never did" in (flight_recorder_verdict(dumps) or "")


_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(10**30), 10**30), st.floats(), st.text(max_size=8)),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["processes", "threads", "frames", "rank", "pid", "host", "run", "time", "name",
                         "module", "filename", "short_filename", "thread_name", "entries", "collective_seq_id"]),
        inner, max_size=4), max_leaves=16)


@settings(max_examples=300, deadline=None)
@given(st.lists(_values, max_size=4))
def test_any_capture_documents_give_a_verdict_without_raising(docs):
    captures = [d for d in docs if isinstance(d, dict)]
    text = verdict(merge(captures))
    assert isinstance(text, str) and len(text) <= 600
    flight_recorder_verdict({i: d for i, d in enumerate(captures)})
def fake_forensics(tmp_path, clock, max_files=20, folder="f", rank="0") -> Forensics:
    """A Forensics whose captures need no process (no trainer pid, no py-spy): the folder's rules alone."""
    return Forensics(ForensicsSettings(str(tmp_path / folder), py_spy=str(tmp_path / "none"), max_files=max_files),
                     SelfMetrics(SPEC), None, {"run": "r1", "rank": rank}, clock=clock)


def test_another_hosts_capture_that_sorts_later_is_never_pruned_nor_the_answer(tmp_path):
    """A shared folder: another host's capture named later than ours (its clock ahead) is not ours to remove, and
    the capture answered is still there."""
    (tmp_path / "f").mkdir()
    theirs = tmp_path / "f" / "capture-29991231T235959-999.json"
    theirs.write_text("{}")
    also_theirs = tmp_path / "f" / "capture-29991231T235959-998+other-host-rank0.json"
    also_theirs.write_text("{}")
    now = [1_000_000.0]
    f = fake_forensics(tmp_path, lambda: now[0], max_files=1)
    for _ in range(3):
        now[0] += 60
        path = f.requested()["path"]
        assert Path(path).exists()
    assert theirs.exists() and also_theirs.exists()
    assert len(list((tmp_path / "f").glob(f"capture-*+{f._tag}.json"))) == 1


def test_a_clock_stepped_back_prunes_the_oldest_capture_in_the_order_written(tmp_path):
    now = [2_000_000.0]
    f = fake_forensics(tmp_path, lambda: now[0], max_files=2)
    written = []
    for _ in range(2):
        now[0] += 60
        written.append(Path(f.capture("request")["path"]))
    assert all(p.exists() for p in written)
    now[0] = 1_000_000.0  # the clock steps back: the next capture's name sorts before both, its mtime may too
    answered = Path(f.capture("request")["path"])
    assert answered.exists() and not written[0].exists() and written[1].exists()


def test_a_restarted_sidecar_prunes_its_earlier_captures_not_others(tmp_path):
    now = [1_000_000.0]
    first = fake_forensics(tmp_path, lambda: now[0], max_files=2)
    old = []
    for _ in range(2):
        now[0] += 60
        old.append(Path(first.capture("request")["path"]))
    other_rank = fake_forensics(tmp_path, lambda: now[0], max_files=1, rank="1")
    now[0] += 60
    kept = Path(other_rank.capture("request")["path"])
    again = fake_forensics(tmp_path, lambda: now[0], max_files=2)  # the rank-0 sidecar restarted
    now[0] += 60
    answered = Path(again.capture("request")["path"])
    assert answered.exists() and kept.exists() and old[1].exists() and not old[0].exists()


def test_a_cached_answer_whose_file_is_gone_is_captured_again(tmp_path):
    now = [1_000_000.0]
    f = fake_forensics(tmp_path, lambda: now[0])
    first = f.requested()
    Path(first["path"]).unlink()  # an operator's clean-up
    now[0] += 1
    second = f.requested()
    assert second is not first and Path(second["path"]).exists()


def test_an_existing_folder_keeps_its_mode_and_a_new_one_is_private(tmp_path):
    shared = tmp_path / "run"
    shared.mkdir()
    shared.chmod(0o755)
    f = fake_forensics(tmp_path, lambda: 1_000_000.0, folder="run")
    path = Path(f.capture("request")["path"])
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755 and stat.S_IMODE(path.stat().st_mode) == 0o600
    made = fake_forensics(tmp_path, lambda: 1_000_000.0, folder="new/forensics")
    assert stat.S_IMODE(Path(made.capture("request")["path"]).parent.stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o700
