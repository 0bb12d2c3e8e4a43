"""Speculative decoding changes how fast tokens come, never which: greedy outputs with either
proposer equal those without, through ragged batches, the prefix cache, chunked prefill,
preemption and remote prefill, with every block (the target's and a draft's) back in the pool."""

from __future__ import annotations

import pytest
import torch

from disagg.worker import SamplingParams
from disagg.worker.engine.llm_engine import LLMEngine
from disagg.worker.engine.speculative import batches
from disagg.worker.engine.speculative.ngram import lookup

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BS = 8


def tokens(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 500, (n,), generator=g).tolist()


def repetitive(seed: int, n: int) -> list[int]:
    """A prompt that repeats a short phrase: prompt lookup has something to find."""
    phrase = tokens(seed, 7)
    return (phrase * (n // 7 + 1))[:n]


def spec_settings(method: str, draft_dir) -> dict:
    if method == "ngram":
        return {"speculative_method": "ngram"}
    return {"speculative_method": "draft", "speculative_draft_model": str(draft_dir)}


def make(model_dir, **kw) -> LLMEngine:
    """An engine; one that speculates does so always (these tiny models are compute-bound on a
    CPU, where measured costs would mostly turn speculation off) unless asked to measure."""
    kw.setdefault("num_gpu_blocks", 64)
    if "speculative_method" in kw:
        kw.setdefault("speculative_adaptive", False)
    return LLMEngine(model_dir, block_size=BS, **kw)


def run(e: LLMEngine, prompts, params) -> dict[str, object]:
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        e.add_request(f"r{i}", prompt, p)
    done = {}
    while e.has_unfinished():
        for out in e.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    return done


def assert_all_free(e: LLMEngine) -> None:
    bm = e.block_manager
    bm.check()
    assert bm.num_free_blocks == bm.num_blocks and bm.num_pinned == 0
    if e.speculator is not None:
        assert e.speculator.proposer.num_held_blocks() == 0


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


RAGGED = [repetitive(1, 30), tokens(2, 5), repetitive(3, 17) + tokens(4, 9), tokens(5, 41), repetitive(6, 12)]
LENGTHS = [24, 9, 31, 17, 40]


def verify_shape(monkeypatch, shape: str) -> dict:
    """Settings for speculation as measured step costs decide it (on these tiny compute-bound
    models often not at all), or always, as decode rows or as packed prefill-like steps."""
    if shape == "packed":
        monkeypatch.setattr(batches, "MAX_ROW_RUN", 0)
    return {"speculative_adaptive": shape == "auto"}


# the target as its own draft accepts nearly everything; another model accepts little
@pytest.mark.parametrize("shape", ["auto", "rows", "packed"])
@pytest.mark.parametrize("method", ["ngram", "draft-self", "draft-other"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_output_is_unchanged(request, monkeypatch, arch, method, shape):
    target = request.getfixturevalue(f"tiny_{arch}_dir")
    other = request.getfixturevalue("tiny_qwen2_dir" if arch == "llama" else "tiny_llama_dir")
    draft = target if method == "draft-self" else other
    # prefix caching on, prompts chunked by a small token budget, a shared prefix
    prompts = [*RAGGED, RAGGED[0] + tokens(9, 3)]
    params = [greedy(n) for n in [*LENGTHS, 20]]
    settings = dict(max_num_batched_tokens=16, enable_prefix_caching=True)
    plain = run(make(target, **settings), prompts, params)
    e = make(
        target, **settings, **spec_settings(method.split("-")[0], draft), **verify_shape(monkeypatch, shape)
    )
    got = run(e, prompts, params)
    assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in plain.items()}
    assert {k: v.text for k, v in got.items()} == {k: v.text for k, v in plain.items()}
    stats = e.speculator.stats
    assert sum(stats.accepted_lengths) == stats.num_proposals
    assert e.scheduler.prefix_hit_tokens > 0
    assert_all_free(e)
    if shape == "auto":
        return
    assert stats.num_verify_steps > 0 and stats.num_proposed > 0
    if method != "draft-other":
        assert stats.num_accepted > 0
    if method == "draft-self":
        assert stats.acceptance_rate > 0.9


@pytest.mark.parametrize("shape", ["rows", "packed"])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_preemption_keeps_outputs_and_accounting(tiny_llama_dir, monkeypatch, method, shape):
    # 12 blocks of 8 tokens for five sequences of up to 70 tokens: the newest are preempted
    prompts = [repetitive(s, 20) for s in range(5)]
    params = [greedy(48, ignore_eos=True) for _ in prompts]
    plain_engine = make(tiny_llama_dir, num_gpu_blocks=12)
    plain = run(plain_engine, prompts, params)
    verify_shape(monkeypatch, shape)
    e = make(tiny_llama_dir, num_gpu_blocks=12, **spec_settings(method, tiny_llama_dir))
    got = run(e, prompts, params)
    assert e.scheduler.num_preemptions > 0
    assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in plain.items()}
    assert e.speculator.stats.num_accepted > 0
    assert_all_free(e)


GRAMMARS = {
    "choice": {"choice": ("alpha beta gamma delta", "beta gamma")},
    "regex": {"regex": r"([a-c]{2}-[0-9]{2} ){2,5}"},
    "json": {"json": '{"type": "object", "properties": {"tag": {"enum": ["red", "green"]}, "n": {"type": '
             '"integer"}}, "required": ["tag", "n"], "additionalProperties": false}'},
}  # fmt: skip


@pytest.mark.parametrize("grammar", GRAMMARS)
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_structured_output_speculates_within_its_grammar(tiny_llama_dir, method, grammar):
    """Proposals outside the grammar are cut, each verified position is masked by the grammar's
    state after the proposals before it, and the matcher ends holding exactly the output."""
    from disagg.worker.engine.structured_output_params import StructuredOutputParams

    constraint = StructuredOutputParams(**GRAMMARS[grammar])
    e = make(tiny_llama_dir, **spec_settings(method, tiny_llama_dir))
    # the prompt already holds text of the grammar, so prompt lookup proposes grammar tokens
    sample = {
        "choice": "alpha beta gamma delta",
        "regex": "ab-12 ca-07 bb-33 ",
        "json": '{"tag": "red", "n": 7}',
    }
    prompt = e.tokenizer.encode((sample[grammar] + " ") * 4)
    params = [greedy(40, structured_output=constraint), greedy(24)]
    prompts = [prompt, repetitive(2, 20)]
    plain = run(make(tiny_llama_dir), prompts, params)
    alone = run(e, prompts[:1], params[:1])["r0"]
    assert alone.token_ids == plain["r0"].token_ids
    assert e.speculator.stats.num_accepted > 0  # the draft samples within the grammar too
    e.requests.clear()
    got = run(e, prompts, params)  # beside a request without a grammar
    assert got["r0"].text == plain["r0"].text and got["r0"].token_ids == plain["r0"].token_ids
    assert got["r1"].token_ids == plain["r1"].token_ids
    assert_all_free(e)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """A plain greedy run with logprobs, and a speculating engine that accepts most proposals."""
    prompt = repetitive(11, 24)
    plain = run(make(tiny_llama_dir), [prompt], [greedy(30, ignore_eos=True, logprobs=2)])["r0"]
    return prompt, plain


def _same(got, want) -> None:
    assert got.token_ids == want.token_ids
    assert got.text == want.text
    assert (got.finish_reason, got.stop_reason) == (want.finish_reason, want.stop_reason)


def test_max_tokens_and_logprobs_at_every_acceptance_length(tiny_llama_dir, reference):
    prompt, plain = reference
    e = make(tiny_llama_dir, speculative_method="draft", speculative_draft_model=str(tiny_llama_dir))
    for n in range(1, 14):
        out = run(e, [prompt], [greedy(n, ignore_eos=True, logprobs=2)])["r0"]
        assert out.token_ids == plain.token_ids[:n] and out.finish_reason == "length"
        for a, b in zip(out.logprobs, plain.logprobs[:n], strict=True):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert a.top_logprobs.keys() == b.top_logprobs.keys()
        e.requests.clear()  # ids are reused across runs
    assert max(i for i, c in enumerate(e.speculator.stats.accepted_lengths) if c) >= 3
    assert_all_free(e)


def test_stop_ids_and_strings_end_the_output_where_plain_decoding_does(tiny_llama_dir, reference):
    prompt, plain = reference
    e = make(tiny_llama_dir, speculative_method="draft", speculative_draft_model=str(tiny_llama_dir))
    plain_engine = make(tiny_llama_dir)
    for i in range(1, 14):
        # a stop token id first produced at output i, and a stop string ending inside token i
        stop_id = plain.token_ids[i]
        piece = e.tokenizer.decode(plain.token_ids[i : i + 1])
        for params in (
            greedy(30, ignore_eos=True, stop_token_ids=[stop_id]),
            greedy(30, ignore_eos=True, stop=[piece.strip()] if piece.strip() else None),
            greedy(30, ignore_eos=True, stop=[piece.strip()] if piece.strip() else None,
                   include_stop_str_in_output=True),
        ):  # fmt: skip
            want = run(plain_engine, [prompt], [params])["r0"]
            got = run(e, [prompt], [params])["r0"]
            _same(got, want)
    assert_all_free(e)


def test_remote_prefill_then_speculative_decode_matches_colocated(tiny_llama_dir):
    """The decode side of a disaggregated request: prompt K/V written into reserved blocks, the
    draft's prompt K/V computed locally on the first proposal."""
    p = make(tiny_llama_dir)
    d = make(tiny_llama_dir, speculative_method="draft", speculative_draft_model=str(tiny_llama_dir))
    colocated = make(tiny_llama_dir)
    prompt, params = repetitive(21, 27), greedy(25, ignore_eos=True)
    p.add_request("x", prompt, params, prefill_only=True)
    (first,) = [o for o in p.step()]
    src = p.block_ids("x")
    dst = d.reserve("x", prompt, params)
    d.kv_cache[:, dst.fresh_block_ids] = p.kv_cache[:, src]
    assert p.release("x")
    d.commit_remote_prefill("x", first.new_token_ids[0])
    got = None
    while d.has_unfinished():
        for out in d.step():
            got = out.outputs[0].token_ids
    want = run(colocated, [prompt], [params])["r0"].token_ids
    assert got == want
    assert d.speculator.stats.num_accepted > 0
    assert_all_free(d)


@pytest.mark.parametrize(
    "seq, k, want",
    [
        ([1, 2, 3, 4, 1, 2, 3, 9, 1, 2, 3], 3, [9, 1, 2]),  # the latest match of [1, 2, 3] wins
        ([1, 2, 3, 4, 5], 3, []),  # no earlier occurrence of any tail
        ([5, 1, 2, 7, 1, 2], 4, [7, 1, 2]),  # cut at the end of the sequence
        ([8, 9, 8, 9, 8], 2, [9, 8]),
        ([4, 4], 3, [4]),
    ],
)
def test_ngram_lookup(seq, k, want):
    assert lookup(seq, k, 1, 3) == want


def test_ngram_prefers_the_longest_match():
    # [2, 3] last occurred before 7; [3] alone last occurred before 5
    assert lookup([2, 3, 7, 3, 5, 1, 2, 3], 1, 1, 2) == [7]
    assert lookup([2, 3, 7, 3, 5, 1, 2, 3], 1, 1, 1) == [5]


def test_sampled_structured_output_stays_in_its_grammar(tiny_llama_dir):
    import json

    from disagg.worker.engine.structured_output_params import StructuredOutputParams

    e = make(tiny_llama_dir, speculative_method="ngram")
    constraint = StructuredOutputParams(**GRAMMARS["json"])
    prompt = e.tokenizer.encode('{"tag": "red", "n": 7} ' * 4)
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=60, structured_output=constraint) for s in range(8)
    ]
    outs = run(e, [prompt] * 8, params)
    finished = [out for out in outs.values() if out.finish_reason == "stop"]
    assert finished
    for out in finished:
        assert json.loads(out.text)["tag"] in ("red", "green")
    assert e.speculator.stats.num_proposed > 0
    assert_all_free(e)
