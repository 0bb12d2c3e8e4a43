"""Every integer a request carries fits the type it travels in (worker.proto), and every malformed
value is a 400 naming the field, never a crash while building the worker's message."""

from __future__ import annotations

import pytest

from disagg.proto import worker_pb2
from disagg.worker.router.errors import APIError
from disagg.worker.router.responses_request import parse_responses
from disagg.worker.router.validation import parse_chat, parse_completion

CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
COMPLETION = {"model": "m", "prompt": "x"}


def _param(fn, body) -> str | None:
    with pytest.raises(APIError) as info:
        fn(body)
    assert info.value.status == 400
    return info.value.param


@pytest.mark.parametrize(
    "fn, body, param",
    [
        (parse_completion, {**COMPLETION, "top_k": 2**31}, "top_k"),
        (parse_completion, {**COMPLETION, "stop_token_ids": [2**31]}, "stop_token_ids[0]"),
        (parse_chat, {**CHAT, "stop_token_ids": [1, 2**40]}, "stop_token_ids[1]"),
        (parse_chat, {**CHAT, "min_tokens": 2**40}, "min_tokens"),
        (parse_completion, {**COMPLETION, "max_tokens": 2**31}, "max_tokens"),
        (parse_chat, {**CHAT, "max_completion_tokens": 2**31}, "max_completion_tokens"),
        (parse_completion, {**COMPLETION, "n": 2**63}, "n"),
        (parse_completion, {**COMPLETION, "seed": 2**63}, "seed"),
        (parse_completion, {**COMPLETION, "prompt": [[1, 2**31]]}, "prompt"),
        (parse_responses, {"model": "m", "input": "x", "max_output_tokens": 2**31}, "max_output_tokens"),
    ],
)
def test_integers_beyond_their_wire_type_are_400s_naming_the_field(fn, body, param):
    assert _param(fn, body) == param


def test_the_largest_wire_values_build_the_worker_message():
    spec = parse_chat({**CHAT, "top_k": 2**31 - 1, "stop_token_ids": [2**31 - 1], "min_tokens": 2**31 - 1,
                       "seed": -(2**63)})  # fmt: skip
    s = spec.sampling
    worker_pb2.SamplingParams(
        top_k=s.top_k, stop_token_ids=s.stop_token_ids, min_tokens=s.min_tokens, seed=s.seed
    )


@pytest.mark.parametrize("kind", [{}, [], 5, True, None])
def test_a_responses_item_type_that_is_not_a_string_names_the_field(kind):
    with pytest.raises(APIError) as info:
        parse_responses({"model": "m", "input": [{"type": kind, "role": "user", "content": "x"}]})
    e = info.value
    assert e.status == 400 and e.param == "input[0].type", e.message
    assert "_item_tag" not in e.message and "discriminator" not in e.message, e.message


def test_an_unknown_responses_item_names_no_internal_function():
    with pytest.raises(APIError) as info:
        parse_responses({"model": "m", "input": ["text"]})
    assert info.value.param == "input[0]" and "_item_tag" not in info.value.message, info.value.message


def test_min_tokens_beyond_the_room_left_in_the_context_is_a_400():
    from disagg.worker.router.validation import fit_to_context

    spec = parse_chat({**CHAT, "min_tokens": 2**31 - 1})  # no max_tokens: the rest of the context
    with pytest.raises(APIError) as info:
        fit_to_context(spec.sampling, 30, 100, "chat")
    assert info.value.param == "min_tokens" and "70" in info.value.message, info.value.message
    assert fit_to_context(parse_chat({**CHAT, "min_tokens": 70}).sampling, 30, 100, "chat") == 70


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    "fn, body, param",
    [
        (parse_chat, {**CHAT, "tools": [TOOL] * 129}, "tools"),
        (parse_chat, {**CHAT, "functions": [TOOL["function"]] * 129}, "functions"),
        (parse_completion, {**COMPLETION, "stop_token_ids": [1] * 1025}, "stop_token_ids"),
        (parse_completion, {**COMPLETION, "guided_choice": ["a"] * 1025}, "guided_choice"),
        (
            parse_responses,
            {"model": "m", "input": "x", "tools": [{"type": "function", "name": "f"}] * 129},
            "tools",
        ),
    ],
)
def test_lists_checked_per_token_or_per_request_are_bounded(fn, body, param):
    assert _param(fn, body) == param


def test_lists_at_their_bound_pass():
    tools = [
        {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}
        for i in range(128)
    ]
    parse_chat({**CHAT, "tools": tools})
    parse_completion({**COMPLETION, "stop_token_ids": [1] * 1024, "guided_choice": ["a"] * 1024})
