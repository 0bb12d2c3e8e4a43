"""RMSNorm (+ fused residual), SiLU-and-mul and rotary embedding against their torch twins."""

from __future__ import annotations

import math

import pytest
import torch
from triton_cases import TOLERANCE, case_id

from disagg.kernels import torch_ops
from disagg.kernels.triton_activation import silu_and_mul
from disagg.kernels.triton_norm import rms_norm
from disagg.kernels.triton_rotary import rotary_embedding

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=case_id)
@pytest.mark.parametrize("hidden", [64, 96])
def test_rms_norm(dtype, hidden):
    x = randn(5, hidden, dtype=dtype)
    w = (1 + 0.1 * randn(hidden, seed=1)).to(dtype)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), torch_ops.rms_norm(x, w, 1e-6), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=case_id)
def test_rms_norm_fused_residual(dtype):
    x = randn(2, 3, 128, dtype=dtype)
    residual = randn(2, 3, 128, dtype=dtype, seed=2)
    w = randn(128, seed=1).to(dtype)
    before = residual.clone()
    out, new_residual = rms_norm(x, w, 1e-5, residual)
    exp_out, exp_residual = torch_ops.rms_norm(x, w, 1e-5, residual)
    # exact, except that the interpreter truncates float32 -> bfloat16 casts where torch (and a
    # GPU) rounds to nearest, one unit in the last place apart
    exact = dict(atol=0, rtol=0) if dtype != torch.bfloat16 else dict(atol=0, rtol=2**-7)
    torch.testing.assert_close(new_residual, exp_residual, **exact)
    torch.testing.assert_close(out, exp_out, **TOLERANCE[dtype])
    assert out.shape == x.shape and torch.equal(residual, before)


def test_rms_norm_strided_rows_and_fp32_weight():
    x = randn(6, 200)[:, :100]  # rows of a wider tensor
    w = randn(100, seed=1)
    xb = x.to(torch.bfloat16)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), torch_ops.rms_norm(x, w, 1e-6))
    got = rms_norm(xb, w, 1e-6)
    assert got.dtype == torch.float32  # promoted like the twin's `out * weight`
    torch.testing.assert_close(got, torch_ops.rms_norm(xb, w, 1e-6), **TOLERANCE[torch.bfloat16])
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, w[:50], 1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=case_id)
@pytest.mark.parametrize("inter", [128, 1500])
def test_silu_and_mul(dtype, inter):
    x = randn(3, 2 * inter, dtype=dtype)
    got = silu_and_mul(x)
    assert got.shape == (3, inter)
    torch.testing.assert_close(got, torch_ops.silu_and_mul(x), **TOLERANCE[dtype])


def cos_sin_cache(inv_freq: torch.Tensor, max_pos: int) -> torch.Tensor:
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def llama3_inv_freq(head_dim: int, theta: float, factor: float, low: float, high: float, original: int):
    """Llama 3.1 frequency scaling: long wavelengths slowed by `factor`, short ones kept, a
    smooth blend between (the scaling lives entirely in the cache the kernel reads)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    middle = (wavelen <= original / low) & (wavelen >= original / high)
    return torch.where(middle, blended, scaled)


@pytest.mark.parametrize("dtype", DTYPES, ids=case_id)
@pytest.mark.parametrize("head_dim,q_heads,kv_heads", [(64, 4, 4), (128, 8, 2), (64, 8, 1), (80, 2, 1)])
@pytest.mark.parametrize("scaling", ["none", "llama3"])
def test_rotary_in_place(dtype, head_dim, q_heads, kv_heads, scaling):
    max_pos = 4096
    if scaling == "llama3":
        inv_freq = llama3_inv_freq(head_dim, 500000.0, 8.0, 1.0, 4.0, 64)
    else:
        inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    cache = cos_sin_cache(inv_freq, max_pos)
    positions = torch.tensor([0, 1, 17, 63, 64, 65, 1000, max_pos - 1])
    q = randn(8, q_heads, head_dim, dtype=dtype, seed=3)
    k = randn(8, kv_heads, head_dim, dtype=dtype, seed=4)
    eq, ek = q.clone(), k.clone()
    torch_ops.rotary_embedding(positions, eq, ek, cache)
    rotary_embedding(positions, q, k, cache)
    torch.testing.assert_close(q, eq, **TOLERANCE[dtype])
    torch.testing.assert_close(k, ek, **TOLERANCE[dtype])


def test_llama3_cache_matches_transformers():
    # the helper above is the formula the kernel's llama3 test relies on; pin it to transformers
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
    config = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        rope_theta=500000.0,
        rope_scaling=dict(scaling, original_max_position_embeddings=64),
    )
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    torch.testing.assert_close(llama3_inv_freq(64, 500000.0, 8.0, 1.0, 4.0, 64), expected.float())


def test_rotary_on_views_of_a_fused_projection():
    # q and k as strided slices of one qkv output: rotated through their strides, v untouched
    T, Hq, Hkv, D = 5, 4, 2, 64
    qkv = randn(T, (Hq + 2 * Hkv) * D)
    expected = qkv.clone()
    eq = expected[:, : Hq * D].view(T, Hq, D)
    ek = expected[:, Hq * D : (Hq + Hkv) * D].view(T, Hkv, D)
    cache = cos_sin_cache(1.0 / 10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D), 64)
    positions = torch.arange(T) * 3
    torch_ops.rotary_embedding(positions, eq, ek, cache)
    q = qkv[:, : Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D : (Hq + Hkv) * D].view(T, Hkv, D)
    rotary_embedding(positions, q, k, cache)
    torch.testing.assert_close(qkv, expected)
