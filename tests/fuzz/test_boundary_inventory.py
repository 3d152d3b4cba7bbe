"""The boundary inventory (tests/boundaries.py) is complete and true.

- every function of the package that reads something from outside (a call found by the AST walk below: open,
  read_text, read_bytes, read, readline, recv, json and YAML loads, directory listings, urlopen and its
  answers, os.environ and getenv, a WSGI request's environ, argv, another process's environ or cmdline) is
  named by an inventory entry, or by NOT_INPUTS with the reason it is none;
- every function an entry names is still there (a renamed or moved reader is not silently dropped);
- every test an entry names exists.
"""

from __future__ import annotations

import ast

import pytest
from boundaries import INVENTORY, KINDS, NOT_INPUTS, PACKAGE, REPO

READ_METHODS = {"read_text", "read_bytes", "read", "readline", "readlines", "readinto", "recv", "recv_into",
                "getresponse", "urlopen", "iterdir", "glob", "rglob", "scandir", "listdir",
                "parse_args", "parse_known_args", "cmdline"}
LOADERS = {"json": {"load", "loads"}, "yaml": {"load", "safe_load", "load_all", "safe_load_all", "compose"},
           "pickle": {"load", "loads"}, "tomllib": {"load", "loads"}, "os": {"getenv", "read", "pread"}}


def _writes_only(call: ast.Call) -> bool:
    """An open() whose literal mode (or os.open flags) only writes: not an input."""
    if isinstance(call.func, ast.Attribute) and ast.unparse(call.func.value) == "os":
        flags = ast.unparse(call.args[1]) if len(call.args) > 1 else ""
        return "O_WRONLY" in flags and "O_RDWR" not in flags
    modes = [a for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    modes += [k.value for k in call.keywords if k.arg == "mode" and isinstance(k.value, ast.Constant)]
    return any(isinstance(m.value, str) and "r" not in m.value and "+" not in m.value for m in modes)


def _is_read(node: ast.AST) -> str | None:
    """What node reads from outside, in a few words; None when it reads nothing."""
    text = ast.unparse(node) if isinstance(node, (ast.Attribute, ast.Subscript)) else ""
    if text in ("os.environ", "sys.argv", "sys.stdin"):
        return text
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "environ":
        return "a WSGI request's environ"
    if not isinstance(node, ast.Call):
        return None
    f = node.func
    if isinstance(f, ast.Name):
        if f.id == "open" and not _writes_only(node):
            return "open()"
        return f.id if f.id in ("urlopen", "getenv") else None
    if not isinstance(f, ast.Attribute):
        return None
    base = ast.unparse(f.value)
    if f.attr == "open":
        return None if _writes_only(node) else f"{base}.open()"
    if f.attr in LOADERS.get(base, ()):
        return f"{base}.{f.attr}()"
    if isinstance(f.value, ast.Name) and f.value.id == "environ" and f.attr == "get":
        return "a WSGI request's environ"
    if f.attr == "get" and base.endswith(".environ") and base != "os.environ":  # ctx.environ: os.environ's copy
        return f"{base}.get()"
    if f.attr == "environ":  # psutil: another process's environment
        return ".environ()"
    return f".{f.attr}()" if f.attr in READ_METHODS else None


def walk_package() -> tuple[dict[str, set[str]], set[str]]:
    """({"module.py::Class.function": {what it reads}}, every "module.py::Class.function" there is)."""
    sites: dict[str, set[str]] = {}
    functions: set[str] = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()

        def walk(node: ast.AST, scope: tuple[str, ...], module: str = module) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    functions.add(f"{module}::{'.'.join((*scope, child.name))}")
                    walk(child, (*scope, child.name))
                    continue
                if (what := _is_read(child)) is not None:
                    sites.setdefault(f"{module}::{'.'.join(scope) or '<module>'}", set()).add(what)
                walk(child, scope)

        walk(ast.parse(path.read_text(encoding="utf-8")), ())
    return sites, functions


SITES, FUNCTIONS = walk_package()


def test_every_function_that_reads_an_input_is_in_the_inventory():
    named = {r for b in INVENTORY for r in b.readers} | set(NOT_INPUTS)
    missing = {site: sorted(what) for site, what in SITES.items() if site not in named}
    assert not missing, ("functions reading an input no entry of tests/boundaries.py names (add a Boundary with "
                         f"its fuzz test, or a NOT_INPUTS line saying why it is none): {missing}")


def test_every_function_the_inventory_names_is_there():
    """A reader renamed or moved is not silently dropped (a reader may be an API that reads no file: Monitor.log);
    a NOT_INPUTS line is for a function the walk finds."""
    gone = sorted({r for b in INVENTORY for r in b.readers} - FUNCTIONS)
    assert not gone, f"tests/boundaries.py names functions that are not in the package (renamed? moved?): {gone}"
    stale = sorted(set(NOT_INPUTS) - set(SITES))
    assert not stale, f"NOT_INPUTS names functions that read nothing any more: {stale}"


def _test_exists(ref: str) -> bool:
    path, _, name = ref.partition("::")
    file = REPO / path
    if not file.is_file() or not name:
        return False
    tree = ast.parse(file.read_text(encoding="utf-8"))
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name and n.name.startswith("test")
               for n in tree.body)


@pytest.mark.parametrize("boundary", INVENTORY, ids=lambda b: b.input[:60])
def test_every_entry_names_its_kind_readers_and_existing_tests(boundary):
    assert boundary.kind in KINDS
    assert boundary.readers and boundary.tests
    missing = [t for t in boundary.tests if not _test_exists(t)]
    assert not missing, f"{boundary.input}: no such test {missing}"


def test_the_walk_finds_the_reads_it_is_meant_to():
    """The scanner itself: a read of each kind is found, a write-only open is not (so the first test can fail)."""
    code = ("def f(environ, p, os, json, yaml):\n"
            "    open(p); open(p, 'w'); os.open(p, os.O_WRONLY | os.O_CREAT); p.read_text(); json.loads(b'')\n"
            "    yaml.safe_load(''); os.environ.get('X'); environ.get('PATH_INFO'); p.glob('*')\n")
    found = [w for n in ast.walk(ast.parse(code)) if (w := _is_read(n))]
    assert sorted(found) == sorted(["open()", ".read_text()", "json.loads()", "yaml.safe_load()", "os.environ",
                                    "a WSGI request's environ", ".glob()"])
