"""Property-based fuzzing of the inputs that had no fuzz test (tests/boundaries.py lists them all): files the pack
wrote itself and reads back (control file, journal, spool, checkpoint tracker and manifest, stack captures'
folder), files of others (Flight Recorder dumps, py-spy's output, /proc, the token file), the control endpoint's
request, and the environment and argv.

Invariants: the reader raises nothing but its documented error (or none at all), returns a value of its own
type, bounded, and the caller keeps working; nothing hangs.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
from pathlib import Path
from unittest import mock

import pytest
from helpers import FIXTURES
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from verl_exporter.exposition.selfmetrics import SelfMetrics
from verl_exporter.sidecar.config import ServeConfig
from verl_exporter.spec import load_spec

SPEC = load_spec()
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FEW = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])  # fsyncs per example

json_scalars = (st.none() | st.booleans() | st.integers(-10**30, 10**30) | st.floats(allow_nan=True)
                | st.text(max_size=20) | st.sampled_from(["9" * 5000, "1e999", "-1", "NaN", "²", "0x10"]))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=20)


def _dump(value) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


def hostile_json(keys: list[str]):
    """Documents shaped like the file a reader expects (its own keys), with values of any JSON type."""
    return st.dictionaries(st.sampled_from(keys) | st.text(max_size=8), json_values, max_size=8)


def file_bytes(keys: list[str]):
    """A file's bytes: random, JSON of the expected shape, or that cut anywhere, or nested past any limit."""
    return (st.binary(max_size=300) | hostile_json(keys).map(_dump)
            | st.tuples(hostile_json(keys).map(_dump), st.integers(0, 200)).map(lambda t: t[0][:t[1]])
            | st.sampled_from([b"[" * 5000, b'{"a":' * 5000]))


@pytest.fixture(scope="module")
def folder():
    with tempfile.TemporaryDirectory() as d:
        yield Path(d)


# ---------------------------------------------------------------- the control file (sidecar writes, trainer reads)
CONTROL_KEYS = ["version", "checkpoint_seq", "checkpoint_id", "checkpoint_time", "checkpoint_reason", "stop",
                "stop_id", "stop_time", "stop_reason", "reason"]


@FUZZ
@given(raw=file_bytes(CONTROL_KEYS))
def test_any_control_file_is_read_or_refused_and_never_stops_the_trainer_or_the_sidecar(folder, raw):
    from verl_exporter.sidecar.control import ControlReader, ControlState, read_control_file

    path = folder / "control.json"
    path.write_bytes(b"{}")
    reader = ControlReader(str(path))
    path.write_bytes(raw)
    try:
        _, doc = read_control_file(path)
        assert isinstance(doc, dict)
    except (OSError, ValueError, RecursionError):
        pass
    reader.poll()  # never raises into the trainer's step
    assert isinstance(reader.take_checkpoint_request(), bool) and isinstance(reader.reason, str)
    assert len(reader.reason) <= 200 and "\n" not in reader.reason
    recorded = ControlState(str(path)).request("checkpoint", "fuzz")  # the sidecar writes over whatever was there
    assert recorded.state["checkpoint_seq"] >= 1 and read_control_file(path)[1]["checkpoint_id"] == recorded.id


# ---------------------------------------------------------------- the control endpoint's request
@FUZZ
@given(action=st.sampled_from(["checkpoint", "stop", "forensics", "", "x" * 300, "../stop"]),
       method=st.sampled_from(["POST", "GET", "PUT", ""]),
       auth=st.sampled_from([None, "Bearer tok", "Bearer tok ", "bearer tok", "Bearer " + "t" * 10_000, "Basic x"]),
       length=st.sampled_from([None, "", "-1", "abc", "99999999999999999999", "5000"]) | st.integers(0, 400).map(str),
       body=st.binary(max_size=300) | hostile_json(["reason"]).map(_dump))
def test_the_control_endpoint_answers_any_request_with_json_and_a_known_status(folder, action, method, auth, length,
                                                                              body):
    from verl_exporter.sidecar.control import ControlState, make_control_app
    from verl_exporter.sidecar.forensics import Forensics, ForensicsSettings

    metrics = SelfMetrics(SPEC)
    forensics = Forensics(ForensicsSettings(str(folder / "forensics"), py_spy=str(folder / "none")), metrics)
    app = make_control_app(ControlState(str(folder / "ctl.json")), "tok", metrics, forensics)
    environ = {"PATH_INFO": "/control/" + action, "REQUEST_METHOD": method, "wsgi.input": io.BytesIO(body)}
    if auth is not None:
        environ["HTTP_AUTHORIZATION"] = auth
    if length is not None:
        environ["CONTENT_LENGTH"] = length
    status = []
    out = app(environ, lambda code, headers: status.append(code))
    answer = json.loads(b"".join(out))
    assert status[0].split()[0] in {"200", "400", "401", "404", "405", "408", "413", "503"}
    assert isinstance(answer, dict) and "tok" not in json.dumps(answer).replace("token", "")


