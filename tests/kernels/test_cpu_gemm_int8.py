"""The native W8A8 GEMM (`cpu_native.gemm_int8`) against its torch twin, and `linear` choosing it."""

from __future__ import annotations

import ctypes
import platform
import shutil
from pathlib import Path

import needs
import pytest
import torch
import torch.nn.functional as F
from triton_cases import case_id

from disagg.kernels import cpu_bf16, cpu_isa, cpu_native, native_build, quantized
from disagg.kernels.quantized import QuantizedWeight, scaled_linear_torch, scaled_linear_w8a8_torch

pytestmark = needs.native


def _operands(m: int, n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    w = QuantizedWeight(
        torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8),
        torch.rand(n, generator=gen) / 127 * k**-0.5,  # outputs of order 1, as in a model
    )
    bias = torch.randn(n, generator=gen)
    return x, w, bias


def _native(x, w: QuantizedWeight, bias=None, input_bits=8):
    return cpu_native.gemm_int8(x, w.data, w.scale, w.row_sums, bias, input_bits=input_bits)


# The twin sums in float32 (a relative 6e-8 of sums of up to K * 127 * 127), the kernel in int32.
TOLERANCE = dict(atol=1e-5, rtol=1e-5)


# K: below one 64-byte step, one step and one byte past, a model's width plus a ragged tail;
# N: a single row, fewer than a tile (4), ragged past a thread's chunk (64), several chunks.
@pytest.mark.parametrize("k", [5, 64, 65, 781], ids=case_id)
@pytest.mark.parametrize("n", [1, 3, 67, 130], ids=case_id)
def test_matches_the_w8a8_twin_on_ragged_shapes(n, k):
    for m in (1, 5, 17, 33, 257):  # tiles of 6 inputs and their remainders, two blocks of inputs
        x, w, bias = _operands(m, n, k, seed=m * 1000 + n * 10 + k)
        torch.testing.assert_close(_native(x, w), scaled_linear_w8a8_torch(x, w), **TOLERANCE)
        torch.testing.assert_close(_native(x, w, bias), scaled_linear_w8a8_torch(x, w, bias), **TOLERANCE)


def test_error_against_float_is_half_an_input_step_per_weight():
    """Each input is off by at most half its row's step (max|x_row| / 127): the output by at most
    that times the row's sum of |weights| (a bound, not a statistical estimate)."""
    x, w, bias = _operands(40, 96, 300, seed=4)
    x[3] = 0.0  # a zero row: scale 1, output exactly the bias
    x[7] *= 1e4  # rows of very different magnitudes keep their own scales
    want = F.linear(x, w.dequantize(), bias)
    got = _native(x, w, bias)
    bound = x.abs().amax(1, keepdim=True) / 127 / 2 * w.dequantize().abs().sum(1)
    assert ((got - want).abs() <= bound * 1.0001 + 1e-5).all()
    assert torch.equal(got[3], bias)


@pytest.mark.parametrize("k", [5, 65, 781], ids=case_id)
def test_16_bit_inputs_are_off_by_half_their_step(k):
    """input_bits=16: rows rounded to 16 bits (two byte planes): the same bound with the step
    max|x_row| / 32767, on rows of very different magnitudes, with a bias."""
    for m in (5, 17, 33):
        x, w, bias = _operands(m, 67, k, seed=m + k)
        x *= torch.logspace(-3, 3, m)[:, None]
        want = F.linear(x, w.dequantize(), bias)
        bound = x.abs().amax(1, keepdim=True) / 32767 / 2 * w.dequantize().abs().sum(1)
        got = _native(x, w, bias, input_bits=16)
        assert ((got - want).abs() <= bound * 1.0001 + 1e-5 * want.abs() + 1e-6).all()


