"""The paging path (only when asked: --relay-url, --prometheus-url): the relay answers /healthz with its
targets configured, and Prometheus has loaded the pack's alert rules and scrapes the run's targets."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from ...spec.rules import equality_matchers
from .report import Finding, Options

CHECK = "paging"
TIMEOUT_S = 5.0


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except RecursionError:  # nested deeper than the decoder goes: no answer either
        raise ValueError("an answer nested deeper than the JSON decoder goes") from None


def _get(url: str) -> tuple[int, Any]:
    """(HTTP status, parsed JSON body); raises OSError or ValueError when there is none."""
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as r:  # noqa: S310 - a URL the operator gave
            return r.status, _json(r.read(8 << 20))
    except urllib.error.HTTPError as e:
        return e.code, _json(e.read(1 << 20) or b"null")


def _relay(url: str) -> list[Finding]:
    try:
        code, body = _get(url.rstrip("/") + "/healthz")
    except (OSError, ValueError) as e:
        return [Finding(CHECK, False, f"the relay at {url} does not answer ({type(e).__name__}: {e}); start it "
                                      "(verl-exporter relay) or fix --relay-url")]
    targets = body.get("targets") if isinstance(body, dict) else None
    if code != 200:
        return [Finding(CHECK, False, f"the relay at {url} answers {code} ({str(body)[:80]}); it is draining or "
                                      "broken: restart it")]
    if not isinstance(targets, dict) or not targets:
        return [Finding(CHECK, False, f"the relay at {url} has no target configured: no page would reach anyone; "
                                      "add a target to its config")]
    return [Finding(CHECK, True, f"the relay at {url} answers with {len(targets)} target(s): "
                                 f"{', '.join(sorted(targets)[:4])}")]


def _prometheus(o: Options, url: str) -> list[Finding]:
    base = url.rstrip("/")
    try:
        _, rules = _get(base + "/api/v1/rules?type=alert")
        _, targets = _get(base + "/api/v1/targets?state=active")
        loaded = {r.get("name") for g in rules["data"]["groups"] for r in g.get("rules", [])}
        active = targets["data"]["activeTargets"]
        if not isinstance(active, list):
            raise TypeError("activeTargets is no list")
        # only targets shaped as Prometheus writes them count: a dict whose labels are a dict
        active = [t for t in active if isinstance(t, dict) and isinstance(t.get("labels", {}), dict)]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return [Finding(CHECK, False, f"Prometheus at {url} does not answer its API ({type(e).__name__}); fix "
                                      "--prometheus-url or start Prometheus")]
    out = []
    missing = sorted({a.alert for a in o.spec.alerts()} - loaded)
    if missing:
        out.append(Finding(CHECK, False, f"Prometheus at {url} lacks {len(missing)} of the pack's alert rules "
                                         f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}); load "
                                         "rules/verl-alerts.yaml (verl-exporter generate) and reload it"))
    want = equality_matchers(o.spec.rules.selector)
    if o.run:
        want["run"] = o.run
    ours = [t for t in active if all(t.get("labels", {}).get(k) == v for k, v in want.items())]
    down = [str(t.get("scrapeUrl", "?"))[:200] for t in ours if t.get("health") != "up"]
    what = ", ".join(f'{k}="{v}"' for k, v in want.items())
    if not ours:
        out.append(Finding(CHECK, False, f"Prometheus at {url} scrapes no target with {what}: the sidecars are not "
                                         "discovered (file_sd folder, scrape job); start them or fix discovery"))
    elif down:
        out.append(Finding(CHECK, False, f"{len(down)} of {len(ours)} targets with {what} are down "
                                         f"({', '.join(down[:3])}): start those sidecars or fix the network"))
    if not out:
        out.append(Finding(CHECK, True, f"Prometheus at {url} has the pack's alert rules and {len(ours)} "
                                        f"target(s) with {what} up"))
    return out


def check(o: Options) -> list[Finding]:
    if not o.relay_url and not o.prometheus_url:
        return [Finding(CHECK, True, "no --relay-url or --prometheus-url given: paging path not checked")]
    return (_relay(o.relay_url) if o.relay_url else []) + (_prometheus(o, o.prometheus_url) if o.prometheus_url
                                                             else [])