# ---------------------------------------------------------------- the stack captures' folder (shared with others)
entry_names = st.sampled_from(["capture-20300101T000000-000.json", "capture-x+{tag}.json",
                               "capture-20200101T000000-000+{tag}.json", "capture-+{tag}.json",
                               "capture-z+other.json", "notes.txt", ".capture-a+{tag}.json.1.tmp"])
entry_kinds = st.sampled_from(["file", "dir", "link", "dangling"])


@FEW
@given(entries=st.lists(st.tuples(entry_names, entry_kinds, st.binary(max_size=50)), max_size=8),
       max_files=st.integers(1, 3), captures=st.integers(1, 4))
def test_any_folder_keeps_what_is_not_ours_and_the_answered_capture(entries, max_files, captures):
    from verl_exporter.sidecar.forensics import Forensics, ForensicsSettings

    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        target, folder = root / "outside.txt", root / "f"
        target.write_text("not ours")
        folder.mkdir()
        now = [1_000_000.0]
        f = Forensics(ForensicsSettings(str(folder), py_spy=str(root / "none"), max_files=max_files),
                      SelfMetrics(SPEC), None, {"rank": "0"}, clock=lambda: now[0])
        foreign = set()
        for name, kind, data in entries:
            path = folder / name.format(tag=f._tag)
            if os.path.lexists(path):
                continue
            if kind == "file":
                path.write_bytes(data)
            elif kind == "dir":
                path.mkdir()
            else:
                path.symlink_to(target if kind == "link" else root / "gone")
            if kind != "file" or not path.name.endswith(f"+{f._tag}.json") or path.name.startswith("."):
                foreign.add(path.name)
        for _ in range(captures):
            now[0] += 60
            answered = f.capture("request")["path"]
            assert answered and Path(answered).is_file()
        names = {p.name for p in folder.iterdir()}
        assert foreign <= names and target.read_text() == "not ours"
        assert len([n for n in names - foreign if n.endswith(f"+{f._tag}.json")]) <= max_files


# ---------------------------------------------------------------- py-spy's output, and the verdict over it
frames = st.lists(st.dictionaries(st.sampled_from(["name", "filename", "short_filename", "module", "line"]),
                                  json_values, max_size=5) | json_values, max_size=4)
threads = st.lists(st.dictionaries(st.sampled_from(["thread_name", "frames", "active", "owns_gil"]),
                                   frames | json_values, max_size=4) | json_values, max_size=3)


@FUZZ
@given(outputs=st.lists(st.tuples(st.none() | st.integers(0, 99).map(str), threads | json_values
                                  | st.binary(max_size=40)), max_size=4))
def test_the_verdict_names_something_for_any_py_spy_output(outputs):
    from verl_exporter.core.verdict import verdict
    from verl_exporter.sidecar.forensics import HINTS, parse_dump

    captured = [parse_dump(100 + i, out if isinstance(out, bytes) else _dump(out)) | {"rank": rank}
                for i, (rank, out) in enumerate(outputs)]
    assert all("threads" in p or p["reason"] in HINTS for p in captured)
    assert isinstance(verdict(captured), str)


# ---------------------------------------------------------------- NCCL Flight Recorder dumps
@FUZZ
@given(dumps=st.lists(file_bytes(["version", "entries", "pg_config"]), min_size=1, max_size=3),
       entries=st.lists(st.dictionaries(st.sampled_from(["collective_seq_id", "pg_id", "profiling_name", "state"]),
                                        json_values, max_size=4), max_size=4))
def test_any_flight_recorder_dump_gives_a_verdict_or_none(folder, dumps, entries):
    from verl_exporter.core.verdict import flight_recorder_verdict, read_flight_recorder

    for old in folder.glob("fr_*"):
        old.unlink()
    for rank, raw in enumerate(dumps):
        (folder / f"fr_{rank}").write_bytes(raw)
    (folder / f"fr_{len(dumps)}").write_bytes(_dump({"version": "2.10", "entries": entries}))
    result = flight_recorder_verdict(read_flight_recorder(str(folder / "fr_")))
    assert result is None or isinstance(result, str)


