"""The quantized KV cache (int8 / fp8 e4m3, one float32 scale per token and KV head) against float32.

The model runs the same ragged batch as `test_quantization` (a packed prefill of three prompts,
every position's next-token distribution, then decode steps fed the reference's greedy tokens)
with float32 weights and activations; only the cache differs. Printed per scheme: max and mean
|logit error|, mean and max KL(reference || quantized), greedy agreement.

The bounds. A K or V row of D values is rounded to a grid of step amax / 127 (int8): the error
is uniform within half a step, std = step / sqrt(12), and amax is ~2.5-3 sigma of the row, so
each value is off by ~0.7% of the row's spread. e4m3 keeps 3 mantissa bits: a relative error up
to 2^-4, std ~2-3% of each value, about 4x int8. Those errors enter the attention scores q.k and
the mixed values, which are a part of each layer's output only (the residual stream and the MLP
carry the rest), so the logits move less than the cache values do: measured on tiny (4 layers)
0.47% (int8) and 1.9% (fp8) of the logits' std, on small (12 layers) 0.75% and 3.2%. The bounds
are 2-3x that, below what a wrong scale, a misplaced token or a stale block gives (errors of
order 100%). KL for a small logit perturbation e is ~ Var_p(e) / 2: bound ~5x the measured value.
Greedy agreement on a random model is only indicative (near-ties flip), so its bound is loose.

A quantized cache is read as it is stored by every step, the prompt's own chunk included, so the
tokens do not depend on chunking, prefix caching, preemption or where the prompt was prefilled.
"""

from __future__ import annotations

import pytest
import torch

from disagg.kernels.kv_quant import REGION_ALIGN, KVQuantFormat, QuantizedKVStep, region_bytes
from disagg.worker.engine.llm_engine import LLMEngine
from disagg.worker.model.loader import load_model
from disagg.worker.tools.make_model import make_model
from worker.engine.test_engine import (
    _disaggregated,
    assert_all_free,
    greedy,
    ragged_prompts,
    shared_prefix_prompts,
    token_ids,
)
from worker.model.test_quantization import compare, ragged_logits

# mean |logit error| / std(reference logits), mean KL, greedy agreement, per KV dtype (see above)
BOUNDS = {"int8": (0.02, 2e-4, 0.9), "fp8": (0.08, 3e-3, 0.8)}


def check_kv_dtypes(model_dir):
    ref_model, config = load_model(model_dir)
    ref, forced = ragged_logits(ref_model, config.vocab_size)
    out = {}
    for kv_dtype in ("int8", "fp8"):
        model, _ = load_model(model_dir)
        model.use_kv_cache_dtype(kv_dtype)
        got, _ = ragged_logits(model, config.vocab_size, forced)
        assert model.kv_format.name == kv_dtype
        out[kv_dtype] = errors = compare(ref, got)
        print(f"{model_dir.name} kv {kv_dtype}: {errors}")
        rel, kl, agree = BOUNDS[kv_dtype]
        assert errors.mean_rel < rel and errors.kl_mean < kl and errors.greedy_agree >= agree, (
            kv_dtype,
            errors,
        )
    return out


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tiny") / "m", preset="tiny", seed=0)


def test_quantized_kv_logits_against_float32_tiny(tiny_dir, one_torch_thread):
    errors = check_kv_dtypes(tiny_dir)
    assert errors["fp8"].mean_abs > errors["int8"].mean_abs  # 3 mantissa bits vs 7


