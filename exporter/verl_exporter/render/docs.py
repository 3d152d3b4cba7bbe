"""The reference pages of the documentation (docs/reference/), from the spec: every metric, every alert (the
runbook the rules' runbook_url annotations point at), every knob, every alert kind. Never written by hand."""

from __future__ import annotations

import html
import inspect
import sys
import types
import typing
from typing import Any

from ..spec import FEEDS, Spec
from ..spec.kinds import KINDS, AlertBase
from ..spec.overrides import knob_range, knob_table
from .promql import alert_expr
from .templating import ENV, render

REFERENCE = "docs/reference"
PAGES = {"metrics": "metrics.md", "alerts": "alerts.md", "knobs": "knobs.md", "kinds": "kinds.md"}
LAYERS = {"data": "Training data", "compute": "Training compute", "resource": "Resources (GPU, host, disk)",
          "fault": "Faults (XID, checkpoints, progress)", "exporter": "The pack's own health"}


def code(text: object) -> str:
    """Inline code that survives a Markdown table: HTML-escaped, its pipes as entities."""
    return "<code>" + html.escape(str(text), quote=False).replace("|", "&#124;") + "</code>"


def prose(text: object) -> str:
    """Text as Markdown shows it as written: a <placeholder> is not an HTML tag."""
    return html.escape(str(text), quote=False)


def cell(text: object) -> str:
    """Prose in a table cell: one line, its pipes escaped."""
    return " ".join(prose(text).split()).replace("|", "\\|")


ENV.filters["code"] = code
ENV.filters["cell"] = cell
ENV.filters["prose"] = prose
ENV.filters["num"] = lambda value: f"{value:.12g}"  # reads back as the same number (bytes too)


def fed_by(m: Any) -> str:
    if m.source:
        return "<br>".join(code(s.pattern) for s in m.source)
    feed = next(k for k in FEEDS if k != "source" and getattr(m, k))
    words = {"field": "the line's", "collector": "collector", "instrumented_by": "set by the", "scraped_from":
             "scraped from", "events": "events:"}
    return f"{words[feed]} {code(getattr(m, feed))}"


def type_text(annotation: Any) -> str:
    """A field's type in words."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_text(args[0])
    if origin is typing.Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        kept = [a for a in args if a is not type(None)]
        if set(kept) == {int, float}:
            return "number"
        return " or ".join(type_text(a) for a in kept)
    if origin is dict:
        return f"a mapping of {type_text(args[1])}" if args else "a mapping"
    if origin is list:
        return f"a list of {type_text(args[0])}"
    return {str: "text", float: "number", int: "integer", bool: "true/false"}.get(annotation,
                                                                                 getattr(annotation, "__name__", "?"))


def kinds(spec: Spec) -> list[dict[str, Any]]:
    out = []
    for name, cls in KINDS.items():
        fields = []
        for field_name, f in cls.model_fields.items():
            if field_name in AlertBase.model_fields:
                continue
            default = "required" if f.is_required() else (
                "–" if f.default in (None, "") or f.default_factory else f"`{f.default}`")
            fields.append({"key": f.alias or field_name, "type": type_text(f.annotation), "default": default,
                           "description": f.description or ""})
        doc = inspect.cleandoc(sys.modules[cls.__module__].__doc__ or "").removeprefix(f"kind {name}: ")
        out.append({"name": name, "module": cls.__module__.rsplit(".", 1)[1], "doc": doc[:1].upper() + doc[1:],
                    "fields": fields,
                    "breaker": cls.judge is not AlertBase.judge, "explicit_test": cls.explicit_test,
                    "between_steps": cls.judged_between_steps, "on_entry": cls.on_entry,
                    "hard_safety": cls.hard_safety, "alerts": [a.alert for a in spec.alerts() if a.kind == name]})
    return out


def render_docs(spec: Spec) -> dict[str, str]:
    alerts = spec.alerts()
    layers = {layer: [m for m in spec.metrics if m.layer == layer] for layer in LAYERS}
    knobs = [{"row": r, "alert": r.knob.split(".", 1)[0]} for r in knob_table(spec)]
    # each alert's causes, from the other side's declarations: those that silence it (inhibits:) and those
    # that may explain it without silencing it (explains:)
    silenced_by: dict[str, list[str]] = {}
    explained_by: dict[str, list[str]] = {}
    for a in alerts:
        for target in a.inhibits:
            silenced_by.setdefault(target, []).append(a.alert)
        for target in a.explains:
            explained_by.setdefault(target, []).append(a.alert)
    ctx = {"spec": spec, "knob_range": knob_range, "layers": layers, "layer_titles": LAYERS, "fed_by": fed_by,
           "knobs": knobs,
           "alerts": [{"a": a, "expr": alert_expr(a, spec.rules.selector), "silenced_by": silenced_by.get(a.alert, []),
                       "explained_by": explained_by.get(a.alert, [])} for a in alerts], "kinds": kinds(spec)}
    return {f"{REFERENCE}/{page}": render(f"docs-{topic}.md.j2", **ctx) for topic, page in PAGES.items()}
