"""Quantized weights (int8, fp8 e4m3, per output channel) against the float32 model.

Each scheme runs the same ragged batch as the float32 reference: a packed prefill of three
prompts of different lengths (every position's next-token distribution), then decode steps
fed the reference's greedy tokens, so that every row compares the same context. Printed per
scheme: max and mean |logit error|, mean and max KL(reference || quantized) of the next-token
distributions, and greedy agreement.

The bounds, relative to the spread (std) of the reference logits. Rounding to a per-row grid
makes an error of at most half a step per weight, uniform, so std = step / sqrt(12) with
step = max|W_r| / 127 (int8). For Gaussian rows of a few hundred weights the maximum is about
3 sigma, so each weight is off by ~0.7% of the row's std, and so is every matmul output (the
errors are independent over K). e4m3 keeps 3 mantissa bits: a relative error of at most 2^-4,
uniform within a binade, std ~ 2-3% of each weight: about 4x int8. The logits pass through
four layers of five matmuls plus the LM head (errors add in quadrature, norms keep the scale):
mean |error| / std of ~1-2% for int8 and ~4-8% for fp8, growing as the square root of the depth
(measured with 16-bit inputs, W8A16, on tiny, 4 layers: 1.3% and 5.0%; on small, 12 layers:
2.2% and 7.6%).
Inputs stay 16-bit: rounding them to int8 per row (W8A8, `linear(..., w8a8=True)`) adds about the
weights' own error in quadrature on random models (tiny measured 1.67%, KL 2.2e-4), but on a
pretrained one (SmolLM2-135M, bench/perplexity.py) costs +3.8% perplexity against 16-bit inputs'
-0.2%, so the model never asks for it. Products of BF16_PRODUCT_MIN_ROWS rows or more round their
inputs to bf16 (a relative 2^-9) on CPUs with bf16 products.
The bounds are 2-3x the W8A16 figures: a wrong scale (a factor per row), a wrong row order or a
missing scale (errors of order 100%) fails, rounding passes. KL for a small logit perturbation e
is ~ Var_p(e) / 2, so its bound is 2-4x the measured value (the logit margin squared; small:
6.3e-4 and 4.6e-3). Greedy agreement on a random model is only indicative (near-ties flip), so
its bound is loose.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from disagg.kernels import cpu_bf16, cpu_native
from disagg.kernels.quantized import (
    BF16_PRODUCT_MIN_ROWS,
    W8A8_MIN_ROWS,
    QuantizedWeight,
    linear,
    scaled_linear_bf16,
    scaled_linear_torch,
    scaled_linear_w8a8_torch,
)
from disagg.worker.model import quantization
from disagg.worker.model.loader import load_model
from disagg.worker.tools.make_model import make_model
from worker.conftest import PagedSequences

PROMPT_LENS = (5, 17, 33)
DECODE_STEPS = 4
BLOCK = 8
# mean |logit error| / std(reference logits), mean KL, and greedy agreement, per scheme (see above)
BOUNDS = {"int8": (0.04, 1.5e-3, 0.9), "fp8": (0.15, 2e-2, 0.7)}


@dataclass
class Errors:
    max_abs: float
    mean_abs: float
    mean_rel: float  # mean |error| / std of the reference logits
    kl_mean: float
    kl_max: float
    greedy_agree: float
    rows: int

    def __str__(self) -> str:
        return (
            f"max |err| {self.max_abs:.4f}  mean |err| {self.mean_abs:.5f} ({self.mean_rel:.2%} of std)  "
            f"KL mean {self.kl_mean:.2e} max {self.kl_max:.2e}  greedy {self.greedy_agree:.0%} of {self.rows}"
        )


def ragged_logits(
    model, vocab: int, forced: list[list[int]] | None = None
) -> tuple[torch.Tensor, list[list[int]]]:
    """All next-token logits of a ragged prefill + DECODE_STEPS decode steps; decode inputs are
    `forced` (the reference's greedy tokens) when given, else this model's greedy picks."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]
    seqs = PagedSequences(BLOCK)
    batch = seqs.prefill(list(enumerate(prompts)))
    batch.logits_indices = torch.arange(batch.input_ids.shape[0])  # every position predicts
    cache = model.allocate_kv_cache(64, BLOCK)
    rows = [model.forward(batch, cache)]
    last = torch.tensor([sum(PROMPT_LENS[: i + 1]) - 1 for i in range(len(prompts))])
    nxt = rows[0][last].argmax(-1).tolist()
    picked = []
    for step in range(DECODE_STEPS):
        tokens = forced[step] if forced is not None else nxt
        picked.append(tokens)
        rows.append(model.forward(seqs.decode(list(enumerate(tokens))), cache))
        nxt = rows[-1].argmax(-1).tolist()
    return torch.cat(rows), picked


def compare(ref: torch.Tensor, got: torch.Tensor) -> Errors:
    err = (got - ref).abs()
    logp, logq = F.log_softmax(ref, -1), F.log_softmax(got, -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    return Errors(
        max_abs=float(err.max()), mean_abs=float(err.mean()), mean_rel=float(err.mean() / ref.std()),
        kl_mean=float(kl.mean()), kl_max=float(kl.max()),
        greedy_agree=float((ref.argmax(-1) == got.argmax(-1)).float().mean()), rows=ref.shape[0],
    )  # fmt: skip


def check_schemes(model_dir, threads_note: str = "") -> dict[str, Errors]:
    ref_model, config = load_model(model_dir, quantization_setting="none")
    ref, forced = ragged_logits(ref_model, config.vocab_size)
    out = {}
    for scheme in ("int8", "fp8"):
        model, _ = load_model(model_dir, quantization_setting=scheme)
        assert model.quantization == scheme
        got, _ = ragged_logits(model, config.vocab_size, forced)
        out[scheme] = errors = compare(ref, got)
        print(f"{model_dir.name} {scheme}{threads_note}: {errors}")
        rel, kl, agree = BOUNDS[scheme]
        assert errors.mean_rel < rel and errors.kl_mean < kl and errors.greedy_agree >= agree, (
            scheme,
            errors,
        )
    return out


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tiny") / "m", preset="tiny", seed=0)


def test_quantized_logits_against_float32_tiny(tiny_dir, one_torch_thread):
    errors = check_schemes(tiny_dir)
    # e4m3 keeps fewer bits than per-channel int8 (see above): its error is the larger
    assert errors["fp8"].mean_abs > errors["int8"].mean_abs


@pytest.mark.slow
def test_quantized_logits_against_float32_small(tmp_path):
    check_schemes(make_model(tmp_path / "small", preset="small", seed=0))


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_the_same_logits_on_every_cpu_path(tiny_dir, monkeypatch, one_torch_thread, scheme):
    """8-bit weights through the native kernels (whole-step decode, per-op GEMV, the int8 GEMM) and
    through the torch twins agree: the native GEMV and GEMM round their inputs to 16 bits (VNNI;
    3e-5 of a row's largest value), a difference (measured: 1.3e-4 of the logits' std) under 4% of
    the weights' own error against float32. (With W8A8 inputs, which the model no longer uses, the
    paths differed by the int8 rounding itself: a few inputs cross a rounding boundary, and over
    the layers the two paths' rounding errors decorrelate.)"""
    native, _ = load_model(tiny_dir, quantization_setting=scheme)
    got_native, forced = ragged_logits(native, 1024)
    monkeypatch.setenv("DISAGG_CPU_NATIVE", "0")
    plain, _ = load_model(tiny_dir, quantization_setting=scheme)
    got_plain, _ = ragged_logits(plain, 1024, forced)
    apart = compare(got_plain, got_native)
    rel, max_abs, agree = 5e-4, 5e-3, 1.0
    assert apart.mean_rel < rel and apart.max_abs < max_abs and apart.greedy_agree >= agree, apart


# ---- the quantizers ---------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_quantize_round_trip_error_is_within_one_rounding_step(scheme):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 300, generator=g) * torch.rand(64, 1, generator=g)  # rows of different scales
    w[3] = 0.0  # an all-zero row stays zero, no division by zero
    q = quantization.quantize(w, scheme)
    assert q.scheme == scheme and q.data.shape == w.shape and q.scale.shape == (64,)
    back = q.dequantize()
    amax = w.abs().amax(1, keepdim=True)
    if scheme == "int8":
        assert int(q.data.abs().max()) == 127 and (back - w).abs().le(amax / 254 * 1.0001).all()
    else:  # relative error of at most half a unit of e4m3's 3-bit mantissa (subnormals: absolute)
        bound = torch.maximum(w.abs() * 2**-4, amax / 448 * 2**-10)
        assert (back - w).abs().le(bound * 1.0001).all()
    assert torch.equal(back[3], torch.zeros(300))


def test_linear_dispatch_agrees_with_the_twin_and_dequantized_weight():
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(96, 80, generator=g), torch.randn(96, generator=g)
    for scheme in ("int8", "fp8"):
        q = quantization.quantize(w, scheme)
        for rows in (1, 3, 40, 300):  # int8: the GEMV below W8A8_MIN_ROWS rows, the GEMM from there (VNNI)
            x = torch.randn(rows, 80, generator=g)
            want = F.linear(x, q.dequantize(), b)
            torch.testing.assert_close(scaled_linear_torch(x, q, b), want, atol=1e-4, rtol=1e-4)
            # W8A16 through the bf16 GEMM: inputs and each product rounded to bf16 (half a unit of
            # 2^-8 each), the weight widened exactly
            bf16_bound = 2**-8 * (x.abs() @ q.dequantize().abs().T) + 2**-8 * (want - b).abs() + 1e-5
            assert ((scaled_linear_bf16(x, q, b) - want).abs() <= bf16_bound).all()
            if rows >= BF16_PRODUCT_MIN_ROWS and cpu_bf16.dot_native():
                torch.testing.assert_close(linear(x, q, b), scaled_linear_bf16(x, q, b), atol=0, rtol=0)
            elif scheme == "int8" and rows >= W8A8_MIN_ROWS and cpu_native.gemm_int8_is_fast():
                # W8A8 when asked: each input off by at most half its row's step max|x| / 127
                step = x.abs().amax(1, keepdim=True) / 127
                bound = step / 2 * q.dequantize().abs().sum(1) + 1e-4
                assert ((linear(x, q, b, w8a8=True) - want).abs() <= bound).all()
                torch.testing.assert_close(linear(x, q, b, w8a8=True), scaled_linear_w8a8_torch(x, q, b))
                # by default 16-bit rows: ~sqrt(K) * 3e-5 * max|x| * max|w|
                torch.testing.assert_close(linear(x, q, b), want, atol=2e-3, rtol=1e-4)
            else:
                # the native int8 GEMV rounds inputs to int16: ~sqrt(K) * 3e-5 * max|x| * max|w|
                torch.testing.assert_close(linear(x, q, b), want, atol=2e-3, rtol=1e-4)
    # a plain weight: F.linear, or on CPU the native float32 GEMM (tests/kernels/test_cpu_gemm.py)
    torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b))


