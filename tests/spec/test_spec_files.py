"""The spec as a directory of files, one per area (and an area's sub-area files in its folder): they load as
one spec, each problem names the file and line it is in, a name declared in two files names both, and a
single-file spec loads as before."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from helpers import REPO
from verl_exporter.spec import SpecError, area_files, load_spec, parse_spec, spec_document

PACKAGED = REPO / "exporter/verl_exporter/spec/metrics"
SCHEMA = "docker/schemas/spec.schema.json"  # from the repository's root, which is 4 folders above an area file


def metric(name: str, **more) -> dict:
    return {"name": name, "type": "gauge", "help": "X.", "layer": "data", "source": [{"match": name}], **more}


def write(folder: Path, files: dict[str, dict]) -> list[Path]:
    folder.mkdir()
    for name, doc in files.items():
        (folder / name).parent.mkdir(exist_ok=True)  # a sub-area file: NN-area/<sub-area>.yaml
        (folder / name).write_text(yaml.safe_dump(doc, sort_keys=False))
    return [folder / name for name in files]


def line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def test_the_directory_loads_as_the_concatenation_of_its_files():
    docs = [yaml.safe_load(p.read_text()) for _, p in area_files(PACKAGED)]
    whole = {k: v for doc in docs for k, v in doc.items() if k not in ("metrics", "alerts")}
    whole["metrics"] = [m for doc in docs for m in doc.get("metrics", [])]
    whole["alerts"] = [a for doc in docs for a in doc.get("alerts", [])]
    assert len(docs) > 5 and all(doc.keys() <= {"metrics", "alerts"} for doc in docs[1:])
    assert spec_document() == whole
    assert load_spec() == parse_spec(whole) == load_spec(PACKAGED)


def test_a_single_file_spec_still_loads(tmp_path):
    path = tmp_path / "custom.yaml"
    path.write_text(yaml.safe_dump(spec_document(), sort_keys=False))
    assert load_spec(path) == load_spec()
    path.write_text(path.read_text().replace("type: gauge", "type: histogram", 1))
    with pytest.raises(SpecError) as e:
        load_spec(path)
    assert e.value.problems == [f"{path}:{line_of(path, 'type: histogram')}: metrics.0.type: must be one of "
                                "'gauge' or 'counter', got 'histogram'"]


def test_an_error_in_the_third_file_names_that_file_its_line_and_its_own_index(tmp_path):
    *_, third = write(tmp_path / "spec", {
        "00-spec.yaml": {"version": 1},
        "10-a.yaml": {"metrics": [metric("verl_a"), metric("verl_b")]},
        "20-b.yaml": {"metrics": [metric("verl_c"), metric("verl_d", type="histogram")]},
    })
    with pytest.raises(SpecError) as e:
        load_spec(tmp_path / "spec")
    assert e.value.problems == [f"{third}:{line_of(third, 'histogram')}: metrics.1.type: must be one of 'gauge' "
                                "or 'counter', got 'histogram'"]


def test_a_metric_declared_in_two_files_names_both(tmp_path):
    _, first, second = write(tmp_path / "spec", {
        "00-spec.yaml": {"version": 1},
        "10-a.yaml": {"metrics": [metric("verl_a"), metric("verl_x")]},
        "20-b.yaml": {"metrics": [metric("verl_x", source=[{"match": "other"}])]},
    })
    with pytest.raises(SpecError) as e:
        load_spec(tmp_path / "spec")
    assert e.value.problems == [f"{second}:{line_of(second, 'verl_x')}: metrics.0.name: metric 'verl_x' is declared "
                                f"twice (first at {first}:{line_of(first, 'verl_x')})"]


def test_a_recording_declared_in_two_files_names_both(tmp_path):
    record = [{"record": "job:verl_a:doubled", "expr": "2 * <metric>{<sel>}"}]
    _, first, second = write(tmp_path / "spec", {
        "00-spec.yaml": {"version": 1},
        "10-a.yaml": {"metrics": [metric("verl_a", record=record)]},
        "20-b.yaml": {"metrics": [metric("verl_b", record=[{**record[0], "expr": "3 * <metric>{<sel>}"}])]},
    })
    with pytest.raises(SpecError) as e:
        load_spec(tmp_path / "spec")
    assert e.value.problems == [f"{second}:{line_of(second, 'job:verl_a')}: metrics.0.record.0: recording "
                                f"'job:verl_a:doubled' is declared twice (first at {first}:{line_of(first, 'job:')})"]


def test_an_alert_declared_in_two_files_and_an_inhibit_of_one_in_another_file(tmp_path):
    alert = {"alert": "VerlX", "kind": "threshold", "severity": "warning", "threshold": 1, "summary": "S.",
             "description": "D."}
    _, first, second = write(tmp_path / "spec", {
        "00-spec.yaml": {"version": 1},
        "10-a.yaml": {"metrics": [metric("verl_a", alerts=[alert])]},
        "20-b.yaml": {"metrics": [metric("verl_b", alerts=[{**alert, "alert": "VerlY", "inhibits": ["VerlX"]},
                                                           alert])]},
    })
    with pytest.raises(SpecError) as e:
        load_spec(tmp_path / "spec")
    assert e.value.problems == [f"{second}:{line_of(second, '- alert: VerlX')}: metrics.0.alerts.1.alert: alert "
                                f"'VerlX' is declared twice (first at {first}:{line_of(first, 'alert: VerlX')})"]


def test_a_top_level_key_in_two_files_names_both(tmp_path):
    first, second = write(tmp_path / "spec", {
        "00-spec.yaml": {"version": 1, "defaults": {"max_series": 8}, "metrics": [metric("verl_a")]},
        "10-a.yaml": {"defaults": {"max_series": 9}, "metrics": [metric("verl_b")]},
    })
    with pytest.raises(SpecError) as e:
        load_spec(tmp_path / "spec")
    assert e.value.problems == [f"{second}:1: defaults: also given in {first}:2; only metrics and alerts may be in "
                                "several files"]


@pytest.mark.parametrize("files, problem", [
    ({"a.yaml": {"metrics": [metric("verl_a")]}, "b.yaml": {"metrics": [metric("verl_b")]}},
     r"spec: version: Field required"),
    ({"a.yaml": {"version": 1}, "b.yaml": {"metrics": {"verl_a": {}}}}, r"b.yaml:1: metrics: must be a list"),
    ({"a.yaml": {"version": 1}, "b.yaml": ["verl_a"]}, r"must be a mapping"),
], ids=["no-version", "not-a-list", "not-a-mapping"])
def test_what_no_one_file_gets_wrong(tmp_path, files, problem):
    write(tmp_path / "spec", files)
    with pytest.raises(SpecError, match=problem):
        load_spec(tmp_path / "spec")


def test_an_empty_directory_is_refused(tmp_path):
    with pytest.raises(SpecError, match="at least one"):
        load_spec(tmp_path)


def test_each_area_file_is_small_and_points_to_the_schema():
    """An area that grows gets sub-area files (NN-area/<sub-area>.yaml): a new metric goes to a new file of its
    area, no file is split to make room."""
    files = area_files(PACKAGED)
    assert re.match(r"00-", files[0][0]), "the settings file sorts first"
    for name, path in files:
        text = path.read_text()
        assert text.count("\n") <= 800, f"{name} has {text.count(chr(10))} lines: give its area a sub-area file " \
                                        f"({name.split('/')[0].removesuffix('.yaml')}/<sub-area>.yaml)"
        pointer = f"# yaml-language-server: $schema={'../' * (4 + name.count('/'))}{SCHEMA}\n"
        assert text.startswith(pointer), name


def test_an_area_grows_by_sub_area_files_that_load_after_it_and_name_their_own_lines(tmp_path):
    root = tmp_path / "spec"
    write(root, {
        "00-spec.yaml": {"version": 1},
        "10-a.yaml": {"metrics": [metric("verl_a")]},
        "10-a/critic.yaml": {"metrics": [metric("verl_c")]},
        "10-a/actor.yaml": {"metrics": [metric("verl_b")], "alerts": []},
        "20-b.yaml": {"metrics": [metric("verl_d")]},
        "notes/other.yaml": {"not": "a spec file"},  # not an area's folder: not the spec's
    })
    assert [n for n, _ in area_files(root)] == ["00-spec.yaml", "10-a.yaml", "10-a/actor.yaml", "10-a/critic.yaml",
                                                "20-b.yaml"]
    assert [m.name for m in load_spec(root).metrics] == ["verl_a", "verl_b", "verl_c", "verl_d"]
    critic = root / "10-a/critic.yaml"
    critic.write_text(yaml.safe_dump({"metrics": [metric("verl_c"), metric("verl_e", type="histogram")]}))
    with pytest.raises(SpecError) as e:
        load_spec(root)
    assert e.value.problems == [f"{critic}:{line_of(critic, 'histogram')}: metrics.1.type: must be one of 'gauge' "
                                "or 'counter', got 'histogram'"]
    critic.write_text(yaml.safe_dump({"metrics": [metric("verl_a", source=[{"match": "other"}])]}))
    with pytest.raises(SpecError) as e:
        load_spec(root)
    first = root / "10-a.yaml"
    assert e.value.problems == [f"{critic}:{line_of(critic, 'verl_a')}: metrics.0.name: metric 'verl_a' is declared "
                                f"twice (first at {first}:{line_of(first, 'verl_a')})"]


def test_a_notice_named_like_an_alert_is_refused_and_its_texts_fill_each_placeholder_once(tmp_path):
    alert = {"alert": "VerlX", "kind": "threshold", "severity": "warning", "threshold": 1, "summary": "S.",
             "description": "D."}
    notice = {"alert": "VerlX", "severity": "critical", "summary": "Saw {what} at {where}.", "description": "{what}"}
    settings, _ = write(tmp_path / "spec", {
        "00-spec.yaml": {"version": 1, "notices": [notice]},
        "10-a.yaml": {"metrics": [metric("verl_a", alerts=[alert])]},
    })
    with pytest.raises(SpecError) as e:
        load_spec(tmp_path / "spec")
    assert e.value.problems == [f"{settings}:{line_of(settings, 'VerlX')}: notices.0.alert: alert 'VerlX' is "
                                "declared twice (first at "
                                f"{tmp_path / 'spec/10-a.yaml'}:{line_of(tmp_path / 'spec/10-a.yaml', 'VerlX')})"]
    (settings).write_text(yaml.safe_dump({"version": 1, "notices": [{**notice, "alert": "VerlY"}]}))
    texts = load_spec(tmp_path / "spec").notice("VerlY").texts({"what": "{where}", "other": 1})
    assert texts == {"summary": "Saw {where} at {where}.", "description": "{where}"}  # a value is not re-filled
