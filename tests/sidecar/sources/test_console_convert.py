"""scripts/verl_console_to_jsonl.py: every shape of verl console log real runs leave behind."""

from __future__ import annotations

import gzip
import importlib.util
import json

import pytest
from conftest import REPO

_spec = importlib.util.spec_from_file_location("verl_console_to_jsonl", REPO / "scripts" / "verl_console_to_jsonl.py")
conv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(conv)

ESC = "\x1b"


def run(tmp_path, text, *args, name="console.log"):
    src = tmp_path / name
    src.write_text(text, encoding="utf-8")
    out = tmp_path / "out.jsonl"
    rc = conv.main([str(src), "-o", str(out), *args])
    return rc, ([json.loads(x) for x in out.read_text().splitlines()] if rc == 0 else None)


def test_plain_lines_become_one_record_per_step(tmp_path):
    text = ("some startup noise\n"
            "step:1 - actor/pg_loss:0.012 - critic/score/mean:-0.5 - timing_s/step:12.5\n"
            "Training Progress:  1%|          | 1/100\n"
            "step:2 - actor/pg_loss:-0.003 - critic/score/mean:-0.25 - timing_s/step:11.0\n")
    rc, records = run(tmp_path, text)
    assert rc == 0
    assert records == [
        {"step": 1, "data": {"actor/pg_loss": 0.012, "critic/score/mean": -0.5, "timing_s/step": 12.5}},
        {"step": 2, "data": {"actor/pg_loss": -0.003, "critic/score/mean": -0.25, "timing_s/step": 11.0}},
    ]


def test_ray_prefix_and_ansi_colours_are_stripped(tmp_path):
    text = (f"{ESC}[36m(main_task pid=19799){ESC}[0m step:3 - critic/kl:0.017 - timing/step:8.8\n"
            f"{ESC}[36m(TaskRunner pid=1, ip=10.4.1.33){ESC}[0m step:4 - critic/kl:0.02 - timing/step:9.1\n")
    rc, records = run(tmp_path, text)
    assert rc == 0
    assert [r["step"] for r in records] == [3, 4]
    assert records[1]["data"] == {"critic/kl": 0.02, "timing/step": 9.1}


def test_one_key_per_line_records_are_joined(tmp_path):
    text = ("(TaskRunner pid=15930, ip=10.4.1.33) step:1\n"
            " - actor/entropy:0.364\n"
            " - training/global_step:1\n"
            "(TaskRunner pid=15930, ip=10.4.1.33)  - response_length/mean:424.5\n"
            "(TaskRunner pid=15930, ip=10.4.1.33) step:2\n"
            " - actor/entropy:0.35\n"
            "validation generation end\n"
            " - not/part_of_the_step:1\n")
    rc, records = run(tmp_path, text)
    assert rc == 0
    assert records[0]["data"] == {"actor/entropy": 0.364, "training/global_step": 1, "response_length/mean": 424.5}
    assert records[1]["data"] == {"actor/entropy": 0.35}


def test_numpy_reprs_nan_and_inf_are_written_like_verls_file_logger(tmp_path):
    text = ("step:1 - actor/pg_loss:np.float64(0.035) - perf/total_num_tokens:np.int64(4388173)"
            " - actor/grad_norm:nan - critic/vf_loss:inf - actor/ppo_kl:-inf - x/wrapped:np.float64(nan)"
            " - actor/lr(1e-4):0.010 - my/tag:warmup\n")
    rc, records = run(tmp_path, text)
    assert rc == 0
    assert records[0]["data"] == {
        "actor/pg_loss": 0.035, "perf/total_num_tokens": 4388173, "actor/grad_norm": None,
        "critic/vf_loss": None, "actor/ppo_kl": None, "x/wrapped": None, "actor/lr(1e-4)": 0.01,
        "my/tag": "warmup",  # not a number: kept, never dropped
    }
    raw = (tmp_path / "out.jsonl").read_text()
    assert "NaN" not in raw and "Infinity" not in raw  # strict JSON, nulls like orjson