def test_quantized_weight_refuses_bad_parts():
    with pytest.raises(TypeError, match="int8 or float8"):
        QuantizedWeight(torch.zeros(4, 4), torch.ones(4))
    with pytest.raises(ValueError, match="one scale per row"):
        QuantizedWeight(torch.zeros(4, 4, dtype=torch.int8), torch.ones(3))


# ---- settings and checkpoints -----------------------------------------------------------------
def test_resolve_setting_against_the_checkpoint():
    assert quantization.resolve("auto", None) is None
    assert quantization.resolve("none", None) is None
    assert quantization.resolve("int8", None) == "int8"
    assert quantization.resolve("auto", "fp8") == "fp8"
    assert quantization.resolve("fp8", "fp8") == "fp8"
    for requested in ("none", "int8"):
        with pytest.raises(ValueError, match="conflicts with the checkpoint, which is pre-quantized as fp8"):
            quantization.resolve(requested, "fp8")


def test_engine_serves_the_quantization_it_was_asked_for(tiny_dir):
    from disagg.worker.engine.llm_engine import LLMEngine

    engine = LLMEngine(str(tiny_dir), quantization="int8", load_tokenizer=False, num_gpu_blocks=8)
    assert engine.model.quantization == "int8"
    assert isinstance(engine.model.weights.layers[0].down, QuantizedWeight)
    assert isinstance(engine.model.weights.lm_head, QuantizedWeight)
    assert not isinstance(engine.model.weights.embed, QuantizedWeight)  # lookups stay in dtype
    # fp8 keeps the LM head in the model's dtype (tiny's is untied; a tied one is the embedding)
    fp8, _ = load_model(tiny_dir, quantization_setting="fp8")
    assert fp8.quantization == "fp8" and fp8.weights.layers[0].down.scheme == "fp8"
    assert not isinstance(fp8.weights.lm_head, QuantizedWeight) and fp8.weights.lm_head.dtype == torch.float32
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLMEngine(str(tiny_dir), quantization="int4", load_tokenizer=False)


