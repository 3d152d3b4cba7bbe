"""tests/ is laid out like the package, so that a module's tests are where a newcomer looks for them: a test
file for every module (or a reason on one of the lists below), and no test file named for a module that is gone."""

from __future__ import annotations

import ast
from pathlib import Path

import verl_exporter
from helpers import TESTS

PKG = Path(verl_exporter.__file__).parent


# ------------------------------------------------------------------------------------------- tests/ mirrors it
# A module's tests are tests/<its folder>/test_<module>.py, or test_<module>_<aspect>.py when they are several
# files (sidecar/progress.py: tests/sidecar/test_progress.py); an __init__.py's are named for its package
# (spec/__init__.py: tests/spec/test_spec*.py). These folders of tests/ mirror no package folder: their suites
# cross modules.
CROSS_CUTTING = {
    "conventions": "rules the whole package and the suite keep: the layouts, one declaration per meaning, the "
                   "unit tier's guard, the moved modules' old paths",
    "fuzz": "every input the pack reads (tests/boundaries.py) and the fuzz and property tests across them",
    "alerts": "the pack's alerts judged on whole runs with promtool (holds in steps, scenarios, host counters)",
    "stack": "the whole pack live: a sidecar, a real Prometheus and Alertmanager, the relay",
    "real_runs": "public verl runs (tests/data/real_runs) backtested",
    "verl": "the real verl package: its file logger followed, every key it can log",
    "deploy": "the deployment files under docker/",
}
# Modules with no test file of their own, each with why. (An __init__.py that defines no function or class, only
# its docstring, imports and registrations, has nothing of its own to test either.)
NO_TEST_FILE = {
    "__main__.py": "`python -m verl_exporter`: one call to cli.main",
    "relay/__main__.py": "`python -m verl_exporter.relay`: one call to relay.cli.main",
    "__init__.py": "the package root: Monitor, imported lazily, and the moved modules' old import paths, which "
                   "conventions/test_moved_modules.py holds",
    "exposition/__init__.py": "the names of the old exposition module, forwarded to exposition.encode",
}
# Modules whose tests are still in the test file of another module (it imports the module or its package): each
# moves to its own file when its tests are next touched, and leaves this list.
TESTED_IN = {
    "sidecar/events.py": "sidecar/test_store.py",  # evaluations are counted as the store ingests a step
    "checkpoint/cli.py": "checkpoint/test_manifest.py",
    "exposition/encode.py": "fuzz/test_boundary.py",
    "exposition/families.py": "sidecar/collectors/test_sampler.py",
    "relay/cli.py": "relay/test_app.py",
    "relay/config.py": "relay/test_app.py",
    "relay/metrics.py": "relay/test_app.py",
    "relay/nofollow.py": "relay/test_actions.py",
    "relay/preview.py": "relay/test_terminal_console.py",
    **{f"render/{m}.py": "render/test_render_generate.py"
       for m in ("docs", "kubernetes", "prometheus", "promql", "rules", "templating")},
    "sidecar/collectors/base.py": "sidecar/collectors/test_sampler.py",
    "sidecar/collectors/checkpoint.py": "checkpoint/test_manifest.py",
    "sidecar/collectors/cpu.py": "sidecar/collectors/test_host.py",
    "sidecar/collectors/nvml.py": "sidecar/collectors/test_gpu.py",
    "sidecar/collectors/preflight.py": "tools/preflight/test_cli.py",
    "sidecar/node.py": "sidecar/test_file_sd_discovery.py",
    "spec/panels.py": "spec/test_spec_fields.py",
    "spec/rules.py": "spec/kinds/test_kinds.py",
    # each kind is judged against its own promtool test there, one parameter per registered kind
    **{f"spec/kinds/{m}.py": "spec/kinds/test_kinds.py"
       for m in ("base", "condition", "detector", "expr", "latency_spike", "nonfinite", "promql", "promtool", "stale",
                 "threshold")},
    "tools/agreement.py": "tools/test_replay_scenarios.py",
    "tools/nodes.py": "alerts/test_scenarios.py",
    **{f"tools/preflight/{m}.py": "tools/preflight/test_cli.py" for m in ("disk", "fabric", "gpus", "report")},
    "trainer/breaker.py": "sidecar/test_control.py",
}


