"""Typed file models: the one way verl-exporter reads a YAML or JSON document it is given.

Every file (the overrides, the metric spec, the sidecar and relay configs, Alertmanager's webhook) is a
pydantic v2 model with extra keys forbidden. ``validate`` reports every problem of a document at once, each
as ``FILE:LINE: key.path: message``, in file order; the JSON Schema comes from the same model.

pydantic rather than msgspec (verl brings both): pydantic reports every problem with its full location where
msgspec stops at the first, writes the JSON Schema with the fields' descriptions, and has a secret type that
keeps tokens out of reprs and messages.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import ErrorDetails

M = TypeVar("M", bound=BaseModel)
KeyPath = tuple[str | int, ...]  # a place in a document: mapping keys and sequence indexes, outermost first
Lines = dict[KeyPath, int]  # {key path: 1-based line}
Hint = Callable[[ErrorDetails, KeyPath], str | None]


# A process id: 0 is none (os.kill(0, ...) reaches one's own process group), and the kernel's pid_t holds no more
# than 2**31 - 1 (os.kill of a larger one raises OverflowError).
Pid = Annotated[int, Field(ge=1, le=2**31 - 1)]


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


# Caps on what a file may make the loader do: our files are a few hundred KB at most (the spec ~160 KB) and
# nested 10 deep. The size is checked before parsing (1 MiB of the worst YAML takes ~4 s and ~350 MB), the
# depth in the one walk of the node tree, before any document is built.
MAX_YAML_BYTES = 1024 * 1024
MAX_YAML_DEPTH = 32


if TYPE_CHECKING:  # the stubs declare both; the C one is only there when PyYAML was built with libyaml
    _SafeLoader = yaml.SafeLoader
else:
    _SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class YamlLoader(_SafeLoader):
    """YAML 1.2 floats: 3e9 and 1E-3 are numbers (PyYAML's YAML 1.1 reads them as strings). libyaml's parser
    where PyYAML has it: the pure-Python one took 1.5 s of the spec's 1.7 s load. A value the constructor
    cannot build (a date with month 13, an int of 5,000 digits, ``!!float nope``) is a YAML error at its line
    instead of whatever Python exception the constructor would raise."""

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except yaml.YAMLError:
            raise
        except Exception as e:  # any failure to build a value is a problem of the file
            raise yaml.constructor.ConstructorError(None, None, f"cannot read this value: {e}",
                                                    node.start_mark) from None


YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


class _Refused(Exception):
    """A node tree the loader will not use; ``line`` is where (1-based)."""

    def __init__(self, line: int, text: str):
        self.line, self.text = line, text


def _walk(root: yaml.Node, origin: str) -> tuple[Lines, list[str]]:
    """({key path: 1-based line} of every mapping key and sequence item, duplicate-key problems) of a composed
    node tree, in file order, each node visited once. A node met twice is an alias, refused: walking through
    aliases is how 600 bytes of nine nested aliased lists became 9^9 visits and 24 GB. A key given twice in one
    mapping is a problem: YAML keeps the last silently, so the first is lost without a word (a spec entry's
    second `inhibits:` once dropped the first's inhibit this way)."""
    lines: Lines = {}
    duplicates: list[str] = []
    seen: set[int] = set()
    stack: list[tuple[yaml.Node, KeyPath, int]] = [(root, (), 1)]
    while stack:
        node, path, depth = stack.pop()
        if id(node) in seen:
            raise _Refused(node.start_mark.line + 1, "alias")
        seen.add(id(node))
        if isinstance(node, yaml.ScalarNode):
            continue
        if depth > MAX_YAML_DEPTH:
            raise _Refused(node.start_mark.line + 1, f"nested deeper than {MAX_YAML_DEPTH} levels")
        children: list[tuple[yaml.Node, KeyPath, int]] = []
        if isinstance(node, yaml.MappingNode):
            first: dict[str, int] = {}
            for k, v in node.value:
                line = k.start_mark.line + 1
                if not isinstance(k, yaml.ScalarNode):  # a list or mapping as a key: the constructor refuses it
                    children.append((k, (*path, "[key]"), depth + 1))
                    key = "[key]"
                else:
                    if id(k) in seen:
                        raise _Refused(line, "alias")
                    seen.add(id(k))
                    key = k.value
                    lines[(*path, key)] = line
                    if key != "<<":
                        if key in first:
                            where_ = ".".join(map(str, (*path, key)))
                            duplicates.append(f"{origin}:{line}: {where_}: duplicate key (first at line "
                                              f"{first[key]}); YAML would keep only this one")
                        first.setdefault(key, line)
                children.append((v, (*path, key), depth + 1))
        else:
            for i, v in enumerate(node.value):
                lines[(*path, i)] = v.start_mark.line + 1
                children.append((v, (*path, i), depth + 1))
        stack.extend(reversed(children))
    return lines, duplicates


def _alias_problem(text: str, origin: str) -> str:
    """The first alias of the text, as a problem naming its line and its anchor's (a pass over the events, which
    do not expand aliases)."""
    anchors: dict[str | None, int] = {}
    for event in yaml.parse(text, Loader=YamlLoader):
        line = event.start_mark.line + 1 if event.start_mark is not None else 0  # the parser marks every event
        name = getattr(event, "anchor", None)  # node events may carry one; an alias names the one it repeats
        if isinstance(event, yaml.AliasEvent):
            return (f"{origin}:{line}: alias *{name} of the anchor &{name} at line "
                    f"{anchors.get(name, '?')}: anchors and aliases are not accepted in this file (a few hundred "
                    "bytes of nested aliases expand to billions of values); write the value out")
        if name:
            anchors.setdefault(name, line)
    return f"{origin}: anchors and aliases are not accepted in this file; write the value out"


def _syntax_problem(e: yaml.YAMLError, origin: str, text: str) -> str:
    if isinstance(e, yaml.reader.ReaderError):  # a character YAML does not allow, e.g. a control character
        code = ord(e.character) if isinstance(e.character, str) else e.character
        # libyaml counts bytes of the UTF-8 text, the pure-Python reader characters
        if hasattr(yaml, "CSafeLoader"):
            line = text.encode("utf-8", "replace")[:e.position].count(b"\n") + 1
        else:
            line = text[:e.position].count("\n") + 1
        return f"{origin}:{line}: not valid YAML: character U+{code:04X}: {e.reason}"
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    if not isinstance(e, yaml.MarkedYAMLError) or mark is None:
        return f"{origin}: not valid YAML: {e}"
    what = " ".join(x for x in (e.context, e.problem) if x)
    return f"{origin}:{mark.line + 1}: not valid YAML: {what}"


def _too_large(origin: str) -> str:
    return f"{origin}: larger than the {MAX_YAML_BYTES // 1024**2} MiB a YAML file may have here"


def parse_yaml(text: str, origin: str, error: type[FileError] = FileError) -> tuple[Any, Lines]:
    """(document, key lines) of YAML text, the one way the pack reads YAML. A problem of ``error``: a syntax
    error; a key given twice in one mapping; an alias; nesting deeper than MAX_YAML_DEPTH; text over
    MAX_YAML_BYTES; a value that cannot be built. The text is parsed once: the document is built from the same
    node tree the lines come from, after the walk has refused what it must."""
    if len(text) > MAX_YAML_BYTES:
        raise error([_too_large(origin)], origin)
    loader = YamlLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, {}
        lines, duplicates = _walk(node, origin)
        if duplicates:
            raise error(duplicates, origin)
        return loader.construct_document(node), lines
    except _Refused as r:
        raise error([_alias_problem(text, origin) if r.text == "alias" else f"{origin}:{r.line}: {r.text}"],
                    origin) from None
    except yaml.YAMLError as e:
        raise error([_syntax_problem(e, origin, text)], origin) from None
    finally:
        loader.dispose()


def read_yaml(path: str | Path, error: type[FileError] = FileError) -> tuple[Any, Lines]:
    """(document, key lines) of a YAML file; an unreadable file, or one over MAX_YAML_BYTES (read no further
    than that: /dev/zero is refused, not read), is one problem of ``error``."""
    origin = str(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_YAML_BYTES + 1)
    except OSError as e:
        raise error([f"cannot read it: {e.strerror}"], origin) from None
    if len(raw) > MAX_YAML_BYTES:
        raise error([_too_large(origin)], origin)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error([f"not UTF-8 text (byte {e.start})"], origin) from None
    return parse_yaml(text, origin, error)


def read_json(path: str | Path, max_bytes: int, error: type[FileError] = FileError) -> Any:
    """The JSON document of a file the pack wrote itself, read as hostile input: one problem of ``error`` for a
    file that is not a regular file (a FIFO would block the open), is larger than max_bytes (read no further),
    is not UTF-8, is not JSON, nests deeper than the decoder goes, or holds an integer too long to convert.
    A missing file raises FileNotFoundError."""
    origin = str(path)
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise error(["not a regular file"], origin)
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise error([f"cannot read it: {e.strerror}"], origin) from None
    if len(raw) > max_bytes:
        raise error([f"larger than the {max_bytes} bytes this file may have"], origin)
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise error([f"not UTF-8 text (byte {e.start})"], origin) from None
    except RecursionError:
        raise error(["nested deeper than the JSON decoder goes"], origin) from None
    except ValueError as e:  # the decoder's messages name a place, never the text
        raise error([f"not JSON: {e}"], origin) from None


def valid_fields(model: type[M], doc: dict[str, Any]) -> tuple[M, list[str]]:
    """(the model of the fields of doc it accepts, the names of those it does not, sorted): each wrong or
    unknown top-level field costs only itself. For models without checks across fields."""
    try:
        return model.model_validate(doc), []
    except ValidationError as e:
        bad = sorted({str(err["loc"][0]) for err in e.errors() if err["loc"]})
    return model.model_validate({k: v for k, v in doc.items() if k not in bad}), bad


def where(origin: str, lines: Lines, path: KeyPath) -> str:
    """'ORIGIN:LINE' of the deepest key of path the document has (ORIGIN alone without lines)."""
    for n in range(len(path), 0, -1):
        line = lines.get(tuple(path[:n]))
        if line is not None:
            return f"{origin}:{line}"
    return str(origin)  # a Path given as the origin (read_config_file(Path(...))) is still text


_UNION_BRANCH = re.compile(r"^(function-|constrained-str|literal\[|dict\[|list\[|str$|int$|float$|bool$|none$)")


def error_path(loc: KeyPath) -> KeyPath:
    """A pydantic error location as the document's key path: fields by the names written in the file
    (``for_`` -> ``for``), without pydantic's union-branch and validator names."""
    out: list[str | int] = []
    for part in loc:
        if isinstance(part, str) and part.endswith("_") and not part.startswith("_"):
            part = part[:-1]
        if isinstance(part, str) and _UNION_BRANCH.match(part):
            continue
        out.append(part)
    return tuple(out)


def message(err: ErrorDetails, path: KeyPath, hint: Hint | None = None) -> str:
    """A pydantic error as a short sentence; ``hint`` may say it better for known keys."""
    if err["type"] == "extra_forbidden":
        return "unknown key"
    better = hint(err, path) if hint else None
    if better:
        return better
    msg = err["msg"]
    return msg[len("Value error, "):] if msg.startswith("Value error, ") else msg


def problems(errors: list[ErrorDetails], origin: str, lines: Lines, hint: Hint | None = None,
             locate: Callable[[KeyPath], KeyPath] | None = None) -> list[str]:
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


def validate(model: type[M], doc: Any, origin: str, lines: Lines | None = None,
             error: type[FileError] = FileError, hint: Hint | None = None,
             context: dict[str, Any] | None = None, locate: Callable[[KeyPath], KeyPath] | None = None) -> M:
    """The document as ``model``, or ``error`` listing every problem with its FILE:LINE."""
    try:
        return model.model_validate(doc, context=context)
    except ValidationError as e:
        raise error(problems(e.errors(), origin, lines or {}, hint, locate), origin) from None


def json_schema(model: type[BaseModel], title: str) -> dict[str, Any]:
    """The model's JSON Schema (draft 2020-12), keys as written in the files."""
    doc = model.model_json_schema(by_alias=True)
    doc["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    doc["title"] = title
    return doc
