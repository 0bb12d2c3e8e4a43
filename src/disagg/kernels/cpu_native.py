"""ctypes bindings of the native CPU kernels' float32-activation ops (`csrc/`, built and loaded by
`native_build`): add + RMSNorm, SiLU x mul, rotary + KV write and paged decode attention over a
float32 cache; the GEMV and the GEMMs of float32 inputs against float32, bf16, int8 or fp8 weights.
Also the checks and calls that `cpu_bf16` and `cpu_kv_quant` share for their dtypes.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from disagg.kernels import native_build

_p, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "paged_decode_attention_f32": (
        [_p, _i64, _p, _p, _i64, _p, _p, _i64, _i64, _i64, _i64, _i64, _f32, _p, _i64, _i64],
        ctypes.c_int,
    ),
    "add_rms_norm_f32": ([_p, _p, _p, _p, _i64, _i64, _f32], None),
    "silu_and_mul_f32": ([_p, _p, _i64, _i64], None),
    "rotary_write_kv_f32": ([_p, _i64, _p, _p, _p, _p, _i64, _i64, _i64, _i64, _i64], None),
    "gemv_f32": ([_p, _p, _p, _p, _i64, _i64, _i64, _i64], None),
    "gemv_silu_f32": ([_p, _p, _p, _p, _i64, _i64, _i64, _i64], None),
    "gemm_f32": ([_p, _p, _p, _p, _i64, _i64, _i64, _i64], None),
    "gemm_vector_floats": ([], _i64),
    "gemm_w8_amx": ([_p, ctypes.c_int, _p, _p, _p, _p, _i64, _i64, _i64, _i64], ctypes.c_int),
    "gemm_i8_amx": ([_p, _p, _p, _p, _p, _i64, _i64, _i64, _i64], ctypes.c_int),
    "gemm_packed": ([_p, _i64, _p, _p, _p, _p, _i64, _i64, _i64, _i64], ctypes.c_int),
    "gemv_i8": ([_p, _p, _p, _p, _p, _i64, _i64, _i64, _i64], ctypes.c_int),
    "gemv_silu_i8": ([_p, _p, _p, _p, _p, _i64, _i64, _i64, _i64], ctypes.c_int),
    "gemm_i8": ([_p, _p, _p, _p, _p, _p, _i64, _i64, _i64, _i64, _i64], ctypes.c_int),
    "gemm_i8_vnni": ([], ctypes.c_int),
    "gemv_fp8": ([_p, _p, _p, _p, _p, _i64, _i64, _i64, _i64], None),
    "fp8_to_f32": ([_p, _p, _i64, _i64], None),
}


@functools.cache
def _lib() -> ctypes.CDLL:
    return native_build.bind(_SIGNATURES)


# Below this many (query head x cached token) visits a call is too short to split over threads.
_PARALLEL_MIN_WORK = 8192


def check_cpu(dtype: torch.dtype, **tensors: torch.Tensor) -> None:
    """Each tensor is contiguous, on the CPU and of `dtype` (what the C kernels take)."""
    for name, t in tensors.items():
        if t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(
                f"{name}: native kernels take contiguous {str(dtype).removeprefix('torch.')} CPU tensors, "
                f"got {t.dtype} {t.device}"
            )


def _check_f32(**tensors: torch.Tensor) -> None:
    check_cpu(torch.float32, **tensors)


def add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """rms_norm(x + residual) * weight over the last dim; with `residual`, the sum is written
    back into it (in place), as a decoder layer's fused add + norm."""
    return add_rms_norm_call(_lib().add_rms_norm_f32, torch.float32, x, weight, eps, residual)