def modules() -> list[str]:
    """Every module of the package, as its path under the package ("sidecar/progress.py")."""
    return sorted(str(p.relative_to(PKG)) for p in PKG.rglob("*.py"))


def defines_something(module: str) -> bool:
    tree = ast.parse((PKG / module).read_text())
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) for n in tree.body)


def suite_files() -> list[Path]:
    """Every test file of the suite, as its path under tests/."""
    return sorted(p.relative_to(TESTS) for p in TESTS.rglob("test_*.py")
                  if p.relative_to(TESTS).parts[0] not in ("data", "fixtures"))


def module_of(test_file: Path) -> str | None:
    """The module a test file under a mirror folder is named for (the longest name that fits), else None."""
    folder = PKG / test_file.parent
    if not (folder / "__init__.py").exists():
        return None
    names = {p.stem: str(p.relative_to(PKG)) for p in folder.glob("*.py") if not p.stem.startswith("__")}
    # the package's own name is its __init__.py's (sidecar/sidecar.py keeps "sidecar" for itself)
    names.setdefault(folder.name, str((folder / "__init__.py").relative_to(PKG)))
    stem = test_file.stem.removeprefix("test_")
    fits = [n for n in names if stem == n or stem.startswith(n + "_")]
    return names[max(fits, key=len)] if fits else None


def mirrored() -> dict[str, list[str]]:
    """{module: its test files} for the test files under the mirror folders."""
    out: dict[str, list[str]] = {}
    for path in suite_files():
        if path.parts[0] not in CROSS_CUTTING and (module := module_of(path)):
            out.setdefault(module, []).append(str(path))
    return out


def test_every_module_has_a_test_file_at_its_mirrored_path():
    have = mirrored()
    missing = [m for m in modules() if m not in have and m not in NO_TEST_FILE and m not in TESTED_IN
               and (Path(m).name != "__init__.py" or defines_something(m))]
    assert missing == [], ("modules with no tests/<folder>/test_<module>.py (write one, or say why in NO_TEST_FILE "
                           f"in {Path(__file__).name}): {missing}")


def test_every_test_file_under_tests_mirrors_a_module_or_is_in_a_cross_cutting_folder():
    stale = [str(p) for p in suite_files() if p.parts[0] not in CROSS_CUTTING and module_of(p) is None]
    assert stale == [], ("test files named for no module of the package (renamed? moved?), or in a folder "
                         f"that mirrors no package folder and is not in CROSS_CUTTING: {stale}")


def test_the_lists_of_modules_without_a_test_file_are_true():
    have, known = mirrored(), set(modules())
    assert sorted(set(NO_TEST_FILE) - known) == [] and sorted(set(TESTED_IN) - known) == []
    assert sorted(set(TESTED_IN) & set(have)) == [], "modules that have a test file now: take them off TESTED_IN"
    assert sorted(set(NO_TEST_FILE) & set(TESTED_IN)) == []
    for module, test_file in TESTED_IN.items():
        dotted = "verl_exporter." + module.removesuffix(".py").replace("/", ".")
        imported = imports_in(TESTS / test_file)
        assert dotted in imported or dotted.rpartition(".")[0] in imported, (module, test_file)
    assert all((TESTS / folder).is_dir() for folder in CROSS_CUTTING)


def imports_in(path: Path) -> set[str]:
    """The verl_exporter modules and packages a test file imports (each dotted prefix of what it names)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("verl_exporter"):
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names if a.name.startswith("verl_exporter")}
    return {".".join(n.split(".")[:i]) for n in names for i in range(1, n.count(".") + 2)}
