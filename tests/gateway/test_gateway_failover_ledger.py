"""The blame verdict on engines' error answers, without I/O."""

from __future__ import annotations

import pytest

from gateway.failover import ErrorAnswer, ErrorLedger

VLLM_500 = b'{"error":{"message":"","type":"InternalServerError","code":500}}'


@pytest.mark.parametrize(
    ("body", "message", "param"),
    [
        (b'{"error":{"message":"bad top_k","type":"BadRequestError","param":"top_k","code":400}}', "bad top_k",
         "top_k"),
        (b'{"detail":"Not Found"}', "Not Found", None),
        (VLLM_500, "", None),
        (b"<html>502</html>", "", None),
        (b"[" * 100_000, "", None),
        (b'{"error":{"message":5,"param":[]}}', "", None),
    ],
)
def test_error_bodies_are_read_whatever_their_shape(body, message, param):
    answer = ErrorAnswer.parse("e", 500, body, None)
    assert (answer.message, answer.param) == (message, param)


@pytest.mark.parametrize(("header", "seconds"), [("7", 7.0), ("0.5", 0.5), ("soon", None), ("-3", None),
                                                 ("1e999", None), (None, None)])
def test_retry_after_is_read_as_seconds(header, seconds):
    assert ErrorAnswer.parse("e", 429, b"", header).retry_after == seconds


def test_the_second_identical_server_error_blames_the_request():
    ledger = ErrorLedger()
    assert ledger.add(ErrorAnswer.parse("a", 500, VLLM_500, None)) is None
    assert ledger.add(ErrorAnswer("b", 503, "overloaded")) is None
    error = ledger.add(ErrorAnswer.parse("c", 500, VLLM_500, None))
    assert error is not None and error.status == 500 and "500" in error.message


def test_different_errors_and_429s_never_blame_the_request():
    ledger = ErrorLedger()
    for answer in (ErrorAnswer("a", 500, "x"), ErrorAnswer("b", 500, "y"), ErrorAnswer("c", 429),
                   ErrorAnswer("d", 429)):
        assert ledger.add(answer) is None
    assert ledger.all_rate_limited(4) is None


def test_all_429_answers_give_a_429_with_the_longest_retry_after():
    ledger = ErrorLedger()
    ledger.add(ErrorAnswer("a", 429, retry_after=3.0))
    ledger.add(ErrorAnswer("b", 429))
    busy = ledger.all_rate_limited(2)
    assert busy is not None and busy.status == 429 and busy.retry_after == 3.0
    assert ledger.all_rate_limited(3) is None, "an engine that failed otherwise was tried too"
