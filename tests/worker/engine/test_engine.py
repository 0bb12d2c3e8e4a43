"""The engine end to end on tiny random models: greedy equality with transformers, and the same
tokens whatever the cache, chunking or preemption does; block accounting back to all-free."""

from __future__ import annotations

import pytest
import torch

from disagg.worker import LLM, SamplingParams
from disagg.worker.engine.llm_engine import LLMEngine

NEW_TOKENS = 40
# ragged: below, at and across block boundaries (block sizes 8 and 16 are used below)
PROMPT_LENS = (3, 8, 17, 31, 46, 64, 5)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def ragged_prompts(seed: int = 0, lens=PROMPT_LENS) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 500, (n,), generator=g).tolist() for n in lens]


def shared_prefix_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    base = torch.randint(10, 500, (40,), generator=g).tolist()
    return [base + torch.randint(10, 500, (n,), generator=g).tolist() for n in (1, 9, 16, 23)] + [base[:33]]


def greedy(n: int = NEW_TOKENS) -> SamplingParams:
    # min_tokens masks EOS exactly as transformers' min_new_tokens does, so lengths agree
    return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)


_HF_CACHE: dict = {}


def hf_greedy(hf_model, path, prompts, n: int = NEW_TOKENS) -> list[list[int]]:
    key = (str(path), tuple(map(tuple, prompts)), n)
    if key not in _HF_CACHE:
        model = hf_model(path)
        outs = []
        for p in prompts:
            ids = torch.tensor([p])
            with torch.no_grad():
                gen = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=False,
                    max_new_tokens=n,
                    min_new_tokens=n,
                    pad_token_id=0,
                )
            outs.append(gen[0, len(p) :].tolist())
        _HF_CACHE[key] = outs
    return _HF_CACHE[key]


def token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def assert_all_free(engine: LLMEngine) -> None:
    bm = engine.block_manager
    bm.check()
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.num_free_blocks} blocks still in use"
    assert bm.num_pinned == 0
    assert not engine.requests and not engine.has_unfinished()


def test_greedy_matches_transformers(tiny_model_dir, hf_model):
    prompts = ragged_prompts()
    llm = LLM(model=tiny_model_dir, block_size=16, max_num_batched_tokens=64, num_gpu_blocks=64)
    outs = llm.generate(prompts, greedy())
    expected = hf_greedy(hf_model, tiny_model_dir, prompts)
    for i, (got, want) in enumerate(zip(token_ids(outs), expected, strict=True)):
        assert got == want, f"prompt {i} (len {len(prompts[i])}) diverges"
    for o, p in zip(outs, prompts, strict=True):
        assert o.finish_reason == "length" and o.num_prompt_tokens == len(p)
    assert_all_free(llm.engine)


@pytest.mark.parametrize(
    "config",
    [
        dict(enable_prefix_caching=False, max_num_batched_tokens=8, block_size=8),
        dict(enable_prefix_caching=True, max_num_batched_tokens=16, block_size=8),
        # 12 blocks of 8 tokens cannot hold every sequence at once: forces preemption
        dict(enable_prefix_caching=True, max_num_batched_tokens=32, block_size=8, num_gpu_blocks=14),
        dict(enable_prefix_caching=False, max_num_batched_tokens=24, block_size=16, num_gpu_blocks=9),
    ],
    ids=["chunk8-nocache", "chunk16-cache", "preempt-cache", "preempt-nocache"],
)
def test_same_tokens_under_chunking_caching_preemption(tiny_llama_dir, hf_model, config):
    config.setdefault("num_gpu_blocks", 128)
    prompts = ragged_prompts(lens=(3, 17, 31, 46, 9, 26)) + shared_prefix_prompts()
    llm = LLM(model=tiny_llama_dir, **config)
    expected = hf_greedy(hf_model, tiny_llama_dir, prompts)
    first = llm.generate(prompts, greedy())
    assert token_ids(first) == expected
    assert_all_free(llm.engine)
    # again: with caching on, the second pass serves prompts from the prefix cache
    second = llm.generate(prompts, greedy())
    assert token_ids(second) == expected
    assert_all_free(llm.engine)
    cached = sum(o.num_cached_tokens for o in second)
    if config["enable_prefix_caching"] and config["num_gpu_blocks"] >= 64:
        assert cached > 0
    if not config["enable_prefix_caching"]:
        assert cached == 0
    if config["num_gpu_blocks"] < 64:
        assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "torch"])
