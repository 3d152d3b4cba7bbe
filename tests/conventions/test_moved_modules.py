"""Modules that moved into role folders keep their old import paths (a deprecation warning names the new one):
verl configs written for earlier versions name verl_exporter.verl_callback.ControlledCheckpointCallback."""

from __future__ import annotations

import subprocess
import sys

import pytest
from verl_exporter import MOVED


@pytest.mark.integration
def test_the_old_callback_path_is_the_class_at_its_new_place():
    code = ("import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            "try:\n    import verl_exporter.verl_callback\nexcept DeprecationWarning as w:\n    print(w)\n"
            "warnings.simplefilter('ignore')\n"
            "from verl_exporter.verl_callback import ControlledCheckpointCallback as Old\n"
            "from verl_exporter.trainer.verl_callback import ControlledCheckpointCallback as New\n"
            "import importlib\n"
            "assert Old is New and getattr(importlib.import_module('verl_exporter.verl_callback'),"
            " 'ControlledCheckpointCallback') is New\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "verl_exporter.verl_callback moved to verl_exporter.trainer.verl_callback" in out


# the verl callback's module imports verl: that one belongs to the integration tier
@pytest.mark.parametrize("old", [pytest.param(old, marks=pytest.mark.integration) if "verl_callback" in old else old
                                 for old in sorted(MOVED)])
def test_every_moved_module_imports_from_its_old_path(old):
    import importlib

    with pytest.warns(DeprecationWarning, match=f"moved to verl_exporter.{MOVED[old]}"):
        sys.modules.pop(f"verl_exporter.{old}", None)
        module = importlib.import_module(f"verl_exporter.{old}")
    assert module is importlib.import_module(f"verl_exporter.{MOVED[old]}")


def test_an_unknown_module_is_still_an_import_error():
    with pytest.raises(ModuleNotFoundError):
        __import__("verl_exporter.no_such_module")
