"""A robot's answer is outside input: any body classifies as delivered, retried or failed, and never raises.

An answer that is not JSON with an integer errcode (a float, 1e999, a bool, a string, a nested list) is a bad
answer, retried as any other; the errcode label stays within the codes the relay knows.
"""

from __future__ import annotations

import json

import pytest
from helpers import robot_target
from hypothesis import given, settings
from hypothesis import strategies as st
from verl_exporter.relay.senders import KNOWN_ERRCODES, RETRYABLE_ERRCODES, RobotSender

KINDS = ("dingtalk", "wecom", "lark")
FIELD = {"dingtalk": "errcode", "wecom": "errcode", "lark": "code"}
SECRET = "robot-token-5e9c1a"


def sender(kind: str) -> RobotSender:
    url = "https://open.feishu.cn/open-apis/bot/v2/hook" if kind == "lark" else "https://robot.invalid"
    return RobotSender(robot_target(kind, url, SECRET))


def labels(kind: str) -> set[str]:
    return {"0", "other", "bad_response"} | {str(c) for c in (*RETRYABLE_ERRCODES[kind], *KNOWN_ERRCODES[kind])}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("code", ["1e999", "-1e999", "NaN", "Infinity", "0.5", "0.0", "true", "false", '"0"',
                                  "null", "[0]", '{"a": 0}', "1" + "0" * 400])
def test_an_errcode_that_is_no_integer_is_a_bad_answer_retried(kind, code):
    result = sender(kind)._classify(f'{{"{FIELD[kind]}": {code}, "msg": "x"}}'.encode())
    assert not result.ok and result.retryable and result.errcode == "bad_response"


@pytest.mark.parametrize("kind", KINDS)
def test_an_answer_nested_deeper_than_the_decoder_goes_is_a_bad_answer(kind):
    result = sender(kind)._classify(b"[" * 60000 + b"]" * 5000)
    assert not result.ok and result.retryable and result.errcode == "bad_response"


@pytest.mark.parametrize("kind", KINDS)
def test_an_unknown_errcode_is_counted_as_other_and_named_in_the_log(kind):
    result = sender(kind)._classify(json.dumps({FIELD[kind]: 987654321, "msg": "odd"}).encode())
    assert not result.ok and not result.retryable and result.errcode == "other"
    assert "errcode 987654321" in result.detail


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(10**40), 10**40), st.floats(), st.text(max_size=10),
              st.just(SECRET)),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner, max_size=3),
    max_leaves=10)
answers = st.one_of(
    json_values.map(lambda v: json.dumps(v).encode()),
    st.dictionaries(st.sampled_from(["code", "errcode", "StatusCode", "msg", "errmsg", "StatusMessage"]),
                    json_values, max_size=4).map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=64))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(KINDS), answers)
def test_any_answer_classifies_without_raising_with_a_bounded_label_and_no_secret(kind, raw):
    result = sender(kind)._classify(raw)
    assert result.errcode in labels(kind)
    assert SECRET not in result.detail and "\n" not in result.detail
    assert result.ok == (result.errcode == "0")