def test_mixed_steps_match_alternating_steps_and_transformers(tiny_llama_dir, hf_model, native, monkeypatch):
    """Prompts arriving while others decode: with mixed steps their chunks ride in the same steps
    as the running requests' tokens (decode rows through the decode kernel, chunks through the
    prefill kernel); the greedy tokens equal transformers' either way."""
    monkeypatch.setenv("DISAGG_CPU_NATIVE", native)
    prompts = ragged_prompts(lens=(3, 17, 31, 46, 9, 26))
    expected = hf_greedy(hf_model, tiny_llama_dir, prompts)
    for mixed in (True, False):
        engine = LLMEngine(tiny_llama_dir, block_size=8, max_num_batched_tokens=12, num_gpu_blocks=128,
                           mixed_steps=mixed)  # fmt: skip
        pending, outs, led_by_decode = list(enumerate(prompts)), {}, 0
        for step in range(10_000):
            if not pending and not engine.has_unfinished():
                break
            if pending and step % 2 == 0:  # a new prompt every other step
                i, p = pending.pop(0)
                engine.add_request(str(i), p, greedy())
            for o in engine.step():
                if o.finished:
                    outs[int(o.request_id)] = o.outputs[0].token_ids
            s = engine.scheduled
            led_by_decode += s is not None and s.is_prefill and s.chunks[0].decode
        assert [outs[i] for i in range(len(prompts))] == expected, f"mixed_steps={mixed}"
        assert bool(led_by_decode) == mixed  # prefill steps that also carried decode tokens
        assert_all_free(engine)


def test_prefix_cache_shares_blocks_between_live_requests(tiny_llama_dir, hf_model):
    """A request admitted while another with the same prefix runs reuses its computed blocks."""
    prompts = shared_prefix_prompts()
    engine = LLMEngine(tiny_llama_dir, block_size=8, max_num_batched_tokens=64, num_gpu_blocks=64)
    engine.add_request("a", prompts[0], greedy())
    engine.step()  # prefill of "a" registers its full blocks
    for i, p in enumerate(prompts[1:]):
        engine.add_request(f"b{i}", p, greedy())
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    assert all(outs[f"b{i}"].num_cached_tokens >= 32 for i in range(len(prompts) - 1))
    expected = hf_greedy(hf_model, tiny_llama_dir, prompts)
    got = [outs["a"].outputs[0].token_ids] + [
        outs[f"b{i}"].outputs[0].token_ids for i in range(len(prompts) - 1)
    ]
    assert got == expected
    assert engine.prefix_cache_hit_rate > 0
    assert_all_free(engine)


def test_seeded_sampling_reproducible_alone_and_batched(tiny_qwen2_dir):
    llm = LLM(model=tiny_qwen2_dir, num_gpu_blocks=64, max_num_batched_tokens=32)
    prompt = ragged_prompts(seed=3, lens=(12,))[0]
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate([prompt], params)[0].outputs[0].token_ids
    again = llm.generate([prompt], params)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, seed=s, max_tokens=30, ignore_eos=True) for s in range(4)]
    batch = llm.generate(
        ragged_prompts(seed=4, lens=(5, 20, 7)) + [prompt, prompt[:5]], others[:3] + [params, others[3]]
    )
    assert alone == again == batch[3].outputs[0].token_ids
    other_seed = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=99, max_tokens=24, ignore_eos=True)
    assert llm.generate([prompt], other_seed)[0].outputs[0].token_ids != alone
    assert_all_free(llm.engine)


@pytest.fixture(scope="module")
def llama_llm(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, num_gpu_blocks=64, max_num_batched_tokens=64)


def _stream(engine: LLMEngine, rid: str, prompt, params):
    engine.add_request(rid, prompt, params)
    steps = []
    while engine.has_unfinished():
        steps.extend(o for o in engine.step() if o.request_id == rid)
    return steps


