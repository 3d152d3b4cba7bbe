"""The JSON Schemas of the files verl-exporter reads, from their typed models (core.models): printed by
`verl-exporter schema KIND` and written by `generate` to docker/schemas/, where the example files point
(`# yaml-language-server: $schema=...`) for editor completion and checking."""

from __future__ import annotations

import json
from collections.abc import Callable

from ..spec import Spec

SCHEMA_DIR = "docker/schemas"


def _overrides(spec: Spec) -> dict:
    from ..spec.overrides import schema

    return schema(spec)


def _spec(spec: Spec) -> dict:
    from ..spec import schema

    return schema()


def _relay(spec: Spec) -> dict:
    from ..relay.config import schema

    return schema()


def _config(spec: Spec) -> dict:
    from ..sidecar.config import schema

    return schema()


# kind -> (what it describes, the function that writes its schema for a spec)
SCHEMAS: dict[str, tuple[str, Callable[[Spec], dict]]] = {
    "overrides": ("verl-exporter.yaml: knobs over the packaged alert pack", _overrides),
    "spec": ("spec/metrics/*.yaml: every metric, its alerts, panels, recordings and adaptive signals", _spec),
    "config": ("verl-exporter serve --config: the sidecar's settings", _config),
    "relay": ("relay.yaml: Alertmanager webhooks to DingTalk / WeCom robots, and the automated response", _relay),
}


def schema(kind: str, spec: Spec) -> dict:
    return SCHEMAS[kind][1](spec)


def schema_files(spec: Spec) -> dict[str, str]:
    """{path relative to the repo root: JSON text} of every schema."""
    return {f"{SCHEMA_DIR}/{kind}.schema.json": json.dumps(schema(kind, spec), indent=2) + "\n" for kind in SCHEMAS}
