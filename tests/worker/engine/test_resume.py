"""A generation resumed on another engine from the tokens already streamed (a migrated stream)
continues exactly: the same tokens, the same text with nothing sent twice or lost (text held back
for a stop string included), the same finish, for greedy, seeded, stop-string, penalised, logprob
and grammar-constrained requests."""

from __future__ import annotations

import json

import pytest

from disagg.worker.engine.llm_engine import LLMEngine
from disagg.worker.engine.resume import Resumption
from disagg.worker.engine.sampling_params import SamplingParams
from disagg.worker.engine.structured_output_params import StructuredOutputParams

PROMPT = [11, 47, 203, 88, 9, 150, 61, 300, 27]
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
    "required": ["a"],
}


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    # two engines: the one a stream starts on and the one it moves to
    return [LLMEngine(tiny_llama_dir, block_size=8, num_gpu_blocks=128) for _ in range(2)]


def _stream(engine, rid, params, resume=None) -> list[tuple[list[int], str, str | None]]:
    """Every message a worker would send: (new token ids, new text, finish reason)."""
    engine.add_request(rid, PROMPT, params, resume=resume)
    messages = []
    while engine.has_unfinished():
        for o in engine.step():
            messages.append((list(o.new_token_ids), o.new_text, o.outputs[0].finish_reason))
    return messages


