"""Each weight's matmul plan: resolved once (`quantized.resolve`), the same products as a plan
resolved on every call, and `DISAGG_CPU_NATIVE=0` still honoured by a weight resolved before it."""

from __future__ import annotations

import needs
import pytest
import torch
import torch.nn.functional as F

from disagg.kernels import cpu_native, quantized
from disagg.worker.model import quantization

pytestmark = needs.native

# every row threshold of the plans, each with the rows on both of its sides
ROWS = sorted(
    {
        r
        for t in (
            quantized.W8A8_MIN_ROWS - 1,
            quantized.FP8_NATIVE_MAX_ROWS,
            quantized.BF16_GEMV_MAX_ROWS,
            quantized.BF16_AMX_MIN_ROWS - 1,
            quantized.BF16_AMX_MAX_ROWS,
            quantized.INT8_AMX_MAX_ROWS,
            quantized.GEMM_NATIVE_MAX_ROWS_AVX2,
            quantized.BF16_PRODUCT_MIN_ROWS - 1,
            quantized.NATIVE_MAX_ROWS,
        )
        for r in (t, t + 1)
    }
    | {1}
)


def _weights(gen: torch.Generator) -> dict[str, torch.Tensor | quantized.QuantizedWeight]:
    w = torch.randn(40, 48, generator=gen) * 48**-0.5
    return {
        "float32": w,
        "bfloat16": w.bfloat16(),
        "int8": quantization.quantize(w, "int8"),
        "fp8": quantization.quantize(w, "fp8"),
    }


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8", "fp8"])
def test_a_resolved_plan_gives_the_products_of_one_resolved_per_call(kind):
    gen = torch.Generator().manual_seed(1)
    w = _weights(gen)[kind]
    dtype = torch.bfloat16 if kind == "bfloat16" else torch.float32
    bias = torch.randn(40, generator=gen).to(dtype)
    xs = [torch.randn(m, 48, generator=gen).to(dtype) for m in ROWS]
    per_call = [quantized.linear(x, w, b) for x in xs for b in (None, bias)]
    assert getattr(w, "matmul_plan", None) is None  # nothing kept without `resolve`
    plan = quantized.resolve(w)
    assert w.matmul_plan is plan and plan.native is True
    once = [quantized.linear(x, w, b) for x in xs for b in (None, bias)]
    for a, b in zip(per_call, once, strict=True):
        assert torch.equal(a, b)


def test_a_resolved_weight_follows_disagg_cpu_native(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    weights = _weights(gen)
    for w in weights.values():
        quantized.resolve(w)
    x = torch.randn(3, 48, generator=gen)
    monkeypatch.setenv("DISAGG_CPU_NATIVE", "0")  # after resolving: the torch path all the same
    assert torch.equal(quantized.linear(x, weights["float32"]), F.linear(x, weights["float32"]))
    for kind in ("int8", "fp8"):
        w = weights[kind]
        assert torch.equal(quantized.linear(x, w), quantized.scaled_linear_torch(x, w))


def test_the_plan_runs_each_kernel_on_its_rows():
    w = torch.randn(40, 48)
    plan = quantized.plan_for(w)
    limit = quantized.gemm_native_max_rows()
    assert plan.kernel_for(torch.randn(limit, 48), w) is quantized.native_gemm
    beyond = quantized.packed_gemm if cpu_native.narrow_tiles() else quantized.torch_gemm
    assert plan.kernel_for(torch.randn(limit + 1, 48), w) is beyond
    # inputs no native kernel takes: torch's GEMM at any rows
    assert plan.kernel_for(torch.randn(2, 48).double(), w) is quantized.torch_gemm
    assert plan.kernel_for(torch.randn(2, 48), w, torch.randn(40, 2)[:, 0]) is quantized.torch_gemm


def test_the_loader_resolves_every_matmul_weight(tiny_llama_dir):
    from disagg.worker.model.loader import load_model

    model, _ = load_model(tiny_llama_dir, quantization_setting="int8")
    w = model.weights
    mats = [getattr(layer, n) for layer in w.layers for n in ("qkv", "o", "gate_up", "down")]
    for t in (*mats, w.lm_head):
        assert isinstance(t.matmul_plan, quantized.MatmulPlan)
