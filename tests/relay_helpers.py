"""What the relay's tests share: the credentials of the loopback robots (robots.py) and a relay config routed to
them, Alertmanager's webhook payloads, and a client of the relay's webhook and /metrics (conftest.py's
start_relay fixture starts a relay whose environment is ENV)."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

from conftest import http_get, parse_metrics, post_json
from robots import FakeDingTalk, FakeWeCom

TOKEN = "dt-access-token-5f2c9a1e"
SECRET = "SECdt-signing-secret-77ab3c"
WKEY = "wecom-key-0c4e1d93"
WEBHOOK = "webhook-bearer-9e1f7d20"
ENV = {"DT_TOKEN": TOKEN, "DT_SECRET": SECRET, "WECOM_KEY": WKEY, "RELAY_TOKEN": WEBHOOK}
MOBILE = "13800000000"
WINDOW = 1.0  # the "minute" of both the relay and the fake robots, so rate tests take seconds


def relay_doc(dt: FakeDingTalk, wc: FakeWeCom, **over) -> dict:
    doc = {
        "bearer_token_env": "RELAY_TOKEN",
        "delivery": {"initial_backoff_seconds": 0.05, "max_backoff_seconds": 0.2, "max_retry_seconds": 5,
                     "request_timeout_seconds": 2, "drain_seconds": 2, "rate_window_seconds": WINDOW},
        "targets": {
            "dingtalk": {"type": "dingtalk", "url": dt.url, "token_env": "DT_TOKEN", "secret_env": "DT_SECRET",
                         "mention_mobiles": [MOBILE]},
            "wecom": {"type": "wecom", "url": wc.url, "token_env": "WECOM_KEY", "mention_userids": ["zhangsan"]},
        },
        "routes": [{"receivers": ["verl-critical"], "targets": ["dingtalk", "wecom"]},
                   {"receivers": ["verl-warning"], "targets": ["dingtalk"]},
                   {"receivers": ["verl-info"], "targets": []}],
    }
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(doc.get(key), dict):
            doc[key] = {**doc[key], **value}
        else:
            doc[key] = value
    return doc


def am_alert(name="VerlGpuXid", severity="critical", i=0, status="firing", **ann) -> dict:
    now = datetime.now(timezone.utc)
    return {"status": status, "labels": {"alertname": name, "severity": severity, "job": "verl", "run": "ppo",
                                         "rank": str(i), "instance": f"node{i:04d}:9477"},
            "annotations": {"summary": f"{name} on rank {i}", "description": "details",
                            "runbook_url": f"https://example.org/runbook#{name.lower()}", **ann},
            "startsAt": (now - timedelta(minutes=5)).isoformat().replace("+00:00", "Z"),
            "endsAt": now.isoformat().replace("+00:00", "Z") if status == "resolved" else "0001-01-01T00:00:00Z",
            "generatorURL": "http://prometheus:9090/graph", "fingerprint": f"{name}-{i}"}


def webhook(receiver: str, alerts: list[dict], status: str = "firing") -> dict:
    return {"version": "4", "groupKey": "{}:{}", "truncatedAlerts": 0, "status": status, "receiver": receiver,
            "groupLabels": {}, "commonLabels": {}, "commonAnnotations": {}, "externalURL": "http://am:9093",
            "alerts": alerts}


def post(relay, receiver: str, body, token: str | None = WEBHOOK, headers: dict | None = None,
         method: str = "POST") -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    hdrs = dict(headers or {})
    if token is not None:
        hdrs["Authorization"] = f"Bearer {token}"
    return post_json(f"{relay.url}/alert/{receiver}", data if method == "POST" else None, hdrs, method)


def metrics(relay) -> dict:
    status, _, body = http_get(relay.url + "/metrics")
    assert status == 200
    return parse_metrics(body.decode())

