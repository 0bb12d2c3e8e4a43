"""Request validation: every refusal is a 400 naming the field (pure, no server)."""

from __future__ import annotations

import pytest

from disagg.worker.router.errors import APIError
from disagg.worker.router.validation import fit_to_context, parse_chat, parse_completion


def _err(fn, body) -> APIError:
    with pytest.raises(APIError) as info:
        fn(body)
    assert info.value.status == 400
    return info.value


def test_completion_defaults_and_fields():
    spec = parse_completion({"model": "m", "prompt": "hi"})
    assert spec.kind == "completion" and spec.prompts == ["hi"] and spec.n == 1
    assert (
        spec.sampling.max_tokens == 16 and spec.sampling.temperature == 1.0 and spec.sampling.logprobs is None
    )
    spec = parse_completion(
        {"model": "m", "prompt": [[1, 2, 3]], "max_tokens": 5, "temperature": 0, "stop": "x", "logprobs": 2,
         "stream": True, "stream_options": {"include_usage": True}, "seed": 7, "top_k": 4}
    )  # fmt: skip
    assert spec.prompts == [[1, 2, 3]] and spec.sampling.stop == ["x"] and spec.sampling.logprobs == 2
    assert spec.include_usage and spec.stream and spec.sampling.seed == 7 and spec.sampling.top_k == 4


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x"}, "model"),
        ({"model": "m"}, "prompt"),
        ({"model": "m", "prompt": ""}, "prompt"),
        ({"model": "m", "prompt": []}, "prompt"),
        ({"model": "m", "prompt": ["a", 2]}, "prompt"),
        ({"model": "m", "prompt": [1, -2]}, "prompt"),
        ({"model": "m", "prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"model": "m", "prompt": "x", "max_tokens": "ten"}, "max_tokens"),
        ({"model": "m", "prompt": "x", "max_tokens": 2.5}, "max_tokens"),
        ({"model": "m", "prompt": "x", "temperature": 3}, "temperature"),
        ({"model": "m", "prompt": "x", "temperature": True}, "temperature"),
        ({"model": "m", "prompt": "x", "top_p": 0}, "top_p"),
        ({"model": "m", "prompt": "x", "top_k": 0}, "top_k"),
        ({"model": "m", "prompt": "x", "n": 0}, "n"),
        ({"model": "m", "prompt": "x", "n": 2, "best_of": 3}, "best_of"),
        ({"model": "m", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"model": "m", "prompt": "x", "stop": [1]}, "stop[0]"),
        ({"model": "m", "prompt": "x", "logprobs": 21}, "logprobs"),
        ({"model": "m", "prompt": "x", "presence_penalty": -3}, "presence_penalty"),
        ({"model": "m", "prompt": "x", "seed": "s"}, "seed"),
        ({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"model": "m", "prompt": "x", "logit_bias": {"1": 2}}, "logit_bias"),
        ({"model": "m", "prompt": "x", "suffix": "after"}, "suffix"),
        ({"model": "m", "prompt": "x", "min_tokens": 20, "max_tokens": 5}, "min_tokens"),
    ],
)
def test_completion_refusals_name_the_field(body, param):
    e = _err(parse_completion, body)
    assert e.param == param, e.message
    assert e.body()["error"]["type"] == "invalid_request_error"
    assert param in e.message


@pytest.mark.parametrize(
    "raw, param",
    [
        (b'{"model": "m", "prompt": "\\ud800"}', None),  # a lone surrogate: not valid JSON text
        (b'{"model": "m", "prompt": "x", "n": ' + b"[" * 5000 + b"]" * 5000 + b"}", None),  # too deep
        (b'{"model": "m", "prompt": "x", "tools": []}', "tools"),
        (b'{"model": "m", "prompt": "x", "n": 1e400}', "n"),
        (b'{"model": "m", "prompt": "x", "max_tokens": "5"}', "max_tokens"),
        (b"[1, 2]", None),
        (b"{not json", None),
        (
            b'{"model": "m", "messages": [{"role": "{0}{x}", "content": "y"}]}',
            "messages[0].role",
        ),  # braces echoed safely
    ],
)
def test_raw_bodies_that_must_be_400(raw, param):
    e = _err(parse_chat if b'"messages"' in raw else parse_completion, raw)
    assert e.param == param, e.message


def test_integral_floats_are_integers_and_documented_fields_accepted():
    spec = parse_completion(b'{"model": "m", "prompt": "x", "n": 2.0, "max_tokens": 3.0, "user": "u1"}')
    assert spec.n == 2 and spec.sampling.max_tokens == 3 and spec.user == "u1"
    with pytest.raises(APIError) as info:
        parse_completion({"model": "m", "prompt": "x", "n": 1.5})
    assert info.value.param == "n"
    chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x", "name": "ann"}]})
    assert chat.messages == [{"role": "user", "content": "x"}]
    with pytest.raises(APIError) as info:
        parse_chat({"model": "m", "messages": [{"role": "user", "content": "\ud800"}]})
    assert info.value.param == "messages[0].content"


def test_chat_messages_and_logprobs():
    spec = parse_chat(
        {"model": "m", "messages": [{"role": "system", "content": "s"},
                                    {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
         "logprobs": True, "top_logprobs": 3, "max_completion_tokens": 9}
    )  # fmt: skip
    assert spec.messages[1] == {"role": "user", "content": "ab"}
    assert spec.sampling.logprobs == 3 and spec.sampling.max_tokens == 9
    assert (
        parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}]}).sampling.max_tokens is None
    )
    assert (
        parse_chat(
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True}
        ).sampling.logprobs
        == 0
    )


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "m"}, "messages"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": ["hi"]}, "messages[0]"),
        ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0].type",
        ),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": -5}, "max_tokens"),
    ],
)
def test_chat_refusals_name_the_field(body, param):
    assert _err(parse_chat, body).param == param


def test_body_must_be_an_object():
    assert _err(parse_completion, [1, 2]).param is None
    assert _err(parse_chat, "text").param is None


def test_fit_to_context():
    spec = parse_completion({"model": "m", "prompt": "x", "max_tokens": 10})
    assert fit_to_context(spec.sampling, 90, 100, "completion") == 10
    with pytest.raises(APIError) as info:
        fit_to_context(spec.sampling, 95, 100, "completion")
    assert info.value.param == "max_tokens" and info.value.code == "context_length_exceeded"
    chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert fit_to_context(chat.sampling, 30, 100, "chat") == 70  # default: the rest of the context
    with pytest.raises(APIError) as info:
        fit_to_context(chat.sampling, 100, 100, "chat")
    assert info.value.param == "messages" and info.value.status == 400


def test_error_shapes_and_retry_after():
    e = APIError(429, "full", code="queue_full", retry_after=1.4)
    assert e.body() == {
        "error": {"message": "full", "type": "rate_limit_error", "param": None, "code": "queue_full"}
    }
    assert e.headers() == {"Retry-After": "1"}
    assert APIError(401, "no key").type == "authentication_error"
    assert APIError(503, "down").headers() == {}
