"""The package's layout is its architecture: each role folder imports only what its docstring allows, so that
no runtime module pulls in the generator and the training process loads no offline tool."""

from __future__ import annotations

import ast
from pathlib import Path

import verl_exporter

PKG = Path(verl_exporter.__file__).parent
ROLES = ("core", "spec", "exposition", "render", "sidecar", "trainer", "checkpoint", "relay", "tools")
# what each role may import from the package (besides itself); spec's one exception is core.detect
ALLOWED = {
    "core": set(),  # the ground: it imports nothing above it
    "exposition": {"core", "spec"},
    "spec": {"core.detect", "core.models"},
    "render": {"spec"},
    "sidecar": {"exposition", "core", "spec", "checkpoint"},
    "trainer": {"exposition", "sidecar", "core", "spec", "checkpoint"},
    "checkpoint": {"core"},
    "relay": {"exposition", "core", "spec"},
    "tools": set(ROLES) | {""},
}


def imports_of(path: Path) -> list[str]:
    """Absolute module names (within verl_exporter, without the prefix) that a module imports."""
    rel = path.relative_to(PKG).with_suffix("")
    here = list(rel.parts[:-1]) if rel.name != "__init__" else list(rel.parts[:-1])
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = here[: len(here) - (node.level - 1)] if node.level > 1 else here
            target = ".".join(base + ([node.module] if node.module else []))
            names = [target] if node.module else [f"{target}.{a.name}".lstrip(".") for a in node.names]
            out.extend(names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("verl_exporter"):
            out.append(node.module.removeprefix("verl_exporter").lstrip("."))
    return out


def allowed(role: str, target: str) -> bool:
    if target in ("", "__version__") or target.split(".")[0] == role:
        return True
    return any(target == a or target.startswith(a + ".") for a in ALLOWED[role])


def test_every_module_lives_in_a_role_folder():
    loose = sorted(p.name for p in PKG.glob("*.py") if p.name not in {"__init__.py", "__main__.py", "cli.py"})
    assert loose == []
    assert sorted(p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()) == sorted(ROLES)


def test_each_role_imports_only_what_its_docstring_allows():
    broken = []
    for role in ROLES:
        for path in sorted((PKG / role).rglob("*.py")):
            broken += [f"{path.relative_to(PKG)} imports {t}" for t in imports_of(path) if not allowed(role, t)]
    assert broken == []


def test_each_role_folder_says_what_lives_there_and_what_it_may_import():
    for role in ROLES:
        doc = ast.get_docstring(ast.parse((PKG / role / "__init__.py").read_text())) or ""
        assert "May import" in doc, role