def test_stop_string_cut_mid_token_and_never_emitted(llama_llm):
    engine = llama_llm.engine
    prompt = ragged_prompts(seed=5, lens=(10,))[0]
    full = _stream(engine, "full", prompt, greedy(NEW_TOKENS))
    pieces = [s.new_text for s in full]
    text = "".join(pieces)
    assert text == full[-1].outputs[0].text
    # a stop string made of the last character of one token's text and the first of the next:
    # it ends in the middle of a token
    choice = None
    for j in range(1, len(pieces)):
        a, b = pieces[j - 1], pieces[j]
        if a and len(b) >= 2 and a[-1].isascii() and b[0].isascii() and a[-1] + b[0] != "":
            stop = a[-1] + b[0]
            pos = len("".join(pieces[:j])) - 1
            if text.find(stop) == pos:
                choice = (j, stop, pos)
                break
    assert choice is not None, f"no usable token boundary in {pieces!r}"
    j, stop, pos = choice
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop=["\x00never", stop])
    steps = _stream(engine, "stopped", prompt, params)
    final = steps[-1].outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert final.text == text[:pos]
    assert "".join(s.new_text for s in steps) == text[:pos]
    assert final.token_ids == full[-1].outputs[0].token_ids[: j + 1]
    assert_all_free(engine)


def test_stop_token_ids_max_tokens_min_tokens(llama_llm):
    prompt = ragged_prompts(seed=6, lens=(14,))[0]
    ref = llama_llm.generate([prompt], greedy(20))[0].outputs[0].token_ids
    stop_tok = ref[7]
    first = ref.index(stop_tok)
    out = llama_llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_tok])
    )[0]
    assert out.outputs[0].token_ids == ref[: first + 1]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop_tok
    # min_tokens forbids the stop token until it is reached
    out = llama_llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=20, min_tokens=first + 3, stop_token_ids=[stop_tok]),
    )[0]
    toks = out.outputs[0].token_ids
    assert len(toks) >= first + 3 and stop_tok not in toks[: first + 3]
    out = llama_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 5 and out.finish_reason == "length"
    assert_all_free(llama_llm.engine)


def test_eos_stops_unless_ignored(llama_llm):
    engine = llama_llm.engine
    saved = engine.inputs.eos_token_ids
    prompt = ragged_prompts(seed=8, lens=(9,))[0]
    ref = llama_llm.generate([prompt], greedy(12))[0].outputs[0].token_ids
    # make the 4th generated token an EOS by declaring it one for this check
    engine.inputs.eos_token_ids = frozenset({ref[3]})
    try:
        out = llama_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0]
        assert out.outputs[0].token_ids == ref[: ref.index(ref[3]) + 1] and out.finish_reason == "stop"
        out = llama_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
        assert len(out.outputs[0].token_ids) == 12
    finally:
        engine.inputs.eos_token_ids = saved
    assert_all_free(engine)


def test_logprobs_are_log_softmax_of_the_model(tiny_mistral_dir, hf_model):
    llm = LLM(model=tiny_mistral_dir, num_gpu_blocks=32)
    prompt = ragged_prompts(seed=9, lens=(11,))[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3))[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == 8
    model = hf_model(tiny_mistral_dir)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + comp.token_ids])).logits[0].float()
    ref = logits.log_softmax(-1)[len(prompt) - 1 : -1]
    for i, (tok, lp) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True)):
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(float(ref[i, tok]), abs=1e-4)
        assert len(lp.top_logprobs) == 3 and tok in lp.top_logprobs  # greedy: the chosen is the best
        top = ref[i].topk(3)
        assert sorted(lp.top_logprobs) == sorted(top.indices.tolist())
    assert_all_free(llm.engine)


