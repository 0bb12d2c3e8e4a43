"""Step 1: every Triton kernel against its torch twin, in float32, bfloat16 and float16 and over
the 8-bit paths, at the shapes of the `small` preset and of one Llama-3-8B layer.

The reference is the twin run on the same inputs widened to float32 (float64 for the matmuls'
own reference): the error of the kernel in its dtype is ‖got − ref‖ / ‖ref‖, bounded per dtype
(`common.REL_BOUND`); writes into the cache must be exact. Each kernel is also timed (median of
CUDA events) so a regression shows as a figure, never as a failure.
"""

from __future__ import annotations

import sys

import torch
from common import REL_BOUND, ROOT, Context, StepResult, rel_error, time_ms

sys.path.insert(0, str(ROOT / "tests" / "kernels"))
from triton_cases import paged_cache, prefill_case  # noqa: E402

# (q heads, kv heads, head dim, hidden, intermediate): the model shapes the kernels serve
SHAPES = {
    "small": dict(hq=12, hkv=4, d=64, hidden=768, inter=2048),
    "llama3-8b": dict(hq=32, hkv=8, d=128, hidden=4096, inter=14336),
}
SMOKE_SHAPES = {"smoke": dict(hq=4, hkv=2, d=32, hidden=64, inter=96)}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _bound(name: str, err: float, dtype: torch.dtype, r: StepResult, scale: float = 1.0) -> None:
    bound = REL_BOUND[dtype] * scale
    r.check(name, err <= bound, f"rel err {err:.2e} (bound {bound:.0e})")


def check_elementwise(ctx: Context, shape: str, s: dict, dtype, r: StepResult) -> None:
    from disagg.kernels import torch_ops, triton_ops

    dev, tokens = ctx.device, (1, 64, 2048) if ctx.full else (1, 5)
    for t in tokens:
        g = _gen(t)
        x = torch.randn(t, s["hidden"], generator=g).to(dtype).to(dev)
        res = torch.randn(t, s["hidden"], generator=g).to(dtype).to(dev)
        w = (1 + 0.1 * torch.randn(s["hidden"], generator=g)).to(dtype).to(dev)
        got, got_res = triton_ops.rms_norm(x, w, 1e-5, residual=res)
        ref, ref_res = torch_ops.rms_norm(x.float(), w.float(), 1e-5, residual=res.float())
        _bound(f"rms_norm+residual {shape} T={t} {dtype}", rel_error(got, ref), dtype, r)
        _bound(f"rms_norm residual out {shape} T={t} {dtype}", rel_error(got_res, ref_res), dtype, r)
        gu = torch.randn(t, 2 * s["inter"], generator=g).to(dtype).to(dev)
        err = rel_error(triton_ops.silu_and_mul(gu), torch_ops.silu_and_mul(gu.float()))
        _bound(f"silu_and_mul {shape} T={t} {dtype}", err, dtype, r)
        pos = torch.randint(0, 4096, (t,), generator=g).to(dev)
        d = s["d"]
        inv = 1.0 / (500000 ** (torch.arange(0, d, 2).float() / d))
        ang = torch.arange(4096).float()[:, None] * inv[None, :]
        cs = torch.cat([ang.cos(), ang.sin()], -1).to(dev)
        q = torch.randn(t, s["hq"], d, generator=g).to(dtype).to(dev)
        k = torch.randn(t, s["hkv"], d, generator=g).to(dtype).to(dev)
        qr, kr = q.float().clone(), k.float().clone()
        torch_ops.rotary_embedding(pos, qr, kr, cs)
        triton_ops.rotary_embedding(pos, q, k, cs)
        _bound(
            f"rotary q,k {shape} T={t} {dtype}",
            rel_error(torch.cat([q, k], 1), torch.cat([qr, kr], 1)),
            dtype,
            r,
        )
    if ctx.full and dtype == torch.bfloat16:
        x = torch.randn(2048, s["hidden"], device=dev, dtype=dtype)
        w = torch.ones(s["hidden"], device=dev, dtype=dtype)
        ms = time_ms(lambda: triton_ops.rms_norm(x, w, 1e-5, residual=x), ctx)
        r.figure(
            f"rms_norm+residual {shape} T=2048 bf16",
            ms * 1e3,
            "us",
            f"{3 * x.numel() * 2 / (ms / 1e3) / 1e9:.0f} GB/s",
        )