def test_python_bools_are_written_as_json_bools(tmp_path):
    """A config flag logged as a metric prints as True/False; verl's file logger writes true/false (a public
    agent run logged actor/use_cached_prefix_old_logprob: True on every step)."""
    rc, records = run(tmp_path, "step:1 - actor/use_cached:True - actor/other:False - my/tag:TRUE\n")
    assert rc == 0
    assert records[0]["data"] == {"actor/use_cached": True, "actor/other": False, "my/tag": "TRUE"}


def test_global_step_and_time_per_step_keys_are_not_step_lines(tmp_path):
    text = "step:7 - training/global_step:7 - perf/time_per_step:3.0 - train/step:9\n"
    rc, records = run(tmp_path, text)
    assert rc == 0
    assert records == [{"step": 7, "data": {"training/global_step": 7, "perf/time_per_step": 3.0, "train/step": 9}}]


def test_carriage_return_progress_bars_do_not_hide_a_step_line(tmp_path):
    text = "Epoch 1:  50%|#####     | 1/2\rstep:1 - actor/lr:1e-06\r\n"
    rc, records = run(tmp_path, text)
    assert rc == 0 and records == [{"step": 1, "data": {"actor/lr": 1e-06}}]


def test_several_runs_need_a_choice_and_each_can_be_picked(tmp_path, capsys):
    text = "".join(f"step:{s} - a/b:{s}\n" for s in (1, 2, 3)) + "".join(f"step:{s} - a/b:{10 + s}\n" for s in (1, 2))
    rc, _ = run(tmp_path, text)
    assert rc == 1
    err = capsys.readouterr().err
    assert "2 runs" in err and "--run" in err and "steps 1-3" in err and "steps 1-2" in err
    rc, second = run(tmp_path, text, "--run", "2")
    assert rc == 0 and second == [{"step": 1, "data": {"a/b": 11}}, {"step": 2, "data": {"a/b": 12}}]
    rc, _ = run(tmp_path, text, "--run", "3")
    assert rc == 1 and "no run 3" in capsys.readouterr().err


def test_a_repeated_step_starts_a_new_run(tmp_path):
    runs = conv.split_runs(conv.parse_records("step:5 - a:1\nstep:5 - a:2\nstep:6 - a:3\n"))
    assert [[s for s, _ in r] for r in runs] == [[5], [5, 6]]


@pytest.mark.parametrize("text", ["", "no steps here\njust noise\n", "global_step:3 - a:1\n", "step:x - a:1\n"])
def test_a_log_without_step_lines_is_a_clear_error(tmp_path, capsys, text):
    rc, _ = run(tmp_path, text)
    assert rc == 1
    assert "no verl step lines" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()  # nothing half-written


def test_a_missing_file_is_a_clear_error(tmp_path, capsys):
    assert conv.main([str(tmp_path / "absent.log")]) == 1
    assert "absent.log" in capsys.readouterr().err


def test_notebook_outputs_are_read(tmp_path):
    nb = {"cells": [
        {"cell_type": "code", "source": ["!python train.py"], "outputs": [
            {"output_type": "stream", "name": "stdout",
             "text": ["(main_task pid=1) step:0 - critic/kl:0.000 - actor/entropy_loss:0.461\n",
                      "(main_task pid=1) step:1 - critic/kl:0.001 - actor/entropy_loss:0.45\n"]}]},
        {"cell_type": "markdown", "source": ["step:99 - in/markdown:1"]},
    ]}
    rc, records = run(tmp_path, json.dumps(nb), name="nb.ipynb")
    assert rc == 0
    assert records == [{"step": 0, "data": {"critic/kl": 0.0, "actor/entropy_loss": 0.461}},
                       {"step": 1, "data": {"critic/kl": 0.001, "actor/entropy_loss": 0.45}}]


