"""Every field of the spec reaches something. The spec is one model per concept (``Spec``, ``MetricSpec``,
``SourceRule``, the alert kinds of spec/kinds/, ``Panel``, ``Param``, ...): the file's key is the attribute the
runtime reads (core.detect's ``SignalSpec`` too: a metric's ``detect:`` entry is the detectors' object, with
no runtime copy whose defaults could drift), so each of their fields must be read somewhere outside the
checks that validate it. A field that is validated and documented but consumed by nothing (as
keep_firing_for once was: in the schema, copied into Alert, written by no renderer) fails here.

How "consumed" is found, by reading the package's source (templates included):
* a field of a model is read as ``.<field>`` somewhere outside every check (validators and ``cross_problems``, which
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
from verl_exporter.spec import kinds as K
from verl_exporter.spec import panels as P
from verl_exporter.spec import rules as R
from verl_exporter.spec.kinds import condition, detector

PACKAGE = Path(verl_exporter.__file__).parent
KIND_MODULES = [importlib.import_module(f"{K.__name__}.{m.name}") for m in pkgutil.iter_modules(K.__path__)]
BASE = importlib.import_module(f"{K.__name__}.base")
# The models the runtime reads as they are (the file's shape is their shape): the spec's, every alert kind and
# its parts, panels and knobs.
MODELS = (S.Spec, S.MetricSpec, S.SourceRule, S.RecordingEntry, S.Events, S.RulesConfig, S.Defaults, *K.KINDS.values(),
          detector.Confirm, condition.Term, condition.Compare, condition.AllOf, condition.AnyOf, P.Panel, R.Param,
          SignalSpec, R.Notice, R.CodeSet)
MIXINS = (K.AlertBase, BASE.WithParams, BASE.WithTest)  # their fields are walked through the kinds using them

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


def _source_outside_checks() -> str:
    """The package's Python and template text, without the bodies of the checks."""
    parts = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        drop: set[int] = set()
        for node in ast.walk(ast.parse(text)):
            if _is_check(node):
                drop.update(range(node.lineno - 1 - len(node.decorator_list), node.end_lineno))
        parts.append("\n".join(line for i, line in enumerate(text.splitlines()) if i not in drop))
    parts += [p.read_text(encoding="utf-8") for p in sorted((PACKAGE / "render/templates").glob("*.j2"))]
    return "\n".join(parts)


SOURCE = _source_outside_checks()


def _reads(text: str, name: str) -> bool:
    return re.search(rf"\.{re.escape(name)}\b", text) is not None


@pytest.mark.parametrize("cls", MODELS, ids=lambda c: c.__name__)
def test_every_runtime_field_is_read_by_a_renderer_or_a_runtime_path(cls):
    unread = [name for name in cls.model_fields if not _reads(SOURCE, name) and (cls, name) not in ALLOWED_UNREAD]
    assert not unread, f"{cls.__name__}: fields no renderer and no runtime path reads: {unread}"


def test_the_allow_list_names_real_fields():
    """A stale allow-list entry hides nothing but says something false: each names a field that exists."""
    for cls, name in ALLOWED_UNREAD:
        assert name in cls.model_fields, (cls.__name__, name)


def test_the_walk_covers_every_model_of_the_spec_and_the_spec_has_no_runtime_copy():
    """A new model in spec/ (a new kind module included) is walked too; no dataclass there copies an entry
    (a second declaration of its fields and defaults, as the detectors' once was)."""
    modules = (S, R, P, *KIND_MODULES)
    classes = {c for m in modules for c in vars(m).values() if inspect.isclass(c) and c.__module__ == m.__name__}
    models = {c for c in classes if issubclass(c, S.StrictModel)}
    dataclass_types = {c for c in classes if dataclasses.is_dataclass(c)}
    assert models | {SignalSpec} == set(MODELS) | set(MIXINS)
    assert not dataclass_types
