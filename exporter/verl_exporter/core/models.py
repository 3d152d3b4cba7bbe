"""Typed file models: the one way verl-exporter reads a YAML or JSON document it is given.

Every file (the overrides, the metric spec, the sidecar and relay configs, Alertmanager's webhook) is a
pydantic v2 model with extra keys forbidden. ``validate`` reports every problem of a document at once, each
as ``FILE:LINE: key.path: message``, in file order; the JSON Schema comes from the same model.

pydantic rather than msgspec (verl brings both): pydantic reports every problem with its full location where
msgspec stops at the first, writes the JSON Schema with the fields' descriptions, and has a secret type that
keeps tokens out of reprs and messages.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

M = TypeVar("M", bound=BaseModel)


class StrictModel(BaseModel):
    """Unknown keys are errors; no type coercion ("5" is not 5); no NaN or Inf; immutable."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True,
                              frozen=True)


class FileError(ValueError):
    """A document that cannot be used; ``problems`` lists every problem, each with its place."""

    def __init__(self, problems: list[str], origin: str = "file"):
        self.problems = problems
        self.origin = origin
        super().__init__(f"{origin}: {len(problems)} problem(s):\n  - " + "\n  - ".join(problems))


class YamlLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """YAML 1.2 floats: 3e9 and 1E-3 are numbers (PyYAML's YAML 1.1 reads them as strings). libyaml's parser
    where PyYAML has it: the pure-Python one took 1.5 s of the spec's 1.7 s load."""


YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def key_lines(node, path: tuple = (), out: dict | None = None) -> dict[tuple, int]:
    """{key path: 1-based line} of every mapping key and sequence item in a composed YAML node tree."""
    out = {} if out is None else out
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            key = k.value
            out[(*path, key)] = k.start_mark.line + 1
            key_lines(v, (*path, key), out)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            out[(*path, i)] = v.start_mark.line + 1
            key_lines(v, (*path, i), out)
    return out


def duplicate_keys(node, origin: str, path: tuple = ()) -> list[str]:
    """A key given twice in one mapping, as problems: YAML keeps the last silently, so the first is lost
    without a word (a spec entry's second `inhibits:` once dropped the first's inhibit this way)."""
    out: list[str] = []
    if isinstance(node, yaml.MappingNode):
        first: dict[str, int] = {}
        for k, v in node.value:
            key, line = k.value, k.start_mark.line + 1
            if isinstance(k, yaml.ScalarNode) and key != "<<":
                if key in first:
                    where_ = ".".join(map(str, (*path, key)))
                    out.append(f"{origin}:{line}: {where_}: duplicate key (first at line {first[key]}); "
                               "YAML would keep only this one")
                first.setdefault(key, line)
            out += duplicate_keys(v, origin, (*path, key))
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            out += duplicate_keys(v, origin, (*path, i))
    return out


def parse_yaml(text: str, origin: str, error: type[FileError] = FileError) -> tuple[Any, dict[tuple, int]]:
    """(document, key lines) of YAML text; a syntax error, or a key given twice in one mapping, is a problem
    of ``error``. The text is parsed once: the document is built from the same node tree the lines come
    from."""
    loader = YamlLoader(text)
    try:
        node = loader.get_single_node()
        duplicates = duplicate_keys(node, origin) if node is not None else []
        if duplicates:
            raise error(duplicates, origin)
        doc = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as e:
        raise error([f"not valid YAML: {e}"], origin) from None
    finally:
        loader.dispose()
    return doc, (key_lines(node) if node is not None else {})


def read_yaml(path: str | Path, error: type[FileError] = FileError) -> tuple[Any, dict[tuple, int]]:
    """(document, key lines) of a YAML file; an unreadable file is one problem of ``error``."""
    origin = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise error([f"cannot read it: {e.strerror}"], origin) from None
    except UnicodeDecodeError as e:
        raise error([f"not UTF-8 text (byte {e.start})"], origin) from None
    return parse_yaml(text, origin, error)


def where(origin: str, lines: dict[tuple, int], path: tuple) -> str:
    """'ORIGIN:LINE' of the deepest key of path the document has (ORIGIN alone without lines)."""
    for n in range(len(path), 0, -1):
        line = lines.get(tuple(path[:n]))
        if line is not None:
            return f"{origin}:{line}"
    return origin


_UNION_BRANCH = re.compile(r"^(function-|constrained-str|literal\[|dict\[|list\[|str$|int$|float$|bool$|none$)")


def error_path(loc: tuple) -> tuple:
    """A pydantic error location as the document's key path: fields by the names written in the file
    (``for_`` -> ``for``), without pydantic's union-branch and validator names."""
    out = []
    for part in loc:
        if isinstance(part, str) and part.endswith("_") and not part.startswith("_"):
            part = part[:-1]
        if isinstance(part, str) and _UNION_BRANCH.match(part):
            continue
        out.append(part)
    return tuple(out)


def message(err: dict, path: tuple, hint: Callable[[dict, tuple], str | None] | None = None) -> str:
    """A pydantic error as a short sentence; ``hint`` may say it better for known keys."""
    if err["type"] == "extra_forbidden":
        return "unknown key"
    better = hint(err, path) if hint else None
    if better:
        return better
    msg = err["msg"]
    return msg[len("Value error, "):] if msg.startswith("Value error, ") else msg


def problems(errors: list[dict], origin: str, lines: dict[tuple, int],
             hint: Callable[[dict, tuple], str | None] | None = None,
             locate: Callable[[tuple], tuple] | None = None) -> list[str]:
    """One line per problem, ``ORIGIN:LINE: key.path: message``, in file order. A value that fits no branch
    of a union is reported by the branch of its own type only (a string where a mapping may also go says
    what is wrong with the string). ``locate`` rewrites a model's error location first (e.g. to drop the
    tag of a tagged union, which the file does not spell)."""
    paths = [error_path(locate(e["loc"]) if locate else e["loc"]) for e in errors]
    out: dict[str, int] = {}
    for err, path in zip(errors, paths, strict=True):
        wrong_branch = (err["type"] == "string_type" and isinstance(err["input"], dict)) or \
                       (err["type"] in ("dict_type", "model_type") and isinstance(err["input"], str))
        if wrong_branch and any(p != path and p[:len(path)] == path or (p == path and q is not err)
                                for p, q in zip(paths, errors, strict=True)):
            continue
        text_ = message(err, path, hint)
        if path and path[-1] == "[key]":
            path = path[:-1]
            text_ = f"the name {err['input']!r}: {text_}"
        place = where(origin, lines, path)
        line = place.rsplit(":", 1)[-1]
        out.setdefault(f"{place}: {'.'.join(map(str, path)) or '(top)'}: {text_}", int(line) if line.isdigit() else 0)
    return sorted(out, key=lambda t: out[t])


def validate(model: type[M], doc: Any, origin: str, lines: dict[tuple, int] | None = None,
             error: type[FileError] = FileError, hint: Callable[[dict, tuple], str | None] | None = None,
             context: dict | None = None, locate: Callable[[tuple], tuple] | None = None) -> M:
    """The document as ``model``, or ``error`` listing every problem with its FILE:LINE."""
    try:
        return model.model_validate(doc, context=context)
    except ValidationError as e:
        raise error(problems(e.errors(), origin, lines or {}, hint, locate), origin) from None


def json_schema(model: type[BaseModel], title: str) -> dict:
    """The model's JSON Schema (draft 2020-12), keys as written in the files."""
    doc = model.model_json_schema(by_alias=True)
    doc["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    doc["title"] = title
    return doc