def add_rms_norm_call(kernel, dtype: torch.dtype, x, weight, eps: float, residual) -> torch.Tensor:
    """`add_rms_norm` through the C `kernel` of `dtype` (float32 here, bfloat16 in `cpu_bf16`)."""
    check_cpu(dtype, x=x, weight=weight, **({} if residual is None else {"residual": residual}))
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual: shape {tuple(residual.shape)} differs from x {tuple(x.shape)}")
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight: shape {tuple(weight.shape)}, need ({hidden},)")
    out = torch.empty_like(x)
    kernel(
        x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
        x.numel() // hidden, hidden, eps,
    )  # fmt: skip
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I]: silu(first half) * second half."""
    return silu_and_mul_call(_lib().silu_and_mul_f32, torch.float32, x)


def silu_and_mul_call(kernel, dtype: torch.dtype, x: torch.Tensor) -> torch.Tensor:
    """`silu_and_mul` through the C `kernel` of `dtype`."""
    check_cpu(dtype, x=x)
    inter = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype)
    kernel(x.data_ptr(), out.data_ptr(), x.numel() // (2 * inter), inter)
    return out


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x [B, K], as the decode step computes it: memory-bound
    matrix-vector products for small B, rows of the weight split over torch's threads."""
    _check_f32(x=x, weight=weight, **({} if bias is None else {"bias": bias}))
    (b, k), n = x.shape, weight.shape[0]
    if weight.shape[1] != k or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"x {tuple(x.shape)}, weight {tuple(weight.shape)}: shapes do not match")
    y = torch.empty(b, n, dtype=torch.float32)
    _lib().gemv_f32(
        weight.data_ptr(), None if bias is None else bias.data_ptr(), x.data_ptr(), y.data_ptr(), b, n, k,
        torch.get_num_threads(),
    )  # fmt: skip
    return y


def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x [M, K] of a few dozen rows (decode steps of many
    sequences): register-blocked products, rows of the weight split over torch's threads."""
    _check_f32(x=x, weight=weight, **({} if bias is None else {"bias": bias}))
    (m, k), n = x.shape, weight.shape[0]
    if weight.shape[1] != k or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"x {tuple(x.shape)}, weight {tuple(weight.shape)}: shapes do not match")
    y = torch.empty(m, n, dtype=torch.float32)
    _lib().gemm_f32(
        weight.data_ptr(), None if bias is None else bias.data_ptr(), x.data_ptr(), y.data_ptr(), m, n, k,
        torch.get_num_threads(),
    )  # fmt: skip
    return y


_PACKED_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.float8_e4m3fn: 3}
_SCALED_KINDS = (torch.int8, torch.float8_e4m3fn)