# ---------------------------------------------------------------- checkpoint tracker and manifest
@FUZZ
@given(raw=file_bytes(["format", "format_version", "files", "step"]) | st.sampled_from([b"9" * 5000, b" 12 \n"]))
def test_any_tracker_or_manifest_is_a_step_a_problem_or_nothing(folder, raw):
    from verl_exporter.checkpoint.manifest import MANIFEST_NAME, TRACKER_NAME, read_tracker, verify_manifest

    (folder / TRACKER_NAME).write_bytes(raw)
    step = read_tracker(folder)
    assert step is None or (isinstance(step, int) and step >= 0)
    (folder / MANIFEST_NAME).write_bytes(raw)
    result = verify_manifest(folder)
    assert not result.ok and result.problems and all(isinstance(p, str) for p in result.problems)


# ---------------------------------------------------------------- the relay's journal and spool files
JOURNAL_KEYS = ["add", "done", "try", "full", "target", "receiver", "alert", "at"]


@FEW
@given(lines=st.lists(file_bytes(JOURNAL_KEYS), max_size=6))
@example(lines=[b'{"add": 1e400, "target": "t", "alert": {}}', b'{"done": [1e400]}', b'{"try": 1e400, "at": 1}'])
def test_any_journal_is_recovered_line_by_line(folder, lines):
    from verl_exporter.relay.journal import JOURNAL, Journal
    from verl_exporter.relay.metrics import RelayMetrics

    (folder / JOURNAL).write_bytes(b"\n".join(lines))
    entries, tries = Journal(folder, RelayMetrics(), 60.0).recover()
    assert isinstance(entries, list) and isinstance(tries, dict)


@FEW
@given(raw=file_bytes(["version", "alerts"]))
def test_any_spool_file_is_requeued_or_set_aside(raw):
    from verl_exporter.relay.config import parse_config
    from verl_exporter.relay.dispatch import SPOOL_PREFIX, Dispatcher
    from verl_exporter.relay.metrics import RelayMetrics

    with tempfile.TemporaryDirectory() as d:
        spool = Path(d)
        (spool / f"{SPOOL_PREFIX}1.json").write_bytes(raw)
        config = parse_config({"targets": {"c": {"type": "console", "file": str(spool / "out.txt")}},
                               "routes": [{"targets": ["c"]}], "spool_dir": str(spool)})
        dispatcher = Dispatcher(config, RelayMetrics())
        try:
            assert dispatcher.load_spool() >= 0
        finally:
            dispatcher.journal.close(keep_pending=True)


# ---------------------------------------------------------------- /proc, as the host collectors read it
PROC_FILES = ["stat", "loadavg", "meminfo", "diskstats", "net/dev", "pressure/cpu", "pressure/io"]


READS = {"stat": "cpu", "loadavg": "host", "meminfo": "host", "diskstats": "disk", "net/dev": "network",
         "pressure/cpu": "pressure", "pressure/io": "pressure"}


@FUZZ
@given(name=st.sampled_from(sorted(READS)),
       raw=st.binary(max_size=400) | st.text(alphabet=" \n:0123456789-abcdefcpu=total.", max_size=400).map(str.encode))
def test_any_proc_file_costs_at_most_its_own_collector(name, raw):
    from prometheus_client.parser import text_string_to_metric_families
    from verl_exporter.sidecar.collectors import REGISTRY, Context
    from verl_exporter.sidecar.collectors.sampler import Sampler

    with tempfile.TemporaryDirectory() as d:
        proc = Path(d) / "proc"
        shutil.copytree(FIXTURES / "proc_t0", proc)
        (proc / name).write_bytes(raw)
        metrics = SelfMetrics(SPEC)
        ctx = Context(spec=SPEC, self_metrics=metrics, config=ServeConfig(procfs=str(proc)))
        collectors = [REGISTRY[n](ctx) for n in sorted(set(READS.values()))]
        sampler = Sampler(collectors, SPEC, metrics)
        ok = {c.name: sampler.run_once(c) for c in collectors}  # the sampler contains a collector's failure
        assert all(ok[c] for c in ok if c != READS[name])
        list(text_string_to_metric_families(sampler.render(False)))


# ---------------------------------------------------------------- the token file, the environment, argv
@FUZZ
@given(raw=st.binary(max_size=100))
def test_any_token_file_is_a_token_or_an_error_that_does_not_quote_it(folder, raw):
    from verl_exporter.sidecar.control import read_token

    path = folder / "token"
    path.write_bytes(raw)
    try:
        token = read_token(file=str(path))
    except ValueError as e:
        assert len(raw.strip()) < 4 or raw.strip().decode("utf-8", "replace") not in str(e)
    else:
        assert token and token == token.strip()


env_chars = st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00")  # what an environment holds
env_values = st.text(env_chars, max_size=12) | st.sampled_from(["9" * 5000, "²", "٣", "-1", "1e3", " 1", ""])


