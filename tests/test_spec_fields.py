"""Every field of the spec reaches something: a key the file may set is copied into the runtime dataclasses
(where a model still has one), and every field of a model used at runtime (the alert kinds, panels, knobs)
or of a dataclass is read by a renderer or a runtime path. A field that is validated and documented
but consumed by nothing (as keep_firing_for once was: in the schema, copied into Alert, written by no
renderer) fails here.

How "consumed" is found, by reading the package's source (templates included):
* an entry field (a key of a spec file) is read by its entry's converter (``to_alert``, ``to_metric``, ...)
  as ``.<field>``, or its entry is converted whole into a dataclass that has a field of that name;
* a dataclass field, or a field of a model used at runtime, is read as ``.<field>`` somewhere outside the
  entry classes (whose converters only write the dataclasses) and outside every validator (which only checks
  the file): a kind's PromQL, test and judge methods are readers, its validators are not.
A field may pass on a reader of another object's attribute of the same name (``.name``, ``.labels``): the
walk catches a field nothing reads at all, which is how a key goes dead.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from pathlib import Path

import pytest
import verl_exporter
from verl_exporter import spec as S
from verl_exporter.core.detect import SignalSpec
from verl_exporter.spec import detectors as D
from verl_exporter.spec import kinds as K
from verl_exporter.spec import panels as P
from verl_exporter.spec import rules as R
from verl_exporter.spec.kinds import condition, detector

PACKAGE = Path(verl_exporter.__file__).parent
ENTRIES = (S.SpecFile, S.MetricEntry, S.SourceEntry, S.RecordingEntry, S.RulesEntry, S.Defaults, D.DetectEntry)
DATACLASSES = (S.MetricSpec, S.SourceRule, S.RulesConfig, S.Spec, SignalSpec)
# The models the runtime uses as they are (one model per concept): every kind, its parts, panels and knobs.
RUNTIME_MODELS = (*K.KINDS.values(), detector.Confirm, condition.Term, condition.Compare, condition.AllOf,
                  condition.AnyOf, P.Panel, R.Param)

# The code that turns each entry into its dataclass (an entry read inside its parent's converter names it).
CONVERTERS = {
    S.SpecFile: [S.SpecFile.to_spec],
    S.MetricEntry: [S.MetricEntry.to_metric],
    S.SourceEntry: [S.SourceEntry.to_rule],
    S.RecordingEntry: [S.MetricEntry.to_metric],
    S.Defaults: [S.SpecFile.to_spec],
    D.DetectEntry: [D.DetectEntry.to_signal],
}
# Entries converted whole (model_dump / model_fields into the dataclass's keyword arguments).
WHOLE = {S.RulesEntry: S.RulesConfig}

# (model, field) -> the one-line reason it needs no reader found as above: a field deliberately consumed by
# nothing (metadata), or one the package reads only by name (getattr over a list of names; say where).
# Empty: every field of the spec today has a reader.
ALLOWED_UNREAD: dict[tuple[type, str], str] = {}


def _validator(node: ast.AST) -> bool:
    return isinstance(node, ast.FunctionDef) and any(
        isinstance(d, ast.Call) and getattr(d.func, "id", "") in ("field_validator", "model_validator")
        for d in node.decorator_list)


def _source_outside_entries() -> str:
    """The package's Python and template text, without the bodies of the entry classes and the validators."""
    names = {e.__name__ for e in ENTRIES}
    parts = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        drop: set[int] = set()
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.ClassDef) and node.name in names) or _validator(node):
                drop.update(range(node.lineno - 1 - len(node.decorator_list), node.end_lineno))
        parts.append("\n".join(line for i, line in enumerate(text.splitlines()) if i not in drop))
    parts += [p.read_text(encoding="utf-8") for p in sorted((PACKAGE / "render/templates").glob("*.j2"))]
    return "\n".join(parts)


SOURCE = _source_outside_entries()


def _reads(text: str, name: str) -> bool:
    return re.search(rf"\.{re.escape(name)}\b", text) is not None


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.__name__)
def test_every_key_of_the_file_is_carried_into_the_runtime_spec(entry):
    if entry in WHOLE:
        target = {f.name for f in dataclasses.fields(WHOLE[entry])}
        lost = [n for n in entry.model_fields if n not in target and (entry, n) not in ALLOWED_UNREAD]
    else:
        converter = "\n".join(inspect.getsource(f) for f in CONVERTERS[entry])
        lost = [n for n in entry.model_fields if not _reads(converter, n) and (entry, n) not in ALLOWED_UNREAD]
    assert not lost, f"{entry.__name__}: validated keys that its converter never copies: {lost}"


@pytest.mark.parametrize("cls", DATACLASSES, ids=lambda c: c.__name__)
def test_every_runtime_field_is_read_by_a_renderer_or_a_runtime_path(cls):
    unread = [f.name for f in dataclasses.fields(cls)
              if not _reads(SOURCE, f.name) and (cls, f.name) not in ALLOWED_UNREAD]
    assert not unread, f"{cls.__name__}: fields no renderer and no runtime path reads: {unread}"


@pytest.mark.parametrize("model", RUNTIME_MODELS, ids=lambda c: c.__name__)
def test_every_field_of_a_runtime_model_is_read_outside_its_validators(model):
    own = [n for n in model.model_fields if n not in K.AlertBase.model_fields or model is K.AlertBase]
    common = list(K.AlertBase.model_fields) if model is next(iter(K.KINDS.values())) else []
    unread = [n for n in own + common if not _reads(SOURCE, n) and (model, n) not in ALLOWED_UNREAD]
    assert not unread, f"{model.__name__}: fields no renderer and no runtime path reads: {unread}"


def test_the_allow_list_names_real_fields():
    """A stale allow-list entry hides nothing but says something false: each names a field that exists."""
    for cls, name in ALLOWED_UNREAD:
        names = cls.model_fields if hasattr(cls, "model_fields") else {f.name for f in dataclasses.fields(cls)}
        assert name in names, (cls.__name__, name)


def test_the_walk_covers_every_entry_and_dataclass_of_the_spec():
    """A new entry model or dataclass in spec/ is walked too (add it to ENTRIES or DATACLASSES)."""
    import importlib
    import pkgutil

    kinds = [importlib.import_module(f"{K.__name__}.{m.name}") for m in pkgutil.iter_modules(K.__path__)]
    base = importlib.import_module(f"{K.__name__}.base")
    modules = (S, R, D, P, *kinds)
    models = {c for m in modules for c in vars(m).values() if inspect.isclass(c) and c.__module__ == m.__name__}
    entries = {c for c in models if issubclass(c, S.StrictModel)}
    mixins = {K.AlertBase, base.WithParams, base.WithTest}  # read through the kinds that use them
    dataclass_types = {c for c in models if dataclasses.is_dataclass(c)}
    assert entries == set(ENTRIES) | set(RUNTIME_MODELS) | mixins
    assert dataclass_types | {SignalSpec} == set(DATACLASSES)