@pytest.mark.slow
def test_quantized_kv_logits_against_float32_small(tmp_path, one_torch_thread):
    check_kv_dtypes(make_model(tmp_path / "small", preset="small", seed=0))


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_native_decode_steps_agree_with_the_torch_path(tiny_dir, kv_dtype, monkeypatch, one_torch_thread):
    """Every K/V write into a quantized cache takes the native kernel (rotary + quantizing write),
    decode attention the native kernel over 8-bit K/V; prefill chunks attend in torch. Against the
    torch path the logits differ by the rounding of a different summation order, which can move a
    K/V value lying near the middle between two grid points to the other one: a few logits move
    by ~1e-3 (fp8, one step of one value), the mean by ~1e-4 at most, far below the quantization's
    own error (tiny: mean 5e-3 int8, 2e-2 fp8)."""
    from disagg.kernels import native_build

    if not native_build.available():
        pytest.skip("needs a C compiler (cc)")
    model, config = load_model(tiny_dir)
    model.use_kv_cache_dtype(kv_dtype)
    native, _ = ragged_logits(model, config.vocab_size)
    assert model._native_ok(model.allocate_kv_cache(1, 8))
    monkeypatch.setenv("DISAGG_CPU_NATIVE", "0")
    plain, _ = ragged_logits(model, config.vocab_size)
    assert not model._native_ok(model.allocate_kv_cache(1, 8))
    diff = (native - plain).abs()
    print(
        f"kv {kv_dtype} native vs torch path: max |diff| {float(diff.max()):.2e} mean {float(diff.mean()):.2e}"
    )
    assert float(diff.max()) < 1e-2 and float(diff.mean()) < 5e-4
    assert torch.equal(native.argmax(-1), plain.argmax(-1))


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_whole_step_native_decode_over_a_quantized_cache(tiny_dir, kv_dtype, monkeypatch, one_torch_thread):
    """Decode steps of a few sequences run whole in one native call over the quantized cache too
    (rotary + quantizing write and attention over 8-bit K/V inside it); against the per-op native
    kernels the logits differ as in the test above (other matmul kernels, same K/V kernels)."""
    from disagg.kernels import native_build

    if not native_build.available():
        pytest.skip("needs a C compiler (cc)")
    model, config = load_model(tiny_dir)
    model.use_kv_cache_dtype(kv_dtype)
    step = model.native_decode_step()
    calls = []
    monkeypatch.setattr(model, "native_decode_step", lambda: calls.append(1) or step)
    whole, _ = ragged_logits(model, config.vocab_size)
    assert len(calls) == 4  # every decode step of the three sequences
    one = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="kv_caches: expected contiguous uint8"):
        step(torch.zeros(1, step.hidden), one, one, torch.zeros(2, 3, dtype=torch.uint8), one.view(1, 1), one + 1,
             model.kv_format)  # fmt: skip
    monkeypatch.setattr(model, "_whole_step_native", False)  # the per-op kernels take every step
    per_op, _ = ragged_logits(model, config.vocab_size)
    assert len(calls) == 4
    diff = (whole - per_op).abs()
    print(
        f"kv {kv_dtype} whole-step vs per-op: max |diff| {float(diff.max()):.2e} mean {float(diff.mean()):.2e}"
    )
    assert float(diff.max()) < 1e-2 and float(diff.mean()) < 5e-4
    assert torch.equal(whole.argmax(-1), per_op.argmax(-1))


