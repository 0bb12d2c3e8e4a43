"""The native W8A8 GEMM (`cpu_native.gemm_int8`) against its torch twin, and `linear` choosing it."""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from triton_cases import case_id

from disagg.kernels import cpu_bf16, cpu_native, quantized
from disagg.kernels.quantized import QuantizedWeight, scaled_linear_torch, scaled_linear_w8a8_torch

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="needs a C compiler (cc)")


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


needs_amx = pytest.mark.skipif(not cpu_native.amx_usable(), reason="needs AMX (granted and probed)")


@needs_amx
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


@needs_amx
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
    monkeypatch.setattr(cpu_native, "amx_usable", lambda: False)  # where AMX is, INT8_AMX_MAX_ROWS applies
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
    if cpu_native.gemm_int8_is_fast():
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
    limit = quantized.GEMV_INT8_MAX_ROWS_NO_VNNI
    for rows in (low, limit):
        for w8a8 in (True, False):
            got = quantized.linear(x[:rows], w, bias, w8a8=w8a8)
            assert torch.equal(got, cpu_native.gemv_int8(x[:rows], w.data, w.scale, bias))
    # beyond: the packed-panel GEMM where the tiles are AVX2's, else the widening twin
    for floats in (8, 16):
        monkeypatch.setattr(cpu_native, "gemm_vector_floats", lambda floats=floats: floats)
        b = None if floats == 16 else bias
        want = cpu_native.gemm_packed(x, w.data, b, w.scale) if floats == 8 else scaled_linear_torch(x, w, b)
        assert torch.equal(quantized.linear(x, w, b), want)


# the generic target of the compiler (no -march=native), and on x86 no VNNI whatever it defaults to
NO_VNNI = ["-mno-avx512vnni"] if platform.machine() == "x86_64" else []


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler (cc)")
def test_the_loops_without_vnni_give_the_same_numbers(tmp_path):
    """The plain-loop build (a CPU without AVX-512 VNNI) sums the same integers: equal outputs."""
    source = Path(cpu_native.__file__).with_name("cpu_gemm_int8.c")
    lib_path = tmp_path / "gemm_int8_plain.so"
    subprocess.run(
        ["cc", *cpu_native._BASE_FLAGS, *NO_VNNI, "-o", str(lib_path), str(source), "-lm"],
        check=True,
        capture_output=True,
    )
    lib = ctypes.CDLL(str(lib_path))
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
