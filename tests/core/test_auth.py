"""One bearer-token check (RFC 6750) for the sidecar's /control endpoint and the relay's webhook: the same
Authorization headers are let in, or refused, by both."""

from __future__ import annotations

import io

import pytest
from verl_exporter.core.auth import bearer_token_ok
from verl_exporter.exposition.selfmetrics import SelfMetrics
from verl_exporter.relay.app import RelayApp
from verl_exporter.relay.config import parse_config
from verl_exporter.relay.dispatch import Dispatcher
from verl_exporter.relay.metrics import RelayMetrics
from verl_exporter.sidecar.control import ControlState, make_control_app
from verl_exporter.spec import load_spec

TOKEN = "tok-3f9a.~+/="
HEADERS = [
    # (Authorization header, let in)
    (f"Bearer {TOKEN}", True),
    (f"bearer {TOKEN}", True),  # RFC 9110 11.1: the scheme is case-insensitive
    (f"BEARER {TOKEN}", True),
    (f"Bearer   {TOKEN}", True),  # 1*SP between scheme and token
    (f"  Bearer {TOKEN}  ", True),  # optional white space around a field value (RFC 9110 5.5)
    (None, False),
    ("", False),
    ("Bearer", False),
    ("Bearer ", False),
    (TOKEN, False),
    (f"Basic {TOKEN}", False),
    (f"Bearer{TOKEN}", False),
    (f"Bearer {TOKEN}x", False),
    (f"Bearer {TOKEN[:-1]}", False),
    (f"Bearer {TOKEN.upper()}", False),  # the token itself is compared exactly
    (f"Bearer {TOKEN} {TOKEN}", False),
    ("Bearer tök-3f9a", False),  # a non-ASCII guess is a wrong token, not a crash
]


@pytest.mark.parametrize("header, ok", HEADERS)
def test_the_check(header, ok):
    assert bearer_token_ok(header, TOKEN) is ok


def test_an_empty_configured_token_lets_nobody_in():
    assert not bearer_token_ok("Bearer ", "")
    assert not bearer_token_ok("Bearer x", "")


def call(app, path: str, header: str | None, body: bytes) -> str:
    environ = {"PATH_INFO": path, "REQUEST_METHOD": "POST", "CONTENT_LENGTH": str(len(body)),
               "wsgi.input": io.BytesIO(body)}
    if header is not None:
        environ["HTTP_AUTHORIZATION"] = header
    seen = {}
    app(environ, lambda status, headers: seen.update(status=status))
    return seen["status"]


@pytest.fixture(scope="module")
def spec():
    return load_spec()


@pytest.mark.parametrize("header, ok", HEADERS)
def test_the_sidecar_control_endpoint(tmp_path, spec, header, ok):
    app = make_control_app(ControlState(str(tmp_path / "control.json")), TOKEN, SelfMetrics(spec))
    status = call(app, "/control/checkpoint", header, b"{}")
    assert status.startswith("200" if ok else "401"), status
    assert (tmp_path / "control.json").exists() is ok


@pytest.mark.parametrize("header, ok", HEADERS)
def test_the_relay_webhook(header, ok):
    config = parse_config({"bearer_token_env": "RELAY_TOKEN",
                           "targets": {"dt": {"type": "dingtalk", "url": "http://127.0.0.1:9/robot/send",
                                              "token_env": "DT"}},
                           "routes": [{"targets": ["dt"]}]}, environ={"RELAY_TOKEN": TOKEN, "DT": "t"})
    metrics = RelayMetrics()
    app = RelayApp(config, Dispatcher(config, metrics), metrics)
    status = call(app, "/alert/verl-warning", header, b"not a webhook")
    assert status.startswith("400" if ok else "401"), status  # let in, then refused for its body