def check_kv_write(ctx: Context, shape: str, s: dict, dtype, r: StepResult) -> None:
    from disagg.kernels import torch_ops, triton_ops

    g, page = _gen(3), 16
    lens = [700, 33, 1, 1500] if ctx.full else [20, 1, 5]
    cache, tables = paged_cache(lens, page, s["hkv"], s["d"], dtype, g)
    t = sum(lens)
    k = torch.randn(t, s["hkv"], s["d"], generator=g).to(dtype)
    v = torch.randn(t, s["hkv"], s["d"], generator=g).to(dtype)
    slots = torch.randperm(cache.shape[0] * page, generator=g)[:t]
    slots[::7] = -1  # padding rows: skipped
    want, got = cache.clone().to(ctx.device), cache.clone().to(ctx.device)
    torch_ops.write_kv_cache(k.to(ctx.device), v.to(ctx.device), want, slots.to(ctx.device))
    triton_ops.write_kv_cache(k.to(ctx.device), v.to(ctx.device), got, slots.to(ctx.device))
    r.check(f"write_kv_cache {shape} {dtype}", torch.equal(got, want), f"{t} tokens, exact")


def check_attention(ctx: Context, shape: str, s: dict, dtype, r: StepResult) -> None:
    from disagg.kernels import torch_ops, triton_ops

    dev, d, page = ctx.device, s["d"], 16
    scale = d**-0.5
    # prefill: a whole prompt, a chunk after a cached prefix, a short one
    ctxs, qs = ([0, 1000, 37], [1024, 512, 200]) if ctx.full else ([0, 9], [12, 7])
    q, k, v, cache, tables, cu, lens = prefill_case(ctxs, qs, page, s["hq"], s["hkv"], d, dtype, seed=5)
    to = [t.to(dev) for t in (q, k, v, cache, tables, cu, lens)]
    ref = torch_ops.prefill_attention(*(t.float() if t.is_floating_point() else t for t in to), scale)
    got = triton_ops.prefill_attention(*to, scale)
    _bound(f"prefill_attention {shape} {dtype}", rel_error(got, ref), dtype, r)
    # decode: ragged lengths, one per block boundary case, and a batch of 64 long ones
    g = _gen(7)
    cases = [[1, page, page + 1, 3 * page - 5]] + (
        [[int(x) for x in torch.randint(1, 4096, (64,), generator=g)]] if ctx.full else []
    )
    for lens_list in cases:
        cache, tables = paged_cache(lens_list, page, s["hkv"], d, dtype, g)
        q = torch.randn(len(lens_list), s["hq"], d, generator=g).to(dtype)
        lens_t = torch.tensor(lens_list, dtype=torch.int32)
        qd, cd, td, ld = q.to(dev), cache.to(dev), tables.to(dev), lens_t.to(dev)
        ref = torch_ops.decode_attention(qd.float(), cd.float(), td, ld, scale)
        got = triton_ops.decode_attention(qd, cd, td, ld, scale)
        _bound(f"decode_attention {shape} B={len(lens_list)} {dtype}", rel_error(got, ref), dtype, r)
        if ctx.full and dtype == torch.bfloat16 and len(lens_list) == 64:
            ms = time_ms(
                lambda qd=qd, cd=cd, td=td, ld=ld: triton_ops.decode_attention(qd, cd, td, ld, scale), ctx
            )
            kv_bytes = sum(lens_list) * 2 * s["hkv"] * d * 2
            r.figure(
                f"decode_attention {shape} B=64 bf16",
                ms * 1e3,
                "us",
                f"{kv_bytes / (ms / 1e3) / 1e9:.0f} GB/s of KV",
            )


