"""When the router may send P's first token ahead of D's stream, and what it takes out of D's stream."""
import pytest

from kvturn.router.first_token import FirstToken, FirstTokenMismatch, may_send_ahead

PREFILL = {"id": "chatcmpl-p", "created": 1, "model": "m", "kv_transfer_params": {"first_token_id": 42},
           "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello"}, "finish_reason": "length"}]}


@pytest.mark.parametrize("extra, chat, allowed", [
    ({}, True, True),
    ({"logprobs": False}, True, True),
    ({"logprobs": True}, True, False),
    ({"logprobs": 0}, False, False),  # completions: 0 asks for the sampled token's logprob, which D computes
    ({"logprobs": False}, False, False),
    ({"top_logprobs": 2}, True, False),
    ({"stop": ["\n"]}, True, False),
    ({"seed": 3}, True, False),
    ({"n": 2}, True, False),
])
def test_only_requests_whose_first_token_d_takes_over_unchanged_are_sent_ahead(extra, chat, allowed):
    assert may_send_ahead({"stream": True, **extra}, chat) is allowed


def test_prefills_answer_decides_the_rest():
    body = {"stream": True}
    assert FirstToken.from_prefill(body, PREFILL, chat=True).text == "Hello"
    finished = {**PREFILL, "choices": [{**PREFILL["choices"][0], "finish_reason": "stop"}]}
    assert FirstToken.from_prefill(body, finished, chat=True) is None  # EOS or a stop token: D would stop too
    partial = {**PREFILL, "choices": [{**PREFILL["choices"][0], "message": {"content": "\ufffd"}}]}
    assert FirstToken.from_prefill(body, partial, chat=True) is None  # half a UTF-8 character
    assert FirstToken.from_prefill(body, {**PREFILL, "kv_transfer_params": None}, chat=True) is None


def test_ds_stream_loses_its_role_and_the_tokens_text_and_nothing_else():
    first = FirstToken.from_prefill({"stream": True}, PREFILL, chat=True)
    role = {"id": "chatcmpl-d", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    assert first.trim(role) is False
    split = {"id": "chatcmpl-d", "choices": [{"index": 0, "delta": {"content": "Hel"}}]}
    assert first.trim(split) is False
    rest = {"id": "chatcmpl-d", "choices": [{"index": 0, "delta": {"content": "lo, world"}}]}
    assert first.trim(rest) is True and rest["choices"][0]["delta"]["content"] == ", world"
    assert rest["id"] == "chatcmpl-p"


def test_a_decode_worker_that_did_not_continue_the_token_ends_the_stream():
    first = FirstToken.from_prefill({"stream": True}, PREFILL, chat=True)
    with pytest.raises(FirstTokenMismatch):
        first.trim({"choices": [{"index": 0, "delta": {"content": "Goodbye"}}]})
