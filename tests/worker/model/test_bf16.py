"""A bfloat16 model (weights, activations and KV cache in bf16) against the float32 model, on the
native CPU path and on the plain-torch path.

The same ragged batch as tests/worker/model/test_quantization.py (a packed prefill of three prompts,
every position's next-token distribution, then decode steps fed the reference's greedy tokens);
printed: max and mean |logit error|, KL(reference || bf16) and greedy agreement.

The bounds. bf16 keeps 8 significant bits: rounding moves a value by at most 2^-9 of itself,
uniformly within its binade, a relative std of ~0.1%. Unlike weight-only int8 (one rounding per
weight, ~0.7% of a row's std), bf16 rounds every weight (~0.1%) and every activation after
every op (the residual stream, norm outputs, q/k/v and the cache, attention and MLP outputs:
about ten roundings a layer). Independent errors add in quadrature: ~sqrt(10 * 4 layers) * 0.1%
of the logits' spread, about 0.6%, on tiny (measured 0.76%; small, 12 layers: 1.14%). The bound
on mean |error| / std is 2%; KL ~ Var(e) / 2 (measured 4.7e-5 and 1.0e-4) is bounded by 3e-4;
greedy agreement (near-ties flip on a random model; measured 99% and 93%) >= 85%. A wrong rounding (truncation
drifts every sum one way), a block or head off by one, a dropped residual are errors of tens of
percent and fail.

The native kernels and torch's bf16 ops round at different places (the native ones once per
fused op, torch after each elementary op), so the two bf16 paths differ from each other by about
as much as either differs from float32: the same bound holds between them.
"""

from __future__ import annotations

import pytest
import torch

from disagg.kernels import native_build
from disagg.worker.model.loader import load_model
from disagg.worker.tools.make_model import make_model
from worker.model.test_quantization import compare, ragged_logits

# mean |logit error| / std(reference logits), mean KL, greedy agreement (see above)
BOUNDS = (0.02, 3e-4, 0.85)


def check_bf16(model_dir, monkeypatch, label: str):
    ref_model, config = load_model(model_dir, dtype="float32")
    ref, forced = ragged_logits(ref_model, config.vocab_size)
    native, _ = load_model(model_dir, dtype="bfloat16")
    assert native._native_ok(native.allocate_kv_cache(1, 8))  # the bf16 model takes the native kernels
    got_native, _ = ragged_logits(native, config.vocab_size, forced)
    monkeypatch.setenv("DISAGG_CPU_NATIVE", "0")
    plain, _ = load_model(model_dir, dtype="bfloat16")
    assert not plain._native_ok(plain.allocate_kv_cache(1, 8))
    got_plain, _ = ragged_logits(plain, config.vocab_size, forced)
    rel, kl, agree = BOUNDS
    for name, (a, b) in {
        "native bf16 vs float32": (ref, got_native),
        "torch bf16 vs float32": (ref, got_plain),
        "native vs torch bf16": (got_plain, got_native),
    }.items():
        errors = compare(a, b)
        print(f"{label} {name}: {errors}")
        assert errors.mean_rel < rel and errors.kl_mean < kl and errors.greedy_agree >= agree, (name, errors)


@pytest.mark.skipif(not native_build.available(), reason="needs a C compiler (cc)")
def test_bf16_logits_against_float32_tiny(tmp_path, monkeypatch, one_torch_thread):
    check_bf16(make_model(tmp_path / "tiny", preset="tiny", seed=0), monkeypatch, "tiny")


@pytest.mark.slow
@pytest.mark.skipif(not native_build.available(), reason="needs a C compiler (cc)")
def test_bf16_logits_against_float32_small(tmp_path, monkeypatch):
    check_bf16(make_model(tmp_path / "small", preset="small", seed=0), monkeypatch, "small")


@pytest.mark.skipif(not native_build.available(), reason="needs a C compiler (cc)")
def test_bf16_engine_generates_what_the_float32_engine_does(tmp_path, one_torch_thread):
    """Through the engine (scheduler, mixed steps, decode of ten sequences: past the bf16 GEMV's
    row limit): greedy outputs agree with float32's for most tokens."""
    from disagg.worker.engine.llm import LLM
    from disagg.worker.engine.sampling_params import SamplingParams

    model_dir = make_model(tmp_path / "tiny", preset="tiny", seed=0)
    g = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(10, 1000, (n,), generator=g).tolist() for n in (3, 9, 20, 31, 5, 12, 7, 16, 25, 11)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(str(model_dir), dtype=dtype, load_tokenizer=False, num_gpu_blocks=64)
        assert llm.engine.model.dtype == getattr(torch, dtype)
        outs[dtype] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    same = sum(
        a == b
        for f, b16 in zip(outs["float32"], outs["bfloat16"], strict=True)
        for a, b in zip(f, b16, strict=True)
    )
    total = sum(len(o) for o in outs["float32"])
    print(f"bf16 engine: {same}/{total} greedy tokens as float32")
    assert total == 60 and same >= 0.8 * total  # a later token may follow an earlier near-tie flip
