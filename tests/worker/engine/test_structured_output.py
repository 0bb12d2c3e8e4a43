"""Structured output in the engine: sampled outputs match their grammar (JSON schema, JSON object,
regex, choice, Lark) at temperature 1, constrained and free requests share batches, compiled
grammars are reused, invalid grammars are refused by name."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from disagg.worker import LLM, SamplingParams
from disagg.worker.engine.structured_output_params import StructuredOutputParams, check

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 4},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 2}, "maxItems": 2},
    },
    "required": ["name", "age", "ok", "color", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLM(tiny_llama_dir, block_size=8, num_gpu_blocks=256)
    torch.set_num_threads(n)


def _sample(llm, so: StructuredOutputParams, count: int, max_tokens: int = 80) -> list:
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, structured_output=so)
              for i in range(count)]  # fmt: skip
    return [o.outputs[0] for o in llm.generate(["Write it:"] * count, params)]


def test_json_schema_outputs_validate(llm):
    outs = _sample(llm, StructuredOutputParams(json=json.dumps(SCHEMA)), 24)
    for out in outs:
        assert out.finish_reason == "stop", out.text  # the grammar closed the object, then EOS
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert len({o.text for o in outs}) > 1  # sampled, not one fixed string


def test_json_object_regex_choice_and_lark(llm):
    for out in _sample(llm, StructuredOutputParams(json_object=True), 4, max_tokens=200):
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)
        else:  # a free-form object may outgrow the limit: it is still a prefix of one
            assert out.text.startswith("{")
    # [0-9], not \d: the grammar's \d takes every Unicode digit of a newer Unicode than Python's re knows
    for out in _sample(llm, StructuredOutputParams(regex=r"[a-c]{2,4}-[0-9][0-9]"), 6):
        assert re.fullmatch(r"[a-c]{2,4}-[0-9][0-9]", out.text), out.text
    for out in _sample(llm, StructuredOutputParams(choice=("yes", "no", "maybe so")), 6):
        assert out.text in ("yes", "no", "maybe so")
    lark = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]/'
    for out in _sample(llm, StructuredOutputParams(grammar=lark), 6, max_tokens=30):
        if out.finish_reason == "stop":
            assert re.fullmatch(r"\(\d(\+\d)*\)", out.text), out.text


def test_constrained_and_free_requests_share_a_batch(llm):
    so = StructuredOutputParams(choice=("alpha", "beta"))
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = llm.generate(["The river"], free)[0].outputs[0].token_ids
    outs = llm.generate(
        ["The river", "Pick one:", "Pick two:"],
        [free, SamplingParams(temperature=1.0, seed=1, max_tokens=8, structured_output=so),
         SamplingParams(temperature=0, max_tokens=8, structured_output=so)],
    )  # fmt: skip
    assert outs[0].outputs[0].token_ids == alone
    assert outs[1].outputs[0].text in ("alpha", "beta") and outs[2].outputs[0].text in ("alpha", "beta")


def test_compiled_grammars_are_cached(llm):
    so = StructuredOutputParams(regex=r"\d{3}")
    _sample(llm, so, 2)
    grammars = llm.engine.inputs.grammars
    compiled = grammars._cache[so]
    _sample(llm, so, 2)
    assert grammars._cache[so] is compiled


def test_invalid_grammars_are_refused(llm):
    assert "foo" in check(StructuredOutputParams(json='{"type": "foo"}'))
    assert "regex" in check(StructuredOutputParams(regex="a(b"))
    assert check(StructuredOutputParams(json=json.dumps(SCHEMA))) is None
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputParams(regex="a", json_object=True)
    with pytest.raises(ValueError, match="grammar"):
        llm.generate(["x"], SamplingParams(structured_output=StructuredOutputParams(grammar="start: nope")))
