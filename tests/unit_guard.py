"""The unit tier stays a unit tier: a test without the `integration` mark may not start a process, open a
network socket or import verl. `pytest -m "not integration"` is then the fast tier a contributor runs in
seconds, with no server, no Debian package and no verl.

A forbidden call raises at once (so a forgotten mark costs no server start-up) and is also recorded, so the
test fails even where the code under test catches the error and carries on (a collector that counts a
failed py-spy run, say). Only the test's own threads are watched: threads left running by an earlier
integration test may still talk to their servers.
"""

from __future__ import annotations

import ast
import multiprocessing.util
import os
import socket
import subprocess
import sys
import threading

import pytest

MARK = "integration"


class UnitTierViolation(RuntimeError):
    pass


class _Guard:
    def __init__(self):
        self.active = False
        self.old_threads: set[int] = set()
        self.found: list[str] = []

    def check(self, what: str) -> None:
        thread = threading.current_thread()
        if not self.active or (thread is not threading.main_thread() and thread.ident in self.old_threads):
            return
        self.found.append(what)
        raise UnitTierViolation(f"{what} in a test without @pytest.mark.{MARK}: mark the test (or its module "
                                f"with pytestmark = pytest.mark.{MARK}), or keep it in-process")


GUARD = _Guard()
LOADS_VERL = pytest.StashKey[bool]()
VERL_BEFORE = pytest.StashKey[object]()  # the verl module loaded when the test's setup began, if any


def _wrap(owner, name: str, what):
    real = getattr(owner, name)

    def guarded(*args, **kwargs):
        GUARD.check(what(*args) if callable(what) else what)
        return real(*args, **kwargs)

    setattr(owner, name, guarded)


def _socket_use(verb: str):
    def describe(sock, *args):
        return f"socket.{verb}({args[0]!r})" if sock.family in (socket.AF_INET, socket.AF_INET6) else ""
    return describe


class _NetSocketGuard:
    """bind/connect on internet sockets only: a Unix socketpair (asyncio's self-pipe) is in-process."""

    @staticmethod
    def install():
        for verb in ("bind", "connect", "connect_ex"):
            real = getattr(socket.socket, verb)
            describe = _socket_use(verb)

            def guarded(sock, *args, _real=real, _describe=describe):
                what = _describe(sock, *args)
                if what:
                    GUARD.check(what)
                return _real(sock, *args)

            setattr(socket.socket, verb, guarded)


def install() -> None:
    _wrap(subprocess.Popen, "_execute_child", lambda popen, args, *rest: f"starting a process {str(args)[:80]}")
    _wrap(os, "fork", "os.fork()")
    _wrap(os, "posix_spawn", "os.posix_spawn()")
    _wrap(multiprocessing.util, "spawnv_passfds", "starting a multiprocessing child")
    _NetSocketGuard.install()


install()


def _watched(item):
    """Run one phase of a test (setup, call, teardown) under the guard; fail it on what the guard found."""
    unit = item.get_closest_marker(MARK) is None
    # None: not loaded, or blocked by the test (sys.modules["verl"] = None); putting back the module loaded
    # before the test (a fixture's teardown) is no import
    had_verl = {id(sys.modules.get("verl")), id(item.stash.setdefault(VERL_BEFORE, sys.modules.get("verl")))}
    GUARD.active, GUARD.found = unit, []
    if item.stash.get(LOADS_VERL, False):
        GUARD.found.append("its module imports verl as it loads (import it inside the tests that need it)")
    GUARD.old_threads = {t.ident for t in threading.enumerate() if t is not threading.main_thread()}
    try:
        result = yield
    finally:
        GUARD.active = False
    if unit and sys.modules.get("verl") is not None and id(sys.modules["verl"]) not in had_verl:
        GUARD.found.append("importing verl")
        # forget it, so that the next unit test that imports verl is caught too
        for name in [n for n in sys.modules if n == "verl" or n.startswith("verl.")]:
            del sys.modules[name]
    if unit and GUARD.found:
        pytest.fail(f"{item.nodeid} is in the unit tier but did: {'; '.join(dict.fromkeys(GUARD.found))}. "
                    f"Add @pytest.mark.{MARK} (or pytestmark = pytest.mark.{MARK}) or keep it in-process.",
                    pytrace=False)
    return result


def _imports_verl_on_load(path) -> bool:
    """Whether a test module imports verl as it loads (collection): then none of its tests is a unit test."""
    for node in ast.parse(path.read_text()).body:
        for sub in ast.walk(node) if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) else ():
            if isinstance(sub, ast.Import) and any(a.name.split(".")[0] == "verl" for a in sub.names):
                return True
            if isinstance(sub, ast.ImportFrom) and (sub.module or "").split(".")[0] == "verl" and not sub.level:
                return True
            if (isinstance(sub, ast.Call) and getattr(sub.func, "attr", "") == "importorskip" and sub.args
                    and isinstance(sub.args[0], ast.Constant) and str(sub.args[0].value).split(".")[0] == "verl"):
                return True
    return False


def pytest_collection_modifyitems(items):
    loads_verl = {}
    for item in items:
        path = item.path
        if item.get_closest_marker(MARK) is None and path.suffix == ".py":
            if path not in loads_verl:
                loads_verl[path] = _imports_verl_on_load(path)
            if loads_verl[path]:
                item.stash[LOADS_VERL] = True


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _watched(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _watched(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    return (yield from _watched(item))