def test_step_range_and_gzip_output_are_reproducible(tmp_path):
    src = tmp_path / "c.log"
    src.write_text("".join(f"step:{s} - a/b:{s}\n" for s in range(1, 6)))
    outs = []
    for name in ("a.jsonl.gz", "b.jsonl.gz"):
        assert conv.main([str(src), "-o", str(tmp_path / name), "--first-step", "2", "--last-step", "4"]) == 0
        outs.append((tmp_path / name).read_bytes())
    assert outs[0] == outs[1]  # no timestamp in the gzip header: regenerating does not churn
    lines = gzip.decompress(outs[0]).decode().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [2, 3, 4]


def test_every_printed_pair_survives_the_round_trip(tmp_path):
    pairs = {f"k{i}/m": v for i, v in enumerate(["0.5", "-1", "3e-05", "np.float64(2.5)", "nan", "text"])}
    text = "step:1 - " + " - ".join(f"{k}:{v}" for k, v in pairs.items()) + "\n"
    rc, records = run(tmp_path, text)
    assert rc == 0
    assert set(records[0]["data"]) == set(pairs)


def test_a_value_cut_off_with_its_line_is_dropped_not_kept_as_text(tmp_path, capsys):
    # wandb's output.log cuts console lines at 4096 characters: the last value is then a cut-off repr.
    head = "step:20 - critic/score/mean:-0.5 - val-aux/aime/score/mean:np.float64(-0.22"
    rc, records = run(tmp_path, head + "\nstep:21 - critic/score/mean:-0.4 - a/b:np.float64(0.5)\n")
    assert rc == 0
    assert records[0]["data"] == {"critic/score/mean": -0.5}
    assert records[1]["data"] == {"critic/score/mean": -0.4, "a/b": 0.5}
    assert "1 cut-off value" in capsys.readouterr().err


def test_the_last_number_of_a_line_cut_at_4096_characters_is_dropped(tmp_path):
    # A plain number at the cut may have lost digits (0.0392999 of 0.039299999999...): not to be trusted.
    body = "step:30 - critic/score/mean:-0.5 - " + " - ".join(f"val-aux/k{i}/mean:0.25" for i in range(200))
    tail = " - x/y:0.0393"
    line = body[:4096 - len(tail)] + tail
    assert len(line) == 4096
    rc, records = run(tmp_path, line + "\n")
    assert rc == 0
    assert "x/y" not in records[0]["data"] and records[0]["data"]["critic/score/mean"] == -0.5


def test_a_cut_off_value_on_a_one_key_per_line_record_does_not_end_the_record(tmp_path):
    rc, records = run(tmp_path, "step:1\n - a/b:np.float64(0.3\n - c/d:2\n")
    assert rc == 0 and records == [{"step": 1, "data": {"c/d": 2}}]


def test_numbers_beyond_pythons_digit_limit_are_not_nans_and_do_not_crash(tmp_path):
    # A 5,000-digit integer became null (a NaN: a false NaN alert); a 5,000-digit step raised ValueError.
    huge = "1" * 5000
    rc, records = run(tmp_path, f"step:1 - a:{huge} - b:np.int64({huge}) - c:1e999 - d:0.5\nstep:{huge} - a:1\n")
    assert rc == 0 and len(records) == 1
    assert records[0]["data"] == {"a": huge, "b": huge, "c": None, "d": 0.5}  # text: never a number, not dropped


def test_only_numbers_as_python_prints_them_are_numbers(tmp_path):
    # int() and float() also read "1_000" and other scripts' digits ("٣"): verl never prints those for numbers.
    rc, records = run(tmp_path, "step:1 - a:1_000 - b:\u0663 - c:1.5e+20 - d:-7 - e:.5 - f:-inf\n")
    assert rc == 0
    assert records[0]["data"] == {"a": "1_000", "b": "\u0663", "c": 1.5e20, "d": -7, "e": 0.5, "f": None}
