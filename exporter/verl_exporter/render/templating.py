"""The Jinja environment the renderers share: templates shipped in the package, strict undefined names."""

from __future__ import annotations

import json

import jinja2


def quote(value) -> str:
    """A YAML scalar that means exactly this string.

    Single-quoted (PromQL reads best without backslashes) unless it holds characters that need escapes,
    then a JSON string (valid YAML double-quoted scalar).
    """
    text = str(value)
    if text.isprintable():
        return "'" + text.replace("'", "''") + "'"
    return json.dumps(text, ensure_ascii=False)


ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("verl_exporter.render", "templates"),
    undefined=jinja2.StrictUndefined,
    keep_trailing_newline=True,
    autoescape=False,  # YAML and JSON, not HTML; every string goes through |q
)
ENV.filters["q"] = quote


def render(template: str, **context) -> str:
    text = ENV.get_template(template).render(**context)
    return text if text.endswith("\n") else text + "\n"