@FUZZ
@given(rank=env_values, local_rank=env_values)
def test_any_rank_variables_give_a_config(rank, local_rank):
    from verl_exporter.sidecar.config import build_config

    with mock.patch.dict(os.environ, {"RANK": rank, "LOCAL_RANK": local_rank}):
        config = build_config({}, {"listen": "127.0.0.1:0"})
    assert config.rank == (int(rank) if rank.isascii() and rank.isdigit() and len(rank) <= 9 else None)
    assert config.local_rank is None or 0 <= config.local_rank < 10**9


@FUZZ
@given(node_rank=env_values)
def test_any_node_rank_gives_an_offset(node_rank):
    from verl_exporter.sidecar.node import rank_offset

    with mock.patch.dict(os.environ, {"NODE_RANK": node_rank}):
        offset = rank_offset(None, 8)
    assert isinstance(offset, int) and 0 <= offset < 10**12


SERVE_FLAGS = ["--listen", "--run", "--rank", "--verl-log", "--max-line-bytes", "--hang-factor", "--trainer-pid",
               "--forensics-max-files", "--forensics-timeout", "--control-file-mode", "--labels", "--gpus"]


@FUZZ
@given(argv=st.lists(st.tuples(st.sampled_from(SERVE_FLAGS), env_values | st.sampled_from(["1", "0", "nan", "inf"])),
                     max_size=4))
def test_any_serve_flags_give_a_config_or_a_usage_error(argv):
    from verl_exporter.cli import build_parser
    from verl_exporter.sidecar.config import ConfigError, build_config, flag_values

    args = ["serve", *[x for flag, value in argv for x in (flag, value)]]
    try:
        parsed = build_parser().parse_args(args)
        build_config({}, flag_values(vars(parsed)))
    except SystemExit as e:
        assert e.code == 2
    except ConfigError:
        pass


# ---------------------------------------------------------------- console logs, recorded runs, checkpoint names
console_lines = st.lists(st.sampled_from(["step:1 - a/b:1.0", "step:2 - loss:nan - x:np.float64(2.5)",
                                          "(TaskRunner pid=1) ",
                                          "\x1b[36mstep:3\x1b[0m - c:True", "step:" + "9" * 5000 + " - a:1",
                                          "a:" + "1" * 5000, "\r", "step:1"]) | st.text(max_size=30), max_size=8)


@FUZZ
@given(lines=console_lines)
def test_any_console_text_gives_records_or_a_clear_error(lines):
    from verl_exporter.sidecar.sources.console import ConsoleLogError, convert

    try:
        records = convert("\n".join(lines))
    except ConsoleLogError:
        return
    assert all(isinstance(step, int) and isinstance(data, dict) for step, data in records)


@FUZZ
@given(lines=st.lists(file_bytes(["step", "data"]) | console_lines.map(lambda ls: "\n".join(ls).encode()),
                      max_size=5))
def test_any_run_file_is_read_or_refused_clearly(folder, lines):
    from verl_exporter.tools.replay import NotAVerlLog, read_run

    path = folder / "run.jsonl"
    path.write_bytes(b"\n".join(lines))
    try:
        kept, total = read_run(path)
    except NotAVerlLog:
        return
    assert total >= len(kept) > 0 and all(isinstance(line["data"], dict) for line in kept)


@FUZZ
@given(names=st.lists(st.sampled_from(["global_step_1", "global_step_10", "global_step_" + "9" * 200,
                                       "global_step_-1", "global_step_٣", "global_step_", "global_step_2.tmp"])
                      | st.text(st.characters(blacklist_characters="/\x00"), min_size=1, max_size=20), max_size=6))
def test_any_names_in_a_checkpoint_directory_give_its_steps_in_order(names):
    from verl_exporter.checkpoint.manifest import find_checkpoints

    with tempfile.TemporaryDirectory() as d:
        for name in names:
            if name not in (".", ".."):
                os.makedirs(Path(d) / name, exist_ok=True)
        steps = [step for step, _ in find_checkpoints(d)]
    assert steps == sorted(steps) and all(isinstance(s, int) and s >= 0 for s in steps)
    assert all(f"global_step_{s}" in names for s in steps)


@FUZZ
@given(visible=st.lists(st.sampled_from(["0", "1", "7", " 1 ", "GPU-aaaa", "gpu-b", "MIG-x", "-1", "9" * 5000, "٣",
                                         ""]) | st.text(env_chars, max_size=8), max_size=5).map(",".join))
def test_any_cuda_visible_devices_is_only_a_warning(visible):
    from verl_exporter.sidecar.collectors.nvml import Gpu, parse_cuda_visible

    gpus = [Gpu(i, f"GPU-{c * 8}", f"0000:0{i}:00.0", "H100" if i else "A100", None) for i, c in enumerate("ab")]
    picked = parse_cuda_visible(None, gpus, visible)
    assert all(g in gpus for g in picked) and len(picked) == len(set(picked))