CASES = {
    "greedy": SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=24, ignore_eos=True),
    "stop-string": SamplingParams(temperature=0.9, seed=3, max_tokens=40, ignore_eos=True, stop=["ab", "e "]),
    "penalties": SamplingParams(
        temperature=0.8,
        seed=5,
        max_tokens=24,
        ignore_eos=True,
        frequency_penalty=1.0,
        presence_penalty=0.5,
        repetition_penalty=1.2,
        min_tokens=20,
    ),  # fmt: skip
    "logprobs": SamplingParams(temperature=0.7, seed=9, max_tokens=16, ignore_eos=True, logprobs=2),
    "json": SamplingParams(
        temperature=1.0,
        seed=1,
        max_tokens=60,
        structured_output=StructuredOutputParams(json=json.dumps(SCHEMA)),
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_resumed_stream_continues_exactly(engines, case):
    first, second = engines
    params = CASES[case]
    whole = _stream(first, f"{case}-whole", params)
    tokens = [t for ids, _, _ in whole for t in ids]
    text = "".join(t for _, t, _ in whole)
    assert len(tokens) > 3
    for cut_message in (1, len(whole) // 2, len(whole) - 1):
        sent = whole[:cut_message]  # the worker died after sending these
        sent_ids = [t for ids, _, _ in sent for t in ids]
        sent_text = "".join(t for _, t, _ in sent)
        rest = _stream(second, f"{case}-{cut_message}", params, Resumption(tuple(sent_ids), len(sent_text)))
        assert sent_ids + [t for ids, _, _ in rest for t in ids] == tokens
        assert sent_text + "".join(t for _, t, _ in rest) == text
        assert rest[-1][2] == whole[-1][2]
    if case == "json":
        json.loads(text)


def test_resumed_logprobs_are_those_of_the_new_tokens(engines):
    first, second = engines
    params = CASES["logprobs"]
    first.add_request("lp-whole", PROMPT, params)
    outs = []
    while first.has_unfinished():
        outs += first.step()
    want = outs[-1].outputs[0].logprobs
    second.add_request(
        "lp-rest", PROMPT, params, resume=Resumption(tuple(outs[-1].outputs[0].token_ids[:5]), 0)
    )
    got = []
    while second.has_unfinished():
        got += [lp for o in second.step() for lp in o.new_logprobs]
    assert [(g.token_id, round(g.logprob, 5)) for g in got] == [
        (w.token_id, round(w.logprob, 5)) for w in want[5:]
    ]


@pytest.mark.parametrize(
    "resume, params, message",
    [
        (Resumption((10**6,)), SamplingParams(max_tokens=8), "outside the vocabulary"),
        (Resumption((5,) * 8), SamplingParams(max_tokens=8), "already reach max_tokens"),
        (Resumption((5,), sent_chars=-1), SamplingParams(max_tokens=8), "sent_chars"),
    ],
)
def test_bad_resumptions_are_refused_naming_why(engines, resume, params, message):
    with pytest.raises(ValueError, match=message):
        engines[1].add_request("bad", PROMPT, params, resume=resume)
    assert not engines[1].has_unfinished()


@pytest.mark.parametrize("params", [CASES["greedy"], CASES["seeded"]], ids=["greedy", "seeded"])
def test_a_speculating_engine_resumes_exactly_too(tiny_llama_dir, params):
    """Prompt lookup proposes from the prompt and the outputs; its draws are keyed by position
    as the plain sampler's are, so a resumed stream continues as the undisturbed one."""
    spec = {"speculative_method": "ngram", "speculative_min_acceptance": 0.0, "speculative_adaptive": False}
    first, second = (LLMEngine(tiny_llama_dir, block_size=8, num_gpu_blocks=128, **spec) for _ in range(2))
    repetitive = PROMPT * 3  # something for prompt lookup to find
    first.add_request("whole", repetitive, params)
    outs = []
    while first.has_unfinished():
        outs += first.step()
    tokens = outs[-1].outputs[0].token_ids
    second.add_request("rest", repetitive, params, resume=Resumption(tuple(tokens[:7]), 0))
    rest = []
    while second.has_unfinished():
        rest += [t for o in second.step() for t in o.new_token_ids]
    assert tokens[:7] + rest == tokens
    assert first.speculator.stats.num_proposed > 0  # it really speculated


@pytest.mark.parametrize("source", ["holder", "prefill-worker"])
@pytest.mark.parametrize("case", ["greedy", "seeded", "penalties", "json"])
def test_a_resumed_stream_prefilled_elsewhere_continues_exactly_computing_one_token(
    tiny_llama_dir, case, source
):
    """The new engine reserves blocks for prompt and outputs and another engine prefills them into
    them: the worker that handed the stream off, from its own cache (the stream's blocks, still
    cached there), or a prefill worker, computing them all. The new engine goes on from the last
    output, computing only that token itself."""
    old, new, prefill = (LLMEngine(tiny_llama_dir, block_size=8, num_gpu_blocks=128) for _ in range(3))
    params = CASES[case]
    whole = _stream(old, "whole", params)
    tokens = [t for ids, _, _ in whole for t in ids]
    text = "".join(t for _, t, _ in whole)
    cut = len(whole) // 2
    # the stream on the old engine, handed off after `cut` messages
    old.add_request("live", PROMPT, params)
    sent = []
    while len(sent) < cut:
        sent += [(list(o.new_token_ids), o.new_text) for o in old.step()]
    sent_ids = [t for ids, _ in sent for t in ids]
    sent_text = "".join(t for _, t in sent)
    assert old.abort("live")
    held = PROMPT + sent_ids
    # a greedy one-token prefill of prompt + outputs
    source_engine = old if source == "holder" else prefill
    source_engine.add_request("pull", held, SamplingParams(temperature=0, max_tokens=1), prefill_only=True)
    outs = []
    while source_engine.has_unfinished():
        outs += source_engine.step()
    (pulled,) = outs
    # the holder found every full block in its cache; the prefill worker computed them all
    assert pulled.num_cached_tokens == ((len(held) - 1) // 8 * 8 if source == "holder" else 0)
    resume = Resumption(tuple(sent_ids), len(sent_text))
    dst = new.reserve("moved", PROMPT, params, resume)
    assert dst.num_cached_blocks == 0 and len(dst.fresh_block_ids) == (len(held) + 7) // 8
    new.kv_cache[:, dst.fresh_block_ids] = source_engine.kv_cache[:, source_engine.block_ids("pull")]
    assert source_engine.release("pull")
    assert new.commit_remote_prefill("moved", pulled.new_token_ids[0]) is None
    assert new.requests["moved"].num_uncomputed == 1  # only the last output is left to compute
    rest = []
    while new.has_unfinished():
        rest += [(list(o.new_token_ids), o.new_text, o.outputs[0].finish_reason) for o in new.step()]
    assert sent_ids + [t for ids, _, _ in rest for t in ids] == tokens
    assert sent_text + "".join(t for _, t, _ in rest) == text
    assert rest[-1][2] == whole[-1][2]
    assert new.block_manager.num_free_blocks == new.num_total_blocks
