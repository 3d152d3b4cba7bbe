"""Each setting is declared once (sidecar/config.py ServeConfig): the serve flags are derived from it, and the
flag table of the sidecar's page (docs/sidecar.md) names exactly those flags."""

from __future__ import annotations

import re

import pytest
from conftest import REPO
from verl_exporter.cli import build_parser
from verl_exporter.sidecar.config import ServeConfig, build_config, flag_name, flag_values


def one_per_setting(flags) -> set[str]:
    """--no-X is --X; each collector's switch is --collector.NAME."""
    return {re.sub(r"^--collector\..*", "--collector.NAME", re.sub("^--no-", "--", f)) for f in flags} - {"--config"}


def serve_flags() -> set[str]:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    flags = {opt for action in serve._actions for opt in action.option_strings if opt.startswith("--")}
    return one_per_setting(flags) - {"--help"}


def documented_flags() -> set[str]:
    text = (REPO / "docs/sidecar.md").read_text()
    table = text[text.index("| flag (or `--config` YAML key) |"):]
    table = table[: table.index("\n\n")]
    return one_per_setting(re.findall(r"--[a-z][\w.-]*", table))


def test_every_setting_is_a_flag_and_every_flag_a_setting():
    fields = {flag_name(name) for name in ServeConfig.model_fields if name != "collectors"}
    assert serve_flags() == fields | {"--collector.NAME"}


def test_the_docs_table_names_exactly_the_flags():
    assert documented_flags() == serve_flags()


def test_a_flag_without_a_setting_is_an_error_not_dropped():
    with pytest.raises(ValueError, match="flags without a setting: \\['frobnicate'\\]"):
        build_config({}, {"frobnicate": 1})


def test_the_flags_parse_into_the_config():
    args = build_parser().parse_args(["serve", "--interval", "5", "--label", "zone=a", "--watch-path", "/x",
                                      "--no-forensics-native", "--gpu-pcie-throughput", "--rank", "3",
                                      "--no-collector.gpu"])
    config = build_config({}, flag_values(vars(args)))
    assert (config.interval, config.labels, config.watch_paths, config.forensics_native,
            config.gpu_pcie_throughput, config.rank, config.collectors) == \
        (5.0, {"zone": "a"}, ("/x",), False, True, 3, {"gpu": False})
