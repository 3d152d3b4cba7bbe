"""Every field of the spec reaches something. The spec is one model per concept (``Spec``, ``MetricSpec``,
``SourceRule``, the alert kinds of spec/kinds/, ``Panel``, ``Param``, ...): the file's key is the attribute the
runtime reads, so each of their fields must be read somewhere outside the checks that validate it. Only
detectors.py's entry is still converted into a runtime dataclass (core.detect's ``SignalSpec``): a key it may
set is copied by its converter, and every dataclass field is read by a renderer or a runtime path. A field that
is validated and documented but consumed by nothing (as keep_firing_for once was: in the schema, copied into
Alert, written by no renderer) fails here.

How "consumed" is found, by reading the package's source (templates included):
* an entry field is read by its entry's converter (``to_signal``) as ``.<field>``;
* a field of a model, or of a dataclass, is read as ``.<field>`` somewhere outside the entry classes (whose
  converters only write the dataclasses) and outside every check (validators and ``cross_problems``, which
  only check the file): a kind's PromQL, test and judge methods are readers, its validators are not.
A field may pass on a reader of another object's attribute of the same name (``.name``, ``.labels``): the
walk catches a field nothing reads at all, which is how a key goes dead.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pkgutil
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
KIND_MODULES = [importlib.import_module(f"{K.__name__}.{m.name}") for m in pkgutil.iter_modules(K.__path__)]
BASE = importlib.import_module(f"{K.__name__}.base")
# The models the runtime reads as they are (the file's shape is their shape): the spec's, every alert kind and
# its parts, panels and knobs.
MODELS = (S.Spec, S.MetricSpec, S.SourceRule, S.RecordingEntry, S.RulesConfig, S.Defaults, *K.KINDS.values(),
          detector.Confirm, condition.Term, condition.Compare, condition.AllOf, condition.AnyOf, P.Panel, R.Param)
MIXINS = (K.AlertBase, BASE.WithParams, BASE.WithTest)  # their fields are walked through the kinds using them
# The entries converted into runtime dataclasses, and those dataclasses.
ENTRIES = (D.DetectEntry,)
DATACLASSES = (SignalSpec,)
CONVERTERS = {D.DetectEntry: [D.DetectEntry.to_signal]}

# (model, field) -> the one-line reason it needs no reader found as above: a field deliberately consumed by
# nothing (metadata), or one the package reads only by name (getattr over a list of names; say where).
ALLOWED_UNREAD: dict[tuple[type, str], str] = {
    (S.Spec, "defaults"): "consumed while the file is validated: Spec._max_series gives each metric its cap",
}


def _is_check(node: ast.AST) -> bool:
    """A function that only checks the file: a pydantic validator, or the cross-entry checks."""
    if not isinstance(node, ast.FunctionDef):
        return False
    decorators = {getattr(d.func, "id", "") for d in node.decorator_list if isinstance(d, ast.Call)}
    return node.name == "cross_problems" or bool(decorators & {"field_validator", "model_validator"})


def _source_outside_entries() -> str:
    """The package's Python and template text, without the bodies of the entry classes and the checks."""
    entries = {e.__name__ for e in ENTRIES}
    parts = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        drop: set[int] = set()
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.ClassDef) and node.name in entries) or _is_check(node):
                drop.update(range(node.lineno - 1 - len(node.decorator_list), node.end_lineno))
        parts.append("\n".join(line for i, line in enumerate(text.splitlines()) if i not in drop))
    parts += [p.read_text(encoding="utf-8") for p in sorted((PACKAGE / "render/templates").glob("*.j2"))]
    return "\n".join(parts)


SOURCE = _source_outside_entries()


def _reads(text: str, name: str) -> bool:
    return re.search(rf"\.{re.escape(name)}\b", text) is not None


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.__name__)
def test_every_key_of_the_file_is_carried_into_the_runtime_spec(entry):
    converter = "\n".join(inspect.getsource(f) for f in CONVERTERS[entry])
    lost = [n for n in entry.model_fields if not _reads(converter, n) and (entry, n) not in ALLOWED_UNREAD]
    assert not lost, f"{entry.__name__}: validated keys that its converter never copies: {lost}"


def _fields(cls: type) -> list[str]:
    return list(cls.model_fields) if cls in MODELS else [f.name for f in dataclasses.fields(cls)]


@pytest.mark.parametrize("cls", MODELS + DATACLASSES, ids=lambda c: c.__name__)
def test_every_runtime_field_is_read_by_a_renderer_or_a_runtime_path(cls):
    unread = [name for name in _fields(cls) if not _reads(SOURCE, name) and (cls, name) not in ALLOWED_UNREAD]
    assert not unread, f"{cls.__name__}: fields no renderer and no runtime path reads: {unread}"


def test_the_allow_list_names_real_fields():
    """A stale allow-list entry hides nothing but says something false: each names a field that exists."""
    for cls, name in ALLOWED_UNREAD:
        assert name in (cls.model_fields if hasattr(cls, "model_fields") else _fields(cls)), (cls.__name__, name)


def test_the_walk_covers_every_model_entry_and_dataclass_of_the_spec():
    """A new model or dataclass in spec/ (a new kind module included) is walked too."""
    modules = (S, R, D, P, *KIND_MODULES)
    classes = {c for m in modules for c in vars(m).values() if inspect.isclass(c) and c.__module__ == m.__name__}
    models = {c for c in classes if issubclass(c, S.StrictModel)}
    dataclass_types = {c for c in classes if dataclasses.is_dataclass(c)}
    assert models == set(MODELS) | set(ENTRIES) | set(MIXINS)
    assert dataclass_types | {SignalSpec} == set(DATACLASSES)