def test_region_holds_values_then_scales_on_cache_lines():
    fmt = KVQuantFormat("int8", block_size=4, num_kv_heads=3, head_dim=6)
    assert fmt.region_bytes == region_bytes(4, 3, 6) == 256  # 144 value bytes + 96 scale bytes, padded
    assert fmt.region_bytes % REGION_ALIGN == 0
    cache = fmt.allocate(2, 5, "cpu")
    assert cache.shape == (2, 5, 256) and cache.dtype == torch.uint8
    # every value byte and scale byte of each region is its own, and nothing lies outside the region
    fmt.values(cache, torch.uint8).fill_(1)
    fmt.scales(cache).fill_(float("nan"))
    owned = cache.view(10, 256)
    assert bool((owned[:, :144] == 1).all()) and bool(owned[:, 144:240].view(torch.float32).isnan().all())
    assert bool((owned[:, 240:] == 0).all())
    # a layer's and a region's views are views of the same bytes
    layer = cache[1]
    fmt.scales(layer)[3, 1, 2, 0] = 2.5
    assert float(fmt.scales(cache)[1, 3, 1, 2, 0]) == 2.5
    with pytest.raises(ValueError, match="kv_cache"):
        fmt.values(torch.zeros(2, 255, dtype=torch.uint8))
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        KVQuantFormat("int4", 4, 3, 6)


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_write_rounds_each_token_once_and_skips_negative_slots(name):
    fmt = KVQuantFormat(name, block_size=4, num_kv_heads=2, head_dim=8)
    cache = fmt.allocate(1, 3, "cpu")[0]
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(5, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g) * 10
    slots = torch.tensor([0, 1, 5, -1, 9])
    k_held, v_held = fmt.write(k, v, cache, slots)
    for x, held in ((k, k_held), (v, v_held)):
        amax = x.abs().amax(-1, keepdim=True)
        # int8: half a step of amax / 127; e4m3: half a unit in the last of 3 mantissa bits
        bound = amax / 127 / 2 if name == "int8" else x.abs() * 2**-4 + amax / 448 * 2**-9
        assert bool(((held - x).abs() <= bound * 1.0001 + 1e-7).all())
    step = QuantizedKVStep(fmt, torch.tensor([[0, 1, 2]]), torch.tensor([12]), torch.float32)
    read = step.layer_cache(cache)  # blocks 0, 1, 2 as an ordinary [n, 2, 4, 2, 8] cache
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(read[slot // 4, 0, slot % 4], k_held[row])
            assert torch.equal(read[slot // 4, 1, slot % 4], v_held[row])
    assert bool((read[0, :, 2:] == 0).all())  # slot 3's row (-1) was never written
    # a later token leaves every earlier byte as it was (no requantization of the block)
    before = cache.clone()
    fmt.write(k[:1] * 100, v[:1] * 100, cache, torch.tensor([2]))
    changed = (before != cache).view(3, -1).any(0).nonzero().flatten()
    values_row = {2 * 16 + i for i in range(16)} | {
        (4 + 2) * 16 + i for i in range(16)
    }  # K, V rows of slot 2
    scale_bytes = {fmt.values_bytes + 4 * (2 * 2 + h) + i for h in range(2) for i in range(4)}
    scale_bytes |= {fmt.values_bytes + 4 * (4 * 2 + 2 * 2 + h) + i for h in range(2) for i in range(4)}
    assert set(changed.tolist()) <= values_row | scale_bytes


def test_step_renumbers_only_the_blocks_each_sequence_uses():
    fmt = KVQuantFormat("int8", block_size=4, num_kv_heads=1, head_dim=2)
    # sequence 0 uses 2 blocks (7, 3), sequence 1 one block (5); the padding (99) is never read
    tables = torch.tensor([[7, 3, 99], [5, 99, 99]], dtype=torch.int32)
    step = QuantizedKVStep(fmt, tables, torch.tensor([6, 4], dtype=torch.int32), torch.float32)
    assert step.block_ids.tolist() == [0, 3, 5, 7]
    assert step.tables.dtype == torch.int32
    assert step.block_ids[step.tables.long()][0, :2].tolist() == [7, 3]
    assert step.block_ids[step.tables.long()][1, 0].item() == 5


def test_quantized_cache_takes_fewer_bytes_per_block(tiny_dir):
    model, _ = load_model(tiny_dir)
    full = model.kv_cache_block_bytes(16)
    model.use_kv_cache_dtype("int8")
    quantized = model.kv_cache_block_bytes(16)
    d = model.head_dim
    assert quantized == model.num_layers * region_bytes(16, model.num_kv_heads, d)
    assert quantized < full / 4 * (d + 4) / d * 1.1  # a quarter of float32, plus the scales
    assert model.allocate_kv_cache(3, 16).shape == (model.num_layers, 3, quantized // model.num_layers)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        model.use_kv_cache_dtype("int4")


@pytest.mark.parametrize(
    "config",
    [
        dict(enable_prefix_caching=True, max_num_batched_tokens=16, block_size=8),
        # 14 blocks of 8 tokens cannot hold every sequence at once: forces preemption
        dict(enable_prefix_caching=True, max_num_batched_tokens=32, block_size=8, num_gpu_blocks=14),
        # verify rows: several tokens of one sequence written, then attended, in one step
        dict(block_size=8, speculative_method="ngram", speculative_adaptive=False),
    ],
    ids=["chunk16-cache", "preempt-cache", "speculative"],
)
def test_int8_kv_tokens_do_not_depend_on_chunking_caching_preemption(
    tiny_llama_dir, config, one_torch_thread
):
    prompts = ragged_prompts(lens=(3, 17, 31, 46, 9, 26)) + shared_prefix_prompts()
    plain = LLMEngine(tiny_llama_dir, kv_cache_dtype="int8", block_size=8, num_gpu_blocks=128,
                      max_num_batched_tokens=512, enable_prefix_caching=False)  # fmt: skip
    expected = token_ids(generate(plain, prompts))
    config.setdefault("num_gpu_blocks", 128)
    engine = LLMEngine(tiny_llama_dir, kv_cache_dtype="int8", **config)
    assert engine.kv_cache.dtype == torch.uint8
    assert token_ids(generate(engine, prompts)) == expected
    assert_all_free(engine)
    second = generate(engine, prompts)  # with caching, now partly from the prefix cache
    assert token_ids(second) == expected
    if config["num_gpu_blocks"] >= 64:
        assert sum(o.num_cached_tokens for o in second) > 0
    else:
        assert engine.scheduler.num_preemptions > 0
    assert_all_free(engine)


def generate(engine: LLMEngine, prompts):
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy())
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[int(o.request_id)] = o
    return [outs[i] for i in range(len(prompts))]


def test_int8_kv_prefilled_on_one_engine_decodes_as_colocated(tiny_qwen2_dir, one_torch_thread):
    """The regions a prefill engine wrote (values and scales) copied into a decode engine's cache
    decode into the colocated int8 engine's tokens."""
    prompts = ragged_prompts(seed=11, lens=(7, 16, 33, 20))
    kw = dict(kv_cache_dtype="int8", block_size=8, num_gpu_blocks=48)
    colocated = token_ids(generate(LLMEngine(tiny_qwen2_dir, max_num_batched_tokens=24, **kw), prompts))
    prefill = LLMEngine(tiny_qwen2_dir, max_num_batched_tokens=24, **kw)
    decode = LLMEngine(tiny_qwen2_dir, **kw)
    results = _disaggregated(prefill, decode, prompts, greedy())
    assert [results[f"d{i}"] for i in range(len(prompts))] == colocated
    assert_all_free(prefill)
    assert_all_free(decode)
