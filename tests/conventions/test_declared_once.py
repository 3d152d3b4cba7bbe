"""One declaration per meaning, for the things that were once declared twice: a second copy of a model, a
setting or a name drifts from the first without any test noticing. Each check reads the package's source or
its models, so a twin that comes back fails here."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import verl_exporter
from verl_exporter.core.detect import SignalSpec
from verl_exporter.relay.payload import Alert
from verl_exporter.sidecar.collectors import Context
from verl_exporter.sidecar.config import ServeConfig
from verl_exporter.spec import load_spec
from verl_exporter.spec.rules import ALERT_NAME_RE, SEVERITIES

PACKAGE = Path(verl_exporter.__file__).parent
SOURCES = {path: path.read_text(encoding="utf-8") for path in sorted(PACKAGE.rglob("*.py"))}
# Alert-name strings of the package that name no alert it sends (each with why).
NOT_SENT = {"VerlExample": "the relay's preview of a made-up alert (relay/format.py)"}


def _where(pattern: str) -> list[str]:
    """The package files (relative) whose source matches pattern."""
    return [str(p.relative_to(PACKAGE)) for p, text in SOURCES.items() if re.search(pattern, text)]


def test_every_alert_the_code_names_is_declared_in_the_spec():
    """An alert the pack sends (the relay's forensics page included) is declared in the spec: an alert with
    its rule, or a notice when no rule is behind it."""
    spec = load_spec()
    declared = {a.alert for a in spec.alerts()} | {n.alert for n in spec.notices}
    named = {(str(p.relative_to(PACKAGE)), node.value) for p, text in SOURCES.items() for node in
             ast.walk(ast.parse(text)) if isinstance(node, ast.Constant) and isinstance(node.value, str)
             and ALERT_NAME_RE.fullmatch(node.value)}
    assert {name for _, name in named} >= {"VerlHangForensics"}, "the walk finds the relay's page"
    assert sorted((p, name) for p, name in named if name not in declared | set(NOT_SENT)) == []


def test_severity_is_declared_once():
    assert _where(r'Literal\[\s*"critical",\s*"warning",\s*"info"') == ["spec/rules.py"]
    assert SEVERITIES == ("critical", "warning", "info")


def _declared_fields() -> dict[str, set[str]]:
    """{module:Class: the names its body annotates} for every class of the package."""
    out = {}
    for path, text in SOURCES.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                out[f"{path.relative_to(PACKAGE)}:{node.name}"] = {
                    a.target.id for a in node.body if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)}
    return out


def test_the_detectors_defaults_are_declared_once():
    """A detect: entry is the detectors' object: no other class of the package declares its keys (a copy of
    them, as a runtime dataclass once was, would carry its own defaults)."""
    keys = set(SignalSpec.model_fields) - {"name", "labels"}
    copies = [cls for cls, fields in _declared_fields().items() if len(fields & keys) >= 3]
    assert copies == ["core/detect.py:SignalSpec"]


def test_the_relay_validates_what_it_keeps_with_one_model():
    """The webhook's alert is checked by the Alert dataclass itself (no second class of the same fields, as
    the webhook's model once was; a formatted view such as format.AlertView is another thing): its fields
    and wire names are written once."""
    fields = {f.name for f in dataclasses.fields(Alert)}
    assert [cls for cls, declared in _declared_fields().items() if len(declared & fields) >= 6] == \
        ["relay/payload.py:Alert"]
    for wire in ("startsAt", "endsAt", "generatorURL"):
        assert _where(rf'alias="{wire}"') == ["relay/payload.py"], wire


def test_the_collectors_read_serve_settings_from_the_serve_config():
    """A collector's setting is a ServeConfig field, read as ctx.config.<setting>: the Context holds what is
    not a setting (the spec, the self-metrics and the fakes tests inject), no copy of a setting's default."""
    assert [f.name for f in dataclasses.fields(Context)] == ["spec", "self_metrics", "config", "environ",
                                                             "nvml_loader", "clock"]
    read = {m for text in SOURCES.values() for m in re.findall(r"ctx\.config\.(\w+)", text)}
    assert read and read <= set(ServeConfig.model_fields), read - set(ServeConfig.model_fields)


def test_the_spec_and_its_overrides_are_loaded_in_one_place():
    """spec/overrides.load_with_overrides: the commands take the declared spec, the file and the effective spec
    from it, so that each resolves, announces and applies the file alike."""
    assert _where(r"\bload_overrides\(") == ["spec/overrides.py"]
    assert _where(r"\bresolve_path\(") == ["cli.py", "spec/overrides.py"]  # calibrate: only to name its base