def check_kv_quant(ctx: Context, shape: str, s: dict, r: StepResult) -> None:
    from disagg.kernels import torch_ops, triton_kv_quant
    from disagg.kernels.kv_quant import KVQuantFormat, QuantizedKVStep

    dev, d, page, hkv = ctx.device, s["d"], 16, s["hkv"]
    for name in ("int8", "fp8"):
        fmt = KVQuantFormat(name, page, hkv, d)
        g = _gen(11)
        lens = [1, page, page + 1, 3 * page - 5] + ([1500, 700] if ctx.full else [])
        per = [-(-n // page) for n in lens]
        nblocks = sum(per) + 2
        ids = torch.randperm(nblocks, generator=g)
        tables = torch.zeros(len(lens), max(per), dtype=torch.int32)
        at = 0
        for i, n in enumerate(per):
            tables[i, :n] = ids[at : at + n]
            at += n
        kv = torch.randn(nblocks * page, hkv, d, generator=g) * 2
        slots = torch.arange(nblocks * page)
        want, got = fmt.allocate(1, nblocks, dev)[0], fmt.allocate(1, nblocks, dev)[0]
        fmt.write(kv.to(dev), (-kv.roll(1, 0)).to(dev), want, slots.to(dev))
        triton_kv_quant.write_kv_quantized(kv.to(dev), (-kv.roll(1, 0)).to(dev), got, slots.to(dev), fmt)
        differ = float((fmt.values(got).float() != fmt.values(want).float()).float().mean())
        r.check(
            f"write_kv_quantized {name} {shape}",
            differ < 0.005,
            f"{differ:.2%} of values off by a rounding tie",
        )
        seq_lens = torch.tensor(lens, dtype=torch.int32).to(dev)
        q = torch.randn(len(lens), s["hq"], d, generator=g).to(dev)
        step = QuantizedKVStep(fmt, tables.to(dev), seq_lens, torch.float32)
        ref = torch_ops.decode_attention(q, step.layer_cache(want), step.tables, seq_lens, d**-0.5)
        out = triton_kv_quant.decode_attention_quantized(q, want, tables.to(dev), seq_lens, d**-0.5, fmt)
        _bound(f"decode_attention_quantized {name} {shape}", rel_error(out, ref), torch.float32, r)


def check_scaled_matmul(ctx: Context, shape: str, s: dict, dtype, r: StepResult) -> None:
    from disagg.kernels.quantized import QuantizedWeight, scaled_linear_torch
    from disagg.kernels.triton_scaled_matmul import scaled_matmul
    from disagg.worker.model.quantization import quantize

    h, i, d = s["hidden"], s["inter"], s["d"]
    layers = {"qkv": ((s["hq"] + 2 * s["hkv"]) * d, h), "gate_up": (2 * i, h), "down": (h, i)}
    rows = (1, 64, 512) if ctx.full else (1, 3)
    for scheme in ("int8", "fp8"):
        for lname, (n, k) in layers.items():
            g = _gen(n + k)
            qw = quantize(torch.randn(n, k, generator=g) / k**0.5, scheme)
            qd = QuantizedWeight(qw.data.to(ctx.device), qw.scale.to(ctx.device))
            for m in rows:
                x = torch.randn(m, k, generator=g).to(dtype).to(ctx.device)
                ref = scaled_linear_torch(x.double(), QuantizedWeight(qd.data, qd.scale), None)
                got = scaled_matmul(x, qd.data, qd.scale)
                _bound(f"scaled_matmul {scheme} {shape} {lname} M={m} {dtype}", rel_error(got, ref), dtype, r)
            if ctx.full and dtype == torch.bfloat16 and shape == "llama3-8b":
                x1 = torch.randn(1, k, device=ctx.device, dtype=dtype)
                ms = time_ms(lambda x1=x1, qd=qd: scaled_matmul(x1, qd.data, qd.scale), ctx)
                r.figure(f"scaled_matmul {scheme} {lname} M=1 bf16", ms * 1e3, "us",
                         f"{n * k / (ms / 1e3) / 1e9:.0f} GB/s of weights")  # fmt: skip


def run(ctx: Context) -> StepResult:
    r = StepResult()
    from disagg.kernels import get_ops

    r.check(
        "op table on this device is Triton",
        get_ops(ctx.device).backend == "triton",
        get_ops(ctx.device).backend,
    )
    for shape, s in (SHAPES if ctx.full else SMOKE_SHAPES).items():
        for dtype in DTYPES:
            check_elementwise(ctx, shape, s, dtype, r)
            check_kv_write(ctx, shape, s, dtype, r)
            check_attention(ctx, shape, s, dtype, r)
            check_scaled_matmul(ctx, shape, s, dtype, r)
        check_kv_quant(ctx, shape, s, r)
    return r