def test_integer_extremes_are_exact():
    """Inputs at +-max (shifted to 255 and 1) against weights of +-127 over K = 4096: the shift is
    taken back exactly (127 * 127 * 4096 ~ 6.6e7, past float32's exact integers but not int32's)."""
    k = 4096
    x = torch.ones(4, k)
    x[1] = -1.0
    x[2, ::2] = -1.0
    x[3] = 0.5  # its own scale: rounded to 127 steps of 0.5 / 127
    data = torch.full((3, k), 127, dtype=torch.int8)
    data[1] = -127
    data[2, 1::2] = -127
    w = QuantizedWeight(data, torch.ones(3))
    got = _native(x, w)
    torch.testing.assert_close(_native(x, w, input_bits=16), got, atol=0, rtol=1e-6)
    full = 127.0 * k  # x . w with x rounded to 127 * (1 / 127) exactly
    want = torch.tensor(
        [[full, -full, 0.0], [-full, full, 0.0], [0.0, 0.0, -full], [full / 2, -full / 2, 0.0]]
    )
    torch.testing.assert_close(got, want, atol=0, rtol=1e-6)


def test_split_over_threads_equals_one_thread(monkeypatch):
    x, w, bias = _operands(29, 300, 96, seed=1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    one = _native(x, w, bias)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    assert torch.equal(_native(x, w, bias), one)


def test_bad_inputs_are_refused():
    x, w, bias = _operands(4, 8, 16, seed=2)
    with pytest.raises(ValueError, match="shapes do not match"):
        cpu_native.gemm_int8(x[:, :15].contiguous(), w.data, w.scale, w.row_sums)
    with pytest.raises(ValueError, match="shapes do not match"):
        cpu_native.gemm_int8(x, w.data, w.scale, w.row_sums, bias[:7])
    with pytest.raises(ValueError, match="weight"):
        cpu_native.gemm_int8(x, w.data.float(), w.scale, w.row_sums)
    with pytest.raises(ValueError, match="row_sums"):
        cpu_native.gemm_int8(x, w.data, w.scale, w.row_sums.long())
    with pytest.raises(ValueError, match="input_bits"):
        _native(x, w, input_bits=4)


@needs.amx
@pytest.mark.parametrize("k", [5, 64, 65, 781], ids=case_id)
@pytest.mark.parametrize("n", [1, 3, 33, 130], ids=case_id)
def test_the_amx_gemm_gives_the_vnni_gemms_w8a16_numbers(n, k):
    """The same rounded inputs and integer sums, so the same floats: equal, not close. Rows of W
    past a 16- or 32-row block and K past a 64-byte step take the zero-padded copies."""
    for m in (1, 5, 16, 17, 40):
        x, w, bias = _operands(m, n, k, seed=m * 1000 + n * 10 + k)
        for b in (None, bias):
            want = _native(x, w, b, input_bits=16)
            assert torch.equal(cpu_native.gemm_int8_amx(x, w.data, w.scale, b), want), (m, b is None)


@needs.amx
def test_linear_takes_the_amx_gemm_between_its_row_limits():
    x, w, bias = _operands(quantized.INT8_AMX_MAX_ROWS + 1, 40, 48, seed=6)
    low, high = quantized.W8A8_MIN_ROWS, quantized.INT8_AMX_MAX_ROWS
    for rows in (low, high):
        got = quantized.linear(x[:rows], w, bias)
        assert torch.equal(got, cpu_native.gemm_int8_amx(x[:rows], w.data, w.scale, bias))
    if cpu_native.gemm_int8_is_fast():  # W8A8 when asked: the VNNI GEMM's 8-bit rows
        assert torch.equal(quantized.linear(x[:low], w, bias, w8a8=True), _native(x[:low], w, bias))
    beyond = quantized.linear(x, w, bias)
    assert not torch.equal(beyond, cpu_native.gemm_int8_amx(x, w.data, w.scale, bias))
    if cpu_bf16.dot_native():  # bf16 products beyond
        assert torch.equal(beyond, quantized.scaled_linear_bf16(x, w, bias))


def test_linear_takes_the_int8_gemm_from_its_row_threshold(monkeypatch):
    monkeypatch.setattr(native_build, "amx_usable", lambda: False)  # where AMX is, INT8_AMX_MAX_ROWS applies
    x, w, bias = _operands(quantized.GEMV_INT8_MAX_ROWS_NO_VNNI + 1, 40, 48, seed=3)
    low, high = quantized.W8A8_MIN_ROWS, quantized.GEMM_INT8_MAX_ROWS
    # below the threshold: the W8A16 GEMV
    assert torch.equal(
        quantized.linear(x[: low - 1], w, bias), cpu_native.gemv_int8(x[: low - 1], w.data, w.scale, bias)
    )
    # from BF16_PRODUCT_MIN_ROWS, where the CPU multiplies bf16: the bf16 GEMM (16-bit inputs)
    bf16_rows = quantized.BF16_PRODUCT_MIN_ROWS
    if cpu_bf16.dot_native():
        for rows in (bf16_rows, high + 1):
            got = quantized.linear(x[:rows], w, bias)
            assert torch.equal(got, quantized.scaled_linear_bf16(x[:rows], w, bias))
    monkeypatch.setattr(cpu_bf16, "dot_native", lambda: False)
    if cpu_native.gemm_int8_is_fast() and cpu_native.narrow_tiles():
        # the AVX2 build: the integer GEMM for W8A8 from its threshold on, at any rows; 16-bit
        # rows keep the GEMV (then the packed GEMM, below)
        for rows in (low, high + 1):
            assert torch.equal(quantized.linear(x[:rows], w, bias, w8a8=True), _native(x[:rows], w, bias))
        got = quantized.linear(x[:low], w, bias)
        assert torch.equal(got, cpu_native.gemv_int8(x[:low], w.data, w.scale, bias))
        assert torch.equal(
            quantized.linear(x[: low - 1], w, bias, w8a8=True),
            cpu_native.gemv_int8(x[: low - 1], w.data, w.scale, bias),
        )
    elif cpu_native.gemm_int8_is_fast():
        for rows in (low, bf16_rows, high):
            # 16-bit rows unless W8A8 is asked for
            assert torch.equal(quantized.linear(x[:rows], w, bias), _native(x[:rows], w, bias, input_bits=16))
            assert torch.equal(quantized.linear(x[:rows], w, bias, w8a8=True), _native(x[:rows], w, bias))
        # beyond the native GEMM's rows: the twin, W8A8 when asked
        assert torch.equal(
            quantized.linear(x[: high + 1], w, bias, w8a8=True),
            scaled_linear_w8a8_torch(x[: high + 1], w, bias),
        )
    # without VNNI no W8A8: the GEMV up to its row limit
    monkeypatch.setattr(cpu_native, "gemm_int8_is_fast", lambda: False)
    # without a fast integer GEMM no W8A8: the GEMV up to its row limit (fewer rows on AVX2 tiles,
    # where the packed-panel GEMM is faster beyond), then the packed GEMM, or the widening twin
    for floats, limit in ((8, quantized.GEMV_INT8_MAX_ROWS_AVX2), (16, quantized.GEMV_INT8_MAX_ROWS_NO_VNNI)):
        monkeypatch.setattr(cpu_native, "gemm_vector_floats", lambda floats=floats: floats)
        for rows in (low, limit):
            for w8a8 in (True, False):
                got = quantized.linear(x[:rows], w, bias, w8a8=w8a8)
                assert torch.equal(got, cpu_native.gemv_int8(x[:rows], w.data, w.scale, bias))
        b, beyond = (None if floats == 16 else bias), x[: limit + 1]
        want = (
            cpu_native.gemm_packed(beyond, w.data, b, w.scale)
            if floats == 8
            else scaled_linear_torch(beyond, w, b)
        )
        assert torch.equal(quantized.linear(beyond, w, b), want)


# the generic target of the compiler (no -march=native), and on x86 no VNNI whatever it defaults to
NO_VNNI = ["-mno-avx512vnni"] if platform.machine() == "x86_64" else []


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler (cc)")
def test_the_loops_without_vnni_give_the_same_numbers(tmp_path):
    """The plain-loop build (a CPU without AVX-512 VNNI) sums the same integers: equal outputs."""
    lib = _build(tmp_path, "gemm_int8_plain", NO_VNNI)
    assert lib.gemm_i8_vnni() == 0
    for bits in (8, 16):
        for m, n, k in ((5, 3, 5), (17, 67, 65), (33, 9, 781)):
            x, w, bias = _operands(m, n, k, seed=m + n + k)
            y = torch.empty(m, n)
            p, i64 = ctypes.c_void_p, ctypes.c_int64
            code = lib.gemm_i8(
                p(w.data.data_ptr()), p(w.scale.data_ptr()), p(w.row_sums.data_ptr()), p(bias.data_ptr()),
                p(x.data_ptr()), p(y.data_ptr()), i64(m), i64(n), i64(k), i64(bits), i64(1),
            )  # fmt: skip
            assert code == 0
            torch.testing.assert_close(y, _native(x, w, bias, input_bits=bits), atol=1e-6, rtol=1e-6)


def _build(tmp_path: Path, name: str, flags: list[str]) -> ctypes.CDLL:
    """cpu_gemm_int8.c alone, compiled and linked as the kernels are, with `flags` on top of their base flags."""
    source = native_build.SOURCE_DIR / "cpu_gemm_int8.c"
    lib_path = tmp_path / f"{name}.so"
    native_build._compile("cc", [*native_build._BASE_FLAGS, *flags], [source], str(lib_path), tmp_path)
    return ctypes.CDLL(str(lib_path))


def _call(lib: ctypes.CDLL, x, w: QuantizedWeight, bias, bits: int, threads: int = 1) -> torch.Tensor:
    (m, k), n = x.shape, w.data.shape[0]
    y = torch.full((m, n), float("nan"))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    code = lib.gemm_i8(
        p(w.data.data_ptr()), p(w.scale.data_ptr()), p(w.row_sums.data_ptr()),
        p(None if bias is None else bias.data_ptr()), p(x.data_ptr()), p(y.data_ptr()),
        i64(m), i64(n), i64(k), i64(bits), i64(threads),
    )  # fmt: skip
    assert code == 0
    return y


X86 = platform.machine() == "x86_64"
# the AVX2 builds a CPU without AVX-512 gets: VPMADDUBSW with the sign trick, and AVX-VNNI's VPDPBUSD
AVX2_BUILDS = {
    "avx2": (["-march=x86-64-v3"], cpu_isa.LEVELS["x86-64-v3"]),
    "avxvnni": (["-march=x86-64-v3", "-mavxvnni"], cpu_isa.LEVELS["x86-64-v3"] | {"avxvnni"}),
}


@pytest.fixture(scope="module")
def int8_builds(tmp_path_factory):
    """The plain-loop build (the integer reference) and each AVX2 build this CPU runs."""
    if shutil.which("cc") is None or not X86:
        pytest.skip("needs a C compiler (cc) on x86-64")
    tmp = tmp_path_factory.mktemp("gemm_int8")
    plain = _build(tmp, "plain", ["-mno-avx2", *NO_VNNI])
    assert plain.gemm_i8_vnni() == 0
    builds = {}
    for name, (cflags, needed) in AVX2_BUILDS.items():
        if needed <= native_build.cpu_features():
            builds[name] = _build(tmp, name, cflags)
            assert builds[name].gemm_i8_vnni() == 1  # reported fast
    if not builds:
        pytest.skip("needs a CPU with AVX2")
    return plain, builds


# K: within one 32-byte step, one step and one byte either side, ragged past two, a model's width
# plus a tail; N: a single row, fewer than a tile (2 or 4), ragged past a thread's chunk (64);
# M: tiles of 2 and 6 inputs and their remainders, past a block of 128 inputs.
@pytest.mark.parametrize("k", [5, 31, 32, 33, 95, 781], ids=case_id)
@pytest.mark.parametrize("n", [1, 3, 7, 67], ids=case_id)
def test_the_avx2_paths_sum_the_plain_loops_integers(int8_builds, n, k):
    """Equal floats, not close: the same integers, scaled in the same order, with and without bias,
    for 8-bit inputs and for 16-bit ones as two byte planes."""
    plain, builds = int8_builds
    for m in (1, 2, 5, 13, 131):
        x, w, bias = _operands(m, n, k, seed=m * 1000 + n * 10 + k)
        x[0, : min(k, 3)] = torch.tensor([-1.0, 1.0, -0.999])[: min(k, 3)] * x[0].abs().amax()  # +-max inputs
        for bits in (8, 16):
            for b in (None, bias):
                want = _call(plain, x, w, b, bits)
                for name, lib in builds.items():
                    assert torch.equal(_call(lib, x, w, b, bits), want), (name, m, bits, b is None)


def test_the_avx2_paths_at_the_integer_extremes(int8_builds):
    """Weights of +-127 against inputs at their row's +-max over K = 4096, and 16-bit inputs whose
    high byte is -128 or whose low byte is 0 (stored as -128): every 16-bit pair sum of VPMADDUBSW
    at its largest (2 x 128 x 127), none saturating."""
    plain, builds = int8_builds
    k = 4096
    x = torch.ones(6, k)
    x[1] = -1.0
    x[2, ::2] = -1.0
    x[3, :] = -32767.0 / 32767  # q = -32767: high byte -128
    x[3, 1::2] = -32512.0 / 32767  # q = -32512 = 256 x -127: low byte 0
    x[4] = 256.0 / 32767  # q = 256 in 16 bits: low bytes 0 under a scale of max/32767 = 1/32767
    x[4, 0] = 1.0
    x[5] = torch.linspace(-1, 1, k)
    data = torch.full((4, k), 127, dtype=torch.int8)
    data[1] = -127
    data[2, 1::2] = -127
    data[3] = torch.arange(k) % 255 - 127
    w = QuantizedWeight(data, torch.ones(4))
    for bits in (8, 16):
        want = _call(plain, x, w, None, bits)
        for name, lib in builds.items():
            assert torch.equal(_call(lib, x, w, None, bits), want), (name, bits)
    full = 127.0 * k  # rows 0-2 against weights 0-2, exact in int32 and in float32's scaling
    assert torch.equal(_call(plain, x, w, None, 8)[:3, :3], torch.tensor(
        [[full, -full, 0.0], [-full, full, 0.0], [0.0, 0.0, -full]]
    ))  # fmt: skip


def test_the_avx2_paths_take_weights_of_minus_128(int8_builds):
    """-128 (which the quantizer never writes, and VPSIGNB cannot negate) in one thread's chunk of
    64 rows: that chunk summed by the plain loops, the others by the vector path, all exact."""
    plain, builds = int8_builds
    x, w, bias = _operands(9, 200, 77, seed=5)
    data = w.data.clone()
    data[70, :40] = -128  # the second chunk only
    data[199, -1] = -128  # the last row's last byte: the tail step
    w = QuantizedWeight(data, w.scale)
    want = F.linear(torch.round(x * (127 / x.abs().amax(1, keepdim=True))), data.float())  # exact integers
    for bits in (8, 16):
        ref = _call(plain, x, w, bias, bits)
        for name, lib in builds.items():
            assert torch.equal(_call(lib, x, w, bias, bits), ref), (name, bits)
    sx = x.abs().amax(1, keepdim=True) / 127
    torch.testing.assert_close(_call(plain, x, w, None, 8), want * (sx * w.scale), atol=1e-5, rtol=1e-5)


def test_the_avx2_paths_split_over_threads_as_one_thread(int8_builds):
    _, builds = int8_builds
    x, w, bias = _operands(29, 300, 96, seed=1)
    for name, lib in builds.items():
        for bits in (8, 16):
            assert torch.equal(_call(lib, x, w, bias, bits, threads=3), _call(lib, x, w, bias, bits)), (
                name,
                bits,
            )