def test_prompt_longer_than_context_is_a_clear_error(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks=16, max_model_len=64)
    with pytest.raises(ValueError, match=r"prompt is 64 tokens but max_model_len is 64"):
        llm.generate([[5] * 64], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(model=tiny_llama_dir, num_gpu_blocks=16, max_model_len=10_000)
    # output stops at the context limit
    out = llm.generate([[5] * 60], SamplingParams(max_tokens=None, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.outputs[0].token_ids) == 4
    assert_all_free(llm.engine)


def test_abort_frees_blocks_in_every_state(llama_llm):
    engine = llama_llm.engine
    prompts = ragged_prompts(seed=10, lens=(30, 12, 25))
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(30))
    engine.step()
    engine.step()
    assert engine.num_free_blocks < engine.num_total_blocks
    assert engine.abort("r1") and not engine.abort("r1") and not engine.abort("unknown")
    while engine.has_unfinished():
        outs = engine.step()
        if any(o.request_id == "r0" and len(o.outputs[0].token_ids) == 5 for o in outs):
            assert engine.abort("r0")
    engine.add_request("waiting", prompts[0], greedy(4))
    assert engine.abort("waiting")
    engine.reserve("reserved", prompts[1], greedy(4))
    assert engine.abort("reserved")
    assert_all_free(engine)


def test_prefill_only_then_remote_commit_matches_colocated(tiny_qwen2_dir, hf_model):
    """Prefill on one engine, copy the KV blocks into another, decode there."""
    prompts = ragged_prompts(seed=11, lens=(7, 16, 33, 20))
    prefill = LLMEngine(tiny_qwen2_dir, block_size=8, num_gpu_blocks=48, max_num_batched_tokens=24)
    decode = LLMEngine(tiny_qwen2_dir, block_size=8, num_gpu_blocks=48)
    params = greedy(NEW_TOKENS)
    for i, p in enumerate(prompts):
        prefill.add_request(f"r{i}", p, params, prefill_only=True)
    seen_layers = []
    results = {}
    while prefill.has_unfinished():
        for out in prefill.step(layer_hook=seen_layers.append):
            assert out.finished and out.finish_reason == "prefilled" and len(out.new_token_ids) == 1
            rid = out.request_id
            src = prefill.block_ids(rid)
            assert len(src) == -(-len(prompts[int(rid[1:])]) // 8)
            dst = decode.reserve(rid, prompts[int(rid[1:])], params)
            decode.kv_cache[:, dst] = prefill.kv_cache[:, src]
            assert prefill.release(rid) and not prefill.release(rid)
            first = decode.commit_remote_prefill(rid, out.new_token_ids[0])
            assert first.new_token_ids == out.new_token_ids and not first.finished
    assert sorted(set(seen_layers)) == list(range(prefill.model.num_layers))
    assert_all_free(prefill)
    while decode.has_unfinished():
        for out in decode.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
    expected = hf_greedy(hf_model, tiny_qwen2_dir, prompts)
    assert [results[f"r{i}"] for i in range(len(prompts))] == expected
    # the remote prompt's blocks entered the decode side's prefix cache
    decode.add_request("again", prompts[2], greedy(2))
    while decode.has_unfinished():
        done = [o for o in decode.step() if o.finished]
    assert done[0].num_cached_tokens == 32
    assert_all_free(decode)


def _disaggregated(prefill: LLMEngine, decode: LLMEngine, prompts, params) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        prefill.add_request(f"d{i}", p, params, prefill_only=True)
    results = {}
    while prefill.has_unfinished():
        for out in prefill.step():
            rid = out.request_id
            dst = decode.reserve(rid, prompts[int(rid[1:])], params)
            decode.kv_cache[:, dst] = prefill.kv_cache[:, prefill.block_ids(rid)]
            prefill.release(rid)
            first = decode.commit_remote_prefill(rid, out.new_token_ids[0])
            if first.finished:
                results[rid] = first.outputs[0].token_ids
    while decode.has_unfinished():
        for out in decode.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
    return results


def test_seeded_sampling_and_one_token_requests_across_workers(tiny_llama_dir):
    prompts = ragged_prompts(seed=12, lens=(9, 21))
    kwargs = dict(block_size=8, num_gpu_blocks=32)
    prefill, decode, colocated = (LLMEngine(tiny_llama_dir, **kwargs) for _ in range(3))
    for params in (
        SamplingParams(temperature=0.8, top_k=40, seed=5, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=1),
    ):
        got = _disaggregated(prefill, decode, prompts, params)
        for i, p in enumerate(prompts):
            colocated.add_request(f"c{i}", p, params)
        want = {}
        while colocated.has_unfinished():
            want.update({o.request_id: o.outputs[0].token_ids for o in colocated.step() if o.finished})
        assert [got[f"d{i}"] for i in range(2)] == [want[f"c{i}"] for i in range(2)]
    for e in (prefill, decode, colocated):
        assert_all_free(e)