def gemm_packed(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear(x, weight * scale[:, None], bias)` for float32 x [M, K] of many rows and weight [N, K]
    float32, bf16, int8 or float8_e4m3fn (the 8-bit ones with one float32 `scale` per row): weight
    panels packed (and widened) a block of K at a time into a per-thread buffer that stays in cache,
    an outer-product micro-kernel over them (cpu_gemm_packed.c). For CPUs without AVX-512, where it
    runs at 85-95% of a core's float32 FMA peak."""
    _check_f32(x=x, **({} if bias is None else {"bias": bias}), **({} if scale is None else {"scale": scale}))
    kind = _PACKED_KINDS.get(weight.dtype)
    if kind is None or not weight.is_contiguous() or weight.device.type != "cpu":
        raise ValueError(
            "weight: a contiguous float32, bfloat16, int8 or float8_e4m3fn CPU tensor, "
            f"got {weight.dtype} {weight.device}"
        )
    (m, k), n = x.shape, weight.shape[0]
    if weight.shape[1] != k or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"x {tuple(x.shape)}, weight {tuple(weight.shape)}: shapes do not match")
    if (weight.dtype in _SCALED_KINDS) != (scale is not None) or (scale is not None and scale.shape != (n,)):
        raise ValueError("scale: int8 and fp8 weights need one float32 scale per row, other weights none")
    y = torch.empty(m, n, dtype=torch.float32)
    if _lib().gemm_packed(
        weight.data_ptr(), kind, None if scale is None else scale.data_ptr(),
        None if bias is None else bias.data_ptr(), x.data_ptr(), y.data_ptr(), m, n, k, torch.get_num_threads(),
    ):  # fmt: skip
        raise MemoryError("gemm_packed: no memory for the weight panels")
    return y


@functools.cache
def gemm_vector_floats() -> int:
    """Floats per vector register the GEMM's tiles were built for: 16 with AVX-512, 8 elsewhere
    (where its tiles are a third the size and torch's GEMM takes over at fewer rows). Asked once:
    matmul dispatch reads it on every call."""
    return int(_lib().gemm_vector_floats())


def raise_for_amx(rc: int, what: str) -> None:
    """The return code of a cpu_amx.c GEMM as an exception (0: none)."""
    if rc == -2:
        raise RuntimeError("AMX is not usable in this process (native_build.amx_usable() is False)")
    if rc:
        raise MemoryError(f"{what}: no memory for its buffers")


def gemm_8bit_amx(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """float32 x [M, K] rounded to bf16 times 8-bit weight [N, K] (int8 or float8_e4m3fn, widened
    exactly to bf16 in tiles) on AMX (cpu_amx.c), float32 sums times `scale` [N] (+ bias) in
    float32. Only where `native_build.amx_usable()`."""
    check_cpu(torch.float32, x=x, scale=scale, **({} if bias is None else {"bias": bias}))
    if weight.dtype not in (torch.int8, torch.float8_e4m3fn) or not weight.is_contiguous():
        raise ValueError(f"weight: need contiguous int8 or float8_e4m3fn, got {weight.dtype}")
    (m, k), n = x.shape, weight.shape[0]
    if weight.shape[1] != k or scale.shape != (n,) or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"x {tuple(x.shape)}, weight {tuple(weight.shape)}: shapes do not match")
    y = torch.empty(m, n, dtype=torch.float32)
    rc = _lib().gemm_w8_amx(
        weight.data_ptr(), int(weight.dtype == torch.float8_e4m3fn), scale.data_ptr(),
        None if bias is None else bias.data_ptr(), x.data_ptr(), y.data_ptr(), m, n, k, torch.get_num_threads(),
    )  # fmt: skip
    raise_for_amx(rc, "gemm_8bit_amx")
    return y


def gemm_int8_amx(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`gemm_int8(..., input_bits=16)` on AMX (cpu_amx.c): the same rounded inputs and integer sums,
    so the same floats, with the int8 weight's rows read in place as tiles. Only where
    `native_build.amx_usable()`."""
    _check_int8_weight(x, weight, scale, bias, 1)
    (m, k), n = x.shape, weight.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if m == 0:
        return y
    rc = _lib().gemm_i8_amx(
        weight.data_ptr(), scale.data_ptr(), None if bias is None else bias.data_ptr(), x.data_ptr(),
        y.data_ptr(), m, n, k, torch.get_num_threads(),
    )  # fmt: skip
    raise_for_amx(rc, "gemm_int8_amx")
    return y


def narrow_tiles() -> bool:
    """Whether the kernels were built without AVX-512 (8-float tiles): the packed-panel GEMM then
    takes the products of many rows."""
    return native_build.available() and gemm_vector_floats() < 16


# With 8-float tiles the register-tiled GEMMs win up to this many rows, the packed-panel GEMM beyond
# (`quantized.GEMM_NATIVE_MAX_ROWS_AVX2`, which is this: `bench/small_gemm.py --thresholds` times it).
NARROW_TILES_MAX_ROWS = 32


def takes_packed(rows: int) -> bool:
    """Whether a product of `rows` input rows goes to the packed-panel GEMM on this build."""
    return rows > NARROW_TILES_MAX_ROWS and narrow_tiles()


def gemv_silu(x: torch.Tensor, gate_up: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`silu_and_mul(F.linear(x, gate_up, bias))` in one pass over gate_up [2I, K] (gate rows first)."""
    _check_f32(x=x, gate_up=gate_up, **({} if bias is None else {"bias": bias}))
    (b, k), n = x.shape, gate_up.shape[0]
    if gate_up.shape[1] != k or n % 2 or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)}: shapes do not match")
    out = torch.empty(b, n // 2, dtype=torch.float32)
    _lib().gemv_silu_f32(
        gate_up.data_ptr(), None if bias is None else bias.data_ptr(), x.data_ptr(), out.data_ptr(), b,
        n // 2, k, torch.get_num_threads(),
    )  # fmt: skip
    return out


def _check_int8_weight(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias, rows: int) -> None:
    _check_f32(x=x, scale=scale, **({} if bias is None else {"bias": bias}))
    if weight.dtype != torch.int8 or not weight.is_contiguous() or weight.device.type != "cpu":
        raise ValueError(f"weight: need a contiguous int8 CPU tensor, got {weight.dtype} {weight.device}")
    (_, k), n = x.shape, weight.shape[0]
    if weight.shape[1] != k or scale.shape != (n,) or n % rows or (bias is not None and bias.shape != (n,)):
        raise ValueError(
            f"x {tuple(x.shape)}, weight {tuple(weight.shape)}, scale {tuple(scale.shape)}: shapes do not match"
        )


def gemv_int8(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear(x, weight * scale[:, None], bias)` for float32 x [B, K] and int8 weight [N, K] with
    per-row float32 scales, reading the int8 bytes once (W8A16 decode)."""
    _check_int8_weight(x, weight, scale, bias, 1)
    (b, k), n = x.shape, weight.shape[0]
    y = torch.empty(b, n, dtype=torch.float32)
    if _lib().gemv_i8(
        weight.data_ptr(), scale.data_ptr(), None if bias is None else bias.data_ptr(), x.data_ptr(),
        y.data_ptr(), b, n, k, torch.get_num_threads(),
    ):  # fmt: skip
        raise MemoryError("gemv_int8: no memory for the rounded inputs")
    return y


def gemm_int8(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    row_sums: torch.Tensor,
    bias: torch.Tensor | None = None,
    input_bits: int = 8,
) -> torch.Tensor:
    """`scaled_linear_w8a8_torch` natively: float32 x [M, K] rounded per row to int8 (scale
    max|x| / 127), integer products with int8 weight [N, K] (`row_sums` [N] int32: each row's sum),
    then the row and input scales (W8A8, register tiles: batched steps and prefill chunks).
    `input_bits=16`: rows rounded to 16 bits (scale max|x| / 32767; W8A16 at half the speed)."""
    if input_bits not in (8, 16):
        raise ValueError(f"input_bits: 8 or 16, got {input_bits}")
    _check_int8_weight(x, weight, scale, bias, 1)
    if row_sums.dtype != torch.int32 or not row_sums.is_contiguous() or row_sums.shape != scale.shape:
        raise ValueError(
            f"row_sums: need contiguous int32 [{weight.shape[0]}], got {row_sums.dtype} {tuple(row_sums.shape)}"
        )
    (m, k), n = x.shape, weight.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if _lib().gemm_i8(
        weight.data_ptr(), scale.data_ptr(), row_sums.data_ptr(), None if bias is None else bias.data_ptr(),
        x.data_ptr(), y.data_ptr(), m, n, k, input_bits, torch.get_num_threads(),
    ):  # fmt: skip
        raise MemoryError("gemm_int8: no memory for the rounded inputs")
    return y


def gemm_int8_is_fast() -> bool:
    """Whether `gemm_int8` runs a vector path here: AVX-512 VNNI, or built without AVX-512, AVX-VNNI
    or AVX2 (else it sums in plain loops: correct, slow). `narrow_tiles()` tells the two apart."""
    return bool(_lib().gemm_i8_vnni())


def gemv_silu_int8(
    x: torch.Tensor, gate_up: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`gemv_silu` for int8 gate_up [2I, K] with per-row scales."""
    _check_int8_weight(x, gate_up, scale, bias, 2)
    (b, k), n = x.shape, gate_up.shape[0]
    out = torch.empty(b, n // 2, dtype=torch.float32)
    if _lib().gemv_silu_i8(
        gate_up.data_ptr(), scale.data_ptr(), None if bias is None else bias.data_ptr(), x.data_ptr(),
        out.data_ptr(), b, n // 2, k, torch.get_num_threads(),
    ):  # fmt: skip
        raise MemoryError("gemv_silu_int8: no memory for the rounded inputs")
    return out


def gemv_fp8(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear(x, weight.float() * scale[:, None], bias)` for float32 x [B, K] and
    float8_e4m3fn weight [N, K] with per-row float32 scales, widening the bytes in registers."""
    _check_f32(x=x, scale=scale, **({} if bias is None else {"bias": bias}))
    if weight.dtype != torch.float8_e4m3fn or not weight.is_contiguous() or weight.device.type != "cpu":
        raise ValueError(
            f"weight: need a contiguous float8_e4m3fn CPU tensor, got {weight.dtype} {weight.device}"
        )
    (b, k), n = x.shape, weight.shape[0]
    if weight.shape[1] != k or scale.shape != (n,) or (bias is not None and bias.shape != (n,)):
        raise ValueError(
            f"x {tuple(x.shape)}, weight {tuple(weight.shape)}, scale {tuple(scale.shape)}: shapes do not match"
        )
    y = torch.empty(b, n, dtype=torch.float32)
    _lib().gemv_fp8(
        weight.data_ptr(), scale.data_ptr(), None if bias is None else bias.data_ptr(), x.data_ptr(),
        y.data_ptr(), b, n, k, torch.get_num_threads(),
    )  # fmt: skip
    return y


def fp8_to_float32(weight: torch.Tensor) -> torch.Tensor:
    """`weight.float()` for a contiguous float8_e4m3fn CPU tensor, vectorised."""
    if weight.dtype != torch.float8_e4m3fn or not weight.is_contiguous() or weight.device.type != "cpu":
        raise ValueError(
            f"weight: need a contiguous float8_e4m3fn CPU tensor, got {weight.dtype} {weight.device}"
        )
    out = torch.empty(weight.shape, dtype=torch.float32)
    _lib().fp8_to_f32(weight.data_ptr(), out.data_ptr(), weight.numel(), torch.get_num_threads())
    return out


def rotary_write_kv(
    qkv: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
) -> None:
    """Rotate q and k in place inside the fused projection output qkv [T, (Hq + 2 Hkv) * D]
    (rotate-half form, angles from cos_sin_cache [max_pos, D]), then write k and v into the
    one-layer cache [blocks, 2, block_size, Hkv, D] at slot_mapping (int64; negative = skip).
    Positions and slots are not bounds-checked here: the caller checks them once per step
    (`check_step_bounds`), not once per layer."""
    rotary_write_kv_call(
        _lib().rotary_write_kv_f32, torch.float32, qkv, cos_sin_cache, positions, kv_cache, slot_mapping,
        num_q_heads, num_kv_heads,
    )  # fmt: skip


def rotary_write_kv_call(
    kernel,
    dtype: torch.dtype,
    qkv,
    cos_sin_cache,
    positions,
    kv_cache,
    slot_mapping,
    num_q_heads,
    num_kv_heads,
) -> None:
    """`rotary_write_kv` through the C `kernel` for qkv and cache of `dtype` (angles float32)."""
    check_cpu(dtype, qkv=qkv, kv_cache=kv_cache)
    check_cpu(torch.float32, cos_sin_cache=cos_sin_cache)
    head_dim = kv_cache.shape[-1]
    if qkv.shape[-1] != (num_q_heads + 2 * num_kv_heads) * head_dim or kv_cache.shape[3] != num_kv_heads:
        raise ValueError(f"qkv {tuple(qkv.shape)} does not match the heads of cache {tuple(kv_cache.shape)}")
    if positions.dtype != torch.int64 or slot_mapping.dtype != torch.int64:
        raise ValueError("positions and slot_mapping must be int64")
    positions, slot_mapping = positions.contiguous(), slot_mapping.contiguous()  # alive through the call
    kernel(
        qkv.data_ptr(), qkv.shape[-1], cos_sin_cache.data_ptr(), positions.data_ptr(), kv_cache.data_ptr(),
        slot_mapping.data_ptr(), qkv.shape[0], num_q_heads, num_kv_heads, head_dim, kv_cache.shape[2],
    )  # fmt: skip


def check_step_bounds(
    positions: torch.Tensor, slot_mapping: torch.Tensor, max_positions: int, num_slots: int
):
    """Every position has a rotary row and every slot lies in the cache (the C code trusts them)."""
    if positions.numel() and not 0 <= int(positions.min()) <= int(positions.max()) < max_positions:
        raise IndexError(f"positions: outside [0, {max_positions})")
    if slot_mapping.numel() and int(slot_mapping.max()) >= num_slots:
        raise IndexError(f"slot_mapping: a slot is beyond the cache's {num_slots} slots")


class PagedDecodeAttention:
    """Decode attention of one step (every layer): the block tables, lengths and the split of
    the work over threads are fixed per step, so they are prepared once here.

    `block_tables` [B, W] int32 and `seq_lens` [B] int32 as in `disagg.kernels.torch_ops`.
    """

    def __init__(
        self,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        num_q_heads: int,
        num_kv_heads: int,
        num_blocks: int | None = None,
    ):
        _lib()
        if num_q_heads % num_kv_heads:
            raise ValueError(
                f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        self.tables = block_tables.to(torch.int32).contiguous()
        self.lens = seq_lens.to(torch.int32).contiguous()
        lens = self.lens.tolist()
        if num_blocks is not None and not 0 <= int(self.tables.min()) <= int(self.tables.max()) < num_blocks:
            raise IndexError(f"block_tables: a block id is outside [0, {num_blocks})")
        self.batch = len(lens)
        self.num_q_heads, self.num_kv_heads = num_q_heads, num_kv_heads
        self.max_len = max(lens)
        work = sum(lens) * num_q_heads
        self.threads = min(torch.get_num_threads(), self.batch) if work >= _PARALLEL_MIN_WORK else 1
        group = num_q_heads // num_kv_heads
        self.scratch = torch.empty(self.threads * group * self.max_len, dtype=torch.float32)

    def __call__(self, q: torch.Tensor, kv_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """q [B, Hq, D] float32, kv_cache (one layer) [blocks, 2, block_size, Hkv, D] float32."""
        if q.dtype != torch.float32 or kv_cache.dtype != torch.float32:
            raise TypeError(f"native decode attention takes float32, got q {q.dtype}, cache {kv_cache.dtype}")
        if not kv_cache.is_contiguous():
            raise ValueError("kv_cache must be contiguous")
        b, hq, d = q.shape
        if b != self.batch or hq != self.num_q_heads or kv_cache.shape[3] != self.num_kv_heads:
            raise ValueError(
                f"q {tuple(q.shape)} / cache {tuple(kv_cache.shape)} do not match this step's plan"
            )
        if q.stride(2) != 1 or q.stride(1) != d:  # heads of a row must be contiguous; rows may be apart
            q = q.contiguous()
        out = torch.empty(b, hq, d, dtype=torch.float32)
        code = _lib().paged_decode_attention_f32(
            q.data_ptr(), q.stride(0), kv_cache.data_ptr(), self.tables.data_ptr(), self.tables.shape[1],
            self.lens.data_ptr(), out.data_ptr(), b, hq, self.num_kv_heads, d, kv_cache.shape[2], scale,
            self.scratch.data_ptr(), self.max_len, self.threads,
        )  # fmt: skip
        if code:
            raise ValueError(f"seq_lens: every length must be in [1, {self.max_len}]")
        return out