def test_config_json_without_quantization_is_plain(tiny_dir):
    assert quantization.checkpoint_scheme(tiny_dir) is None
    assert "quantization_config" not in json.loads((tiny_dir / "config.json").read_text())


# ---- pre-quantized checkpoints (compressed-tensors, as llm-compressor writes them) -------------
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def compressed_tensors_checkpoint(src, dst, scheme: str, strategy: str = "channel"):
    """`src` (a float checkpoint) quantized the way llm-compressor saves it: every Linear of the
    decoder layers as `*.weight` (int8 / float8_e4m3fn) + `*.weight_scale` (the model dtype,
    [out, 1] per channel or [1] per tensor; W8A8 fp8 adds a static `*.input_scale`), lm_head
    ignored, and config.json's `quantization_config`."""
    import shutil

    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    out = {}
    for name, t in tensors.items():
        if not any(f".{p}.weight" in name for p in PROJECTIONS):
            out[name] = t
            continue
        if strategy == "channel":
            q = quantization.quantize(t, scheme)
            out[name], out[name + "_scale"] = q.data, q.scale[:, None].clone()
        else:  # one scale for the whole tensor
            limit = 127.0 if scheme == "int8" else quantization.FP8_MAX
            scale = t.abs().max() / limit
            data = (t / scale).clamp(-limit, limit)
            out[name] = data.round().to(torch.int8) if scheme == "int8" else data.to(torch.float8_e4m3fn)
            out[name + "_scale"] = scale.reshape(1)
        if scheme == "fp8":
            out[name.removesuffix("weight") + "input_scale"] = torch.ones(1)
    save_file(out, dst / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    kind = "int" if scheme == "int8" else "float"
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized" if scheme == "int8" else "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": kind, "symmetric": True, "strategy": strategy,
                            "dynamic": False, "group_size": None, "observer": "minmax"},
                "input_activations": None if scheme == "int8" else {
                    "num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False},
                "output_activations": None,
            }
        },
    }  # fmt: skip
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_prequantized_checkpoint_loads_as_stored(tiny_dir, tmp_path, scheme, one_torch_thread):
    ckpt = compressed_tensors_checkpoint(tiny_dir, tmp_path / "ct", scheme)
    assert quantization.checkpoint_scheme(ckpt) == scheme
    model, config = load_model(ckpt)  # quantization inferred: auto
    assert model.quantization == scheme
    on_the_fly, _ = load_model(tiny_dir, quantization_setting=scheme)
    for got, want in zip(model.weights.layers, on_the_fly.weights.layers, strict=True):
        for name in ("qkv", "o", "gate_up", "down"):  # the same quantizer, fused the same way
            assert torch.equal(
                getattr(got, name).data.view(torch.int8), getattr(want, name).data.view(torch.int8)
            )
            assert torch.equal(getattr(got, name).scale, getattr(want, name).scale)
    assert not isinstance(model.weights.lm_head, QuantizedWeight)  # in `ignore`: stored as it was
    ref_model, _ = load_model(tiny_dir)
    ref, forced = ragged_logits(ref_model, config.vocab_size)
    got, _ = ragged_logits(model, config.vocab_size, forced)
    errors = compare(ref, got)
    print(f"compressed-tensors {scheme}: {errors}")
    assert errors.mean_rel < BOUNDS[scheme][0] and errors.kl_mean < BOUNDS[scheme][1]


