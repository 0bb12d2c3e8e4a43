"""Matmuls with 8-bit weights: the weight type, each weight's matmul plan and the one `linear`
every caller uses.

A `QuantizedWeight` is W [N, K] stored as int8 or float8_e4m3fn values with one float32 scale per
output row (W ~= data * scale[:, None]); activations stay in the model's dtype. Because the
scale is constant along a row it factors out of every dot product: y = (x . data_r) * scale_r,
which is what every implementation below computes.

Which kernel multiplies by a weight is decided in two parts. What the weight alone decides (plain
or 8-bit, its scheme, dtype, device and layout) together with this CPU (native kernels, the width
of their tiles, VNNI, bf16 products) is resolved once into the weight's `MatmulPlan`: `resolve(w)`,
which the loader calls for every matmul weight. What depends on the input is left to each call:
`linear(x, w, bias)` runs the plan's first tier whose row range holds x's row count M and which
takes x and bias, else the plan's fallback. The tiers, in order (`plan_for`):

  plain float32: the native GEMM up to `GEMM_NATIVE_MAX_ROWS` rows (`GEMM_NATIVE_MAX_ROWS_AVX2`
    without AVX-512); beyond, torch's GEMM, or without AVX-512 the packed-panel GEMM.
  plain bf16: where AMX is usable, the native bf16 GEMV below `BF16_AMX_MIN_ROWS` rows, the AMX
    GEMM (the weight's rows read in place as tiles) up to `BF16_AMX_MAX_ROWS`, torch's bf16 GEMM
    beyond; elsewhere the native bf16 GEMV up to `BF16_GEMV_MAX_ROWS`, beyond, torch's bf16 GEMM,
    or on a CPU without bf16 products the native bf16 GEMM.
  int8 or fp8, float32 inputs, on a CPU with bf16 products (AVX-512 BF16): from
    `BF16_PRODUCT_MIN_ROWS` rows `scaled_linear_bf16` (inputs rounded to bf16, the weight widened
    exactly; AMX where granted, else torch's bf16 GEMM).
  int8, where AMX is usable: from `W8A8_MIN_ROWS` up to `INT8_AMX_MAX_ROWS` rows (16-bit inputs,
    unless W8A8 is asked) the AMX GEMM, the same integers and floats as the VNNI GEMM's W8A16 with
    the weight's rows read in place as tiles; other rows as below.
  int8: with AVX-512 VNNI the native VNNI GEMM from `W8A8_MIN_ROWS` up to `GEMM_INT8_MAX_ROWS` rows,
    its rows rounded to 16 bits or, if the caller asks (`w8a8=True`), to int8 with their own scale
    (W8A8; beyond that GEMM's rows, its torch twin `scaled_linear_w8a8_torch`); below, the native
    int8 GEMV (W8A16: it rounds the inputs to int16 per row, a relative 3e-5, below bfloat16's own
    rounding) up to `NATIVE_MAX_ROWS` (`GEMV_INT8_MAX_ROWS_NO_VNNI` without VNNI,
    `GEMV_INT8_MAX_ROWS_AVX2` on AVX2 tiles); on AVX2 tiles the packed-panel GEMM beyond; else the torch twin (`scaled_linear_torch`: widen the
    weight on the fly, matmul, scale). Built for AVX2 (no AVX-512), W8A8 when asked takes the same
    GEMM's AVX2 (or AVX-VNNI) integer path from `W8A8_MIN_ROWS` rows on, past the GEMV and the
    packed GEMM; its 16-bit rows (twice the instructions) are slower than both, so not taken.
  fp8: the native fp8 GEMV (e4m3 widened in registers) up to `FP8_NATIVE_MAX_ROWS`; beyond, the
    packed-panel GEMM on AVX2 tiles, else the weight widened once per call (natively) for torch's
    GEMM.
  8-bit on CUDA: the Triton scaled matmul (fp8 and int8); elsewhere the torch twin.

`python bench/small_gemm.py --thresholds [--quick]` times the two kernels on either side of every
row threshold below on the running CPU and prints where each crosses over.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from disagg.kernels import cpu_bf16, cpu_native, native_build

SCHEMES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
# Row thresholds of the plans; each one's crossover: `python bench/small_gemm.py --thresholds`.
NATIVE_MAX_ROWS = 256  # int8 GEMV, then the widening twin (VNNI CPUs, inputs no VNNI GEMM takes)
W8A8_MIN_ROWS = 5  # int8: the GEMV below, the VNNI GEMM (AVX2: its W8A8 rows) from here
BF16_PRODUCT_MIN_ROWS = 64  # 8-bit: from here `scaled_linear_bf16` (CPUs with bf16 products)
GEMM_INT8_MAX_ROWS = 1024  # int8: the VNNI GEMM up to here, then the twin (W8A8's when asked)
FP8_NATIVE_MAX_ROWS = 16  # fp8 GEMV, then the weight widened for torch's GEMM (packed GEMM on AVX2)
GEMM_NATIVE_MAX_ROWS = 96  # float32: the native GEMM up to here, then torch's GEMM (AVX-512)
GEMM_NATIVE_MAX_ROWS_AVX2 = cpu_native.NARROW_TILES_MAX_ROWS  # the same on AVX2: then the packed GEMM
GEMM_PACKED_MIN_ROWS = GEMM_NATIVE_MAX_ROWS_AVX2 + 1  # AVX2: float32, bf16-widened and int8 alike
GEMV_INT8_MAX_ROWS_NO_VNNI = 1024  # int8 GEMV without VNNI (AVX-512 tiles), then the twin
GEMV_INT8_MAX_ROWS_AVX2 = 64  # int8 GEMV on AVX2 tiles (W8A16), then the packed GEMM
BF16_GEMV_MAX_ROWS = 8  # bf16 GEMV, then torch's bf16 GEMM (the native bf16 GEMM without bf16 products)
BF16_AMX_MIN_ROWS = 2  # bf16 where AMX is usable: the GEMV below, the AMX GEMM from here
BF16_AMX_MAX_ROWS = 64  # ... up to here (the weights stream once per 32 rows), then torch's bf16 GEMM
INT8_AMX_MAX_ROWS = 128  # int8 where AMX is usable: the AMX GEMM from W8A8_MIN_ROWS up to here
ROWS_UNBOUNDED = 1 << 62


@dataclass(frozen=True)
class QuantizedWeight:
    data: torch.Tensor  # [N, K] int8 or float8_e4m3fn, contiguous
    scale: torch.Tensor  # [N] float32
    # int8: each row's sum [N] int32, computed once here (the W8A8 GEMM takes its inputs' +128
    # shift back with it); None for fp8
    row_sums: torch.Tensor | None = field(init=False, repr=False, compare=False)
    # which kernels take its products: set by `resolve` (None: resolved on each call)
    matmul_plan: MatmulPlan | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.data.dtype not in SCHEMES.values():
            raise TypeError(f"quantized weight data must be int8 or float8_e4m3fn, got {self.data.dtype}")
        if self.data.dim() != 2 or tuple(self.scale.shape) != (self.data.shape[0],):
            raise ValueError(
                f"quantized weight: data {tuple(self.data.shape)} needs one scale per row, "
                f"got scale {tuple(self.scale.shape)}"
            )
        if self.scale.dtype != torch.float32:
            raise TypeError(f"quantized weight scale must be float32, got {self.scale.dtype}")
        sums = self.data.sum(1, dtype=torch.int32) if self.data.dtype == torch.int8 else None
        object.__setattr__(self, "row_sums", sums)

    @property
    def scheme(self) -> str:
        return "int8" if self.data.dtype == torch.int8 else "fp8"

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * 4

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.data.to(torch.float32) * self.scale[:, None]).to(dtype)


def tensor_bytes(w: torch.Tensor | QuantizedWeight | None) -> int:
    """Bytes a (possibly quantized) weight occupies: what a matmul with it reads."""
    if w is None:
        return 0
    if isinstance(w, QuantizedWeight):
        return w.nbytes
    return w.numel() * w.element_size()


def scaled_linear_torch(
    x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The reference: x [..., K] @ (data [N, K] widened to x's dtype)^T * scale (+ bias). Widening is
    exact for int8 and e4m3 into float32, bfloat16 and float16 (their values fit all three)."""
    y = F.linear(x, w.data.to(x.dtype)) * w.scale.to(x.dtype)
    return y if bias is None else y + bias


