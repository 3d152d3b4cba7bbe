"""The unit tier's guard catches a test that starts a process or opens a socket without the integration mark,
even where the code under test swallows the error; marked tests and pure ones pass."""

from __future__ import annotations

import pytest
from conftest import REPO

pytestmark = pytest.mark.integration  # runs a pytest session of its own


def test_the_guard_fails_unmarked_tests_that_reach_outside(pytester):
    pytester.makeconftest(f"import sys\nsys.path.insert(0, {str(REPO / 'tests')!r})\n"
                          "pytest_plugins = ['unit_guard']\n")
    pytester.makeini("[pytest]\nmarkers =\n    integration: real programs\n")
    pytester.makepyfile(test_inner="""
import socket
import subprocess
import threading

import pytest


def test_pure():
    assert sum([1, 2]) == 3


def test_process_swallowed():
    try:
        subprocess.run(["true"], check=False)
    except Exception:
        pass  # the code under test carries on; the guard still fails the test


def test_socket_in_a_new_thread():
    def connect():
        try:
            socket.create_connection(("127.0.0.1", 9), timeout=0.1)
        except Exception:
            pass
    t = threading.Thread(target=connect)
    t.start()
    t.join()


@pytest.fixture
def server():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    yield s
    s.close()


def test_fixture_opens_a_socket(server):
    pass


@pytest.mark.integration
def test_marked_may(server):
    assert subprocess.run(["true"]).returncode == 0
""")
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    outcomes = {line.split("::")[1].split(" ")[0]: line.split(" ")[0]
                for line in result.outlines if "test_inner.py::" in line and line.startswith(("FAILED", "ERROR"))}
    assert outcomes == {"test_process_swallowed": "FAILED", "test_socket_in_a_new_thread": "FAILED",
                        "test_fixture_opens_a_socket": "ERROR"}, result.stdout.str()
    result.assert_outcomes(passed=2, failed=2, errors=1)
    assert "without @pytest.mark.integration" in result.stdout.str()