def test_per_tensor_scales_are_spread_over_the_rows(tiny_dir, tmp_path):
    ckpt = compressed_tensors_checkpoint(tiny_dir, tmp_path / "ct", "fp8", strategy="tensor")
    model, _ = load_model(ckpt)
    qkv = model.weights.layers[0].qkv
    ref, _ = load_model(tiny_dir)
    q_rows = ref.num_heads * ref.head_dim
    assert qkv.scale.shape == (qkv.shape[0],) and len(set(qkv.scale[:q_rows].tolist())) == 1
    assert qkv.scale[0] != qkv.scale[-1]  # q's and v's tensors had their own scales
    err = (qkv.dequantize() - ref.weights.layers[0].qkv).abs().max()
    assert err <= ref.weights.layers[0].qkv.abs().max() * 2**-4


def test_conflicting_setting_and_unsupported_layouts_are_refused(tiny_dir, tmp_path):
    ckpt = compressed_tensors_checkpoint(tiny_dir, tmp_path / "ct", "int8")
    for requested in ("none", "fp8"):
        with pytest.raises(ValueError, match=f"quantization='{requested}' conflicts with the checkpoint"):
            load_model(ckpt, quantization_setting=requested)
    assert load_model(ckpt, quantization_setting="int8")[0].quantization == "int8"
    config = json.loads((ckpt / "config.json").read_text())
    bad = [
        ({"format": "pack-quantized"}, "quantization_config.format 'pack-quantized' is not supported"),
        ({"quant_method": "gptq"}, "quant_method 'gptq' is not supported"),
    ]
    for change, message in bad:
        raw = {**config, "quantization_config": {**config["quantization_config"], **change}}
        with pytest.raises(ValueError, match=message):
            quantization.scheme_from_config(raw)
    four_bit = json.loads(json.dumps(config))
    four_bit["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 4
    with pytest.raises(ValueError, match="group_0.weights.num_bits must be 8"):
        quantization.scheme_from_config(four_bit)