def gemm_native_max_rows() -> int:
    """Rows up to which the native float32 GEMM beats torch's: by the width its tiles were built for."""
    if not native_build.available():
        return 0
    return GEMM_NATIVE_MAX_ROWS if cpu_native.gemm_vector_floats() >= 16 else GEMM_NATIVE_MAX_ROWS_AVX2


def scaled_linear_w8a8_torch(
    x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The W8A8 reference (`cpu_native.gemm_int8` computes the same): each row of x [M, K] rounded
    to int8 with its own scale sx = max|x_row| / 127 (1 for a zero row), products with the int8
    weight, then sx * scale (+ bias). Summed in float32 here (|sums| < 2^24 * 16: a relative 6e-8,
    against the kernel's exact integers)."""
    amax = x.abs().amax(-1, keepdim=True)
    sx = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(x * (1.0 / sx))
    y = F.linear(q, w.data.to(x.dtype)) * (sx * w.scale)
    return y if bias is None else y + bias


def scaled_linear_bf16(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A16 for many rows: x [M, K] rounded to bfloat16, the 8-bit weight widened exactly to bf16,
    float32 sums, times the float32 row scales (+ bias) in float32. Where AMX is usable
    (`native_build.amx_usable()`), one native call does it all
    (`cpu_native.gemm_8bit_amx`: the weight widened block by block into tiles, never to memory);
    elsewhere torch's bf16 GEMM (oneDNN) on the weight widened natively (`cpu_bf16.widen_8bit`), its
    bf16 product scaled natively (`cpu_bf16.scale_columns`), which also rounds the product to
    bf16."""
    b = None if bias is None else bias.contiguous()
    if native_build.amx_usable():
        return cpu_native.gemm_8bit_amx(x.contiguous(), w.data, w.scale, b)
    y = F.linear(x.to(torch.bfloat16), cpu_bf16.widen_8bit(w.data))
    return cpu_bf16.scale_columns(y, w.scale, b)


# ---- matmul plans ---------------------------------------------------------------------------
Kernel = Callable[..., torch.Tensor]  # (x, w, bias, w8a8) -> y


def _always(*_) -> bool:
    return True


@dataclass(frozen=True)
class Tier:
    """`kernel` takes products of `min_rows` to `max_rows` input rows that `takes(x, bias, w8a8)`
    accepts."""

    min_rows: int
    max_rows: int
    kernel: Kernel
    takes: Callable[[torch.Tensor, torch.Tensor | None, bool], bool] = _always


@dataclass(frozen=True)
class MatmulPlan:
    """How the products with one weight run on this machine (see the module text): `gate`, what all
    of the weight's tiers need of the input (`gate(x, w, bias)`), then the first of `tiers` whose
    rows hold x's and which takes it, else `fallback`. `native`: whether the native kernels were
    available when it was resolved (None: a weight off the CPU, which they never take)."""

    tiers: tuple[Tier, ...]
    fallback: Kernel
    gate: Callable[..., bool] = _always
    native: bool | None = None

    def kernel_for(self, x: torch.Tensor, w, bias: torch.Tensor | None = None, w8a8: bool = False) -> Kernel:
        if self.tiers and self.gate(x, w, bias):
            m = x.shape[0]
            for tier in self.tiers:
                if tier.min_rows <= m <= tier.max_rows and tier.takes(x, bias, w8a8):
                    return tier.kernel
        return self.fallback

    def __call__(
        self, x: torch.Tensor, w, bias: torch.Tensor | None = None, w8a8: bool = False
    ) -> torch.Tensor:
        return self.kernel_for(x, w, bias, w8a8)(x, w, bias, w8a8)


# The kernels of the tiers, as (x, w, bias, w8a8) -> y; modules' functions looked up per call.
def torch_gemm(x, w, bias, w8a8):
    return F.linear(x, w, bias)


def native_gemm(x, w, bias, w8a8):
    return cpu_native.gemm(x.contiguous(), w, bias)


def packed_gemm(x, w, bias, w8a8):
    return cpu_native.gemm_packed(x.contiguous(), w, bias)


def bf16_gemv(x, w, bias, w8a8):
    return cpu_bf16.gemv(x.contiguous(), w, bias)


def bf16_amx(x, w, bias, w8a8):
    return cpu_bf16.gemm_amx(x.contiguous(), w, bias)


def bf16_gemm(x, w, bias, w8a8):
    return cpu_bf16.gemm(x.contiguous(), w, bias)


def bf16_product(x, w, bias, w8a8):
    return scaled_linear_bf16(x, w, bias)


def int8_gemm(x, w, bias, w8a8):
    bits = 8 if w8a8 else 16
    return cpu_native.gemm_int8(x.contiguous(), w.data, w.scale, w.row_sums, bias, input_bits=bits)


def int8_amx(x, w, bias, w8a8):
    return cpu_native.gemm_int8_amx(x.contiguous(), w.data, w.scale, bias)


def w8a8_twin(x, w, bias, w8a8):
    return scaled_linear_w8a8_torch(x, w, bias)


def int8_gemv(x, w, bias, w8a8):
    return cpu_native.gemv_int8(x.contiguous(), w.data, w.scale, bias)


def packed_8bit_gemm(x, w, bias, w8a8):
    b = None if bias is None else bias.float().contiguous()
    return cpu_native.gemm_packed(x.contiguous(), w.data, b, w.scale)


def fp8_gemv(x, w, bias, w8a8):
    return cpu_native.gemv_fp8(x.contiguous(), w.data, w.scale, bias)


def fp8_widened(x, w, bias, w8a8):
    """The weight widened once per call, natively (torch's e4m3 conversion is scalar)."""
    y = F.linear(x, cpu_native.fp8_to_float32(w.data).to(x.dtype)) * w.scale.to(x.dtype)
    return y if bias is None else y + bias


def twin(x, w, bias, w8a8):
    return scaled_linear_torch(x, w, bias)


def triton_scaled_matmul(x, w, bias, w8a8):
    from disagg.kernels.triton_scaled_matmul import scaled_matmul

    return scaled_matmul(x, w.data, w.scale, bias)


# What the tiers need of the input besides its rows.
def _plain_rows(dtype: torch.dtype, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """A CPU product all in `dtype` with 2-D x that a native kernel takes (no autograd through it)."""
    return (
        x.device.type == "cpu"
        and x.dtype == dtype
        and x.dim() == 2
        and (bias is None or (bias.dtype == dtype and bias.is_contiguous()))
        and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
    )


def _float32_plain_rows(x, w, bias) -> bool:
    return _plain_rows(torch.float32, x, w, bias)


def _bf16_plain_rows(x, w, bias) -> bool:
    return _plain_rows(torch.bfloat16, x, w, bias)


def _float32_rows(x, w, bias) -> bool:
    return x.dtype == torch.float32 and x.dim() == 2


def _float32_bias(x, bias, w8a8) -> bool:
    return bias is None or bias.dtype == torch.float32


def _float32_bias_no_grad(x, bias, w8a8) -> bool:
    return _float32_bias(x, bias, w8a8) and not (torch.is_grad_enabled() and x.requires_grad)


def _contiguous_float32_bias(x, bias, w8a8) -> bool:
    return bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())


def _w8a8_asked(x, bias, w8a8) -> bool:
    return w8a8 and _contiguous_float32_bias(x, bias, w8a8)


def _16bit_inputs(x, bias, w8a8) -> bool:
    return not w8a8 and _contiguous_float32_bias(x, bias, w8a8)


def plan_for(w: torch.Tensor | QuantizedWeight) -> MatmulPlan:
    """The plan of products with `w` on this machine as it is now (see the module text)."""
    if isinstance(w, QuantizedWeight):
        return _quantized_plan(w)
    if w.device.type != "cpu":
        return MatmulPlan((), torch_gemm)
    native = native_build.available()
    if not native or not w.is_contiguous() or w.dtype not in (torch.float32, torch.bfloat16):
        return MatmulPlan((), torch_gemm, native=native)
    if w.dtype == torch.float32:
        limit = gemm_native_max_rows()
        tiers = [Tier(0, limit, native_gemm)]
        if cpu_native.narrow_tiles():
            tiers.append(Tier(limit + 1, ROWS_UNBOUNDED, packed_gemm))
        return MatmulPlan(tuple(tiers), torch_gemm, _float32_plain_rows, native)
    if native_build.amx_usable():
        tiers = [
            Tier(0, BF16_AMX_MIN_ROWS - 1, bf16_gemv),
            Tier(BF16_AMX_MIN_ROWS, BF16_AMX_MAX_ROWS, bf16_amx),
        ]
        return MatmulPlan(tuple(tiers), torch_gemm, _bf16_plain_rows, native)
    tiers = [Tier(0, BF16_GEMV_MAX_ROWS, bf16_gemv)]
    if not cpu_bf16.dot_native():  # torch's bf16 GEMM converts as it goes there
        tiers.append(Tier(BF16_GEMV_MAX_ROWS + 1, ROWS_UNBOUNDED, bf16_gemm))
    return MatmulPlan(tuple(tiers), torch_gemm, _bf16_plain_rows, native)


def _quantized_plan(w: QuantizedWeight) -> MatmulPlan:
    if w.device.type == "cuda":
        return MatmulPlan((), triton_scaled_matmul)
    if w.device.type != "cpu":
        return MatmulPlan((), twin)
    if not native_build.available():
        return MatmulPlan((), twin, native=False)
    tiers = []
    if w.scheme == "int8" and native_build.amx_usable():
        tiers.append(Tier(W8A8_MIN_ROWS, INT8_AMX_MAX_ROWS, int8_amx, _16bit_inputs))
    if cpu_bf16.dot_native():
        tiers.append(Tier(BF16_PRODUCT_MIN_ROWS, ROWS_UNBOUNDED, bf16_product, _float32_bias_no_grad))
    narrow = cpu_native.narrow_tiles()
    if w.scheme == "fp8":
        tiers.append(Tier(0, FP8_NATIVE_MAX_ROWS, fp8_gemv, _float32_bias))
        if narrow:
            tiers.append(Tier(0, ROWS_UNBOUNDED, packed_8bit_gemm))
        return MatmulPlan(tuple(tiers), fp8_widened, _float32_rows, True)
    # the integer GEMM's fast paths: AVX-512 VNNI, or (built without AVX-512) AVX2 / AVX-VNNI
    vnni = cpu_native.gemm_int8_is_fast() and not narrow
    if vnni:
        tiers.append(Tier(W8A8_MIN_ROWS, GEMM_INT8_MAX_ROWS, int8_gemm, _contiguous_float32_bias))
        tiers.append(Tier(GEMM_INT8_MAX_ROWS + 1, ROWS_UNBOUNDED, w8a8_twin, _w8a8_asked))
    elif narrow and cpu_native.gemm_int8_is_fast():  # W8A8 only: its 16-bit rows lose to the GEMV
        tiers.append(Tier(W8A8_MIN_ROWS, ROWS_UNBOUNDED, int8_gemm, _w8a8_asked))
    gemv_rows = NATIVE_MAX_ROWS if vnni else GEMV_INT8_MAX_ROWS_AVX2 if narrow else GEMV_INT8_MAX_ROWS_NO_VNNI
    tiers.append(Tier(0, gemv_rows, int8_gemv, _float32_bias))
    if not vnni and narrow:
        tiers.append(Tier(0, ROWS_UNBOUNDED, packed_8bit_gemm))
    return MatmulPlan(tuple(tiers), twin, _float32_rows, True)


def resolve(w: torch.Tensor | QuantizedWeight) -> MatmulPlan:
    """Resolve `w`'s plan now and keep it with the weight, for every later `linear` with it."""
    plan = plan_for(w)
    if isinstance(w, QuantizedWeight):
        object.__setattr__(w, "matmul_plan", plan)  # frozen dataclass
    else:
        w.matmul_plan = plan
    return plan


def linear(
    x: torch.Tensor,
    w: torch.Tensor | QuantizedWeight,
    bias: torch.Tensor | None = None,
    w8a8: bool = False,
) -> torch.Tensor:
    """`F.linear(x, w, bias)` for a plain or a quantized weight, through the weight's plan (see the
    module text). `w8a8=True` rounds the inputs of int8 products of `W8A8_MIN_ROWS` to
    `BF16_PRODUCT_MIN_ROWS` rows (all of them where the CPU has no bf16 products) to int8 per row;
    by default they keep 16 bits (the native GEMM rounds rows to 16 bits, at about two thirds of its
    W8A8 speed): an input row's int8 grid, set by its largest value, rounds the typical values
    coarsely, which costs SmolLM2-135M +3.8% perplexity when every matmul does it.

    A weight `resolve` has not seen, or seen before `DISAGG_CPU_NATIVE` changed, gets a plan for
    this call only: one built by hand follows the CPU's probes as they answer at each call."""
    plan = getattr(w, "matmul_plan", None)
    if plan is None or (plan.native is not None and plan.native != native_build.available()):
        plan = plan_for(w)
    return plan(x, w, bias, w8a8)
