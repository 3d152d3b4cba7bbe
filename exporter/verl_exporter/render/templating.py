"""The Jinja environment the renderers share: templates shipped in the package, strict undefined names, and
values written only through serialising filters, so that quoting is right by construction:

* ``toyaml``: a scalar as the YAML emitter writes it (plain where plain reads back the same), on one line;
* ``q``: the same, always quoted (PromQL, label values, names: they read alike in every file);
* ``tojson``: JSON (a dashboard; an Alertmanager matcher's value, which takes JSON's escapes).
"""

from __future__ import annotations

import json
import math

import jinja2
import yaml

_BREAKS = ("\n", "\r", "\x85", "\u2028", "\u2029")


def to_yaml(value: str | int | float | bool | None, quoted: bool = False) -> str:
    """A YAML scalar, on one line, that loads back as exactly ``value``, as yaml.safe_dump writes it.

    A string with a line break is double-quoted (escaped ``\\n``): a single-quoted or plain scalar would fold
    onto lines of the emitter's indentation, not the template's. ``quoted`` single-quotes a string that
    plain style would leave bare (the emitter still double-quotes one that needs escapes).
    """
    style = None
    if isinstance(value, str):
        style = '"' if any(b in value for b in _BREAKS) else ("'" if quoted else None)
    text = yaml.safe_dump(value, default_style=style, width=math.inf, allow_unicode=True)
    return text.removesuffix("\n").removesuffix("\n...")  # a bare top-level scalar ends its document


def to_json(value, indent: int | None = None) -> str:
    """JSON as json.dumps writes it (Jinja's own tojson escapes <, >, & and ' for HTML)."""
    return json.dumps(value, indent=indent)


ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("verl_exporter.render", "templates"),
    undefined=jinja2.StrictUndefined,
    keep_trailing_newline=True,
    autoescape=False,  # YAML and JSON, not HTML: every value goes through toyaml, q or tojson
)
ENV.filters["toyaml"] = to_yaml
ENV.filters["q"] = lambda value: to_yaml(value, quoted=True)
ENV.filters["tojson"] = to_json


def render(template: str, **context) -> str:
    text = ENV.get_template(template).render(**context)
    return text if text.endswith("\n") else text + "\n"
