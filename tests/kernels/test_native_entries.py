"""Every function the native kernels export, called on the running CPU in a forked child of its
own: each must return or raise a Python exception, never die of a signal (an illegal instruction
where the CPU lacks what a code path was built for). Under `make test-isa` the running CPU is an
emulated AVX2 one.

Each exported symbol is either called here (`ENTRIES`: through its Python wrapper, or directly
where it is a piece another kernel calls) or named in `CALLED_FROM` with the entry that runs it,
so a new export without a call here fails `test_every_export_is_called`.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess

import needs
import pytest
import torch

from disagg.kernels import cpu_bf16, cpu_kv_quant, cpu_native, native_build
from disagg.kernels.kv_quant import KVQuantFormat
from disagg.worker.model.loader import load_model

pytestmark = needs.native

GEN = torch.Generator().manual_seed(0)


def _f32(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN)


def _bf16(*shape: int) -> torch.Tensor:
    return _f32(*shape).bfloat16()


def _int8(*shape: int) -> torch.Tensor:
    return torch.randint(-127, 128, shape, generator=GEN, dtype=torch.int8)


def _rows(n: int) -> torch.Tensor:
    return _f32(n).abs() + 0.01


def _paged(dtype: torch.dtype, block: int = 4, heads: int = 2, d: int = 64):
    """A one-layer cache [blocks, 2, block, Hkv, D], two sequences' tables and lengths."""
    cache = _f32(8, 2, block, heads, d).to(dtype)
    tables = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    lens = torch.tensor([9, 5], dtype=torch.int32)
    return cache, tables, lens


def _rotary_inputs(dtype: torch.dtype, hq: int = 4, hkv: int = 2, d: int = 64):
    qkv = _f32(3, (hq + 2 * hkv) * d).to(dtype)
    cos_sin = _f32(16, d)
    positions = torch.tensor([0, 5, 9])
    slots = torch.tensor([0, 7, -1])
    return qkv, cos_sin, positions, slots


def _attention_f32():
    cache, tables, lens = _paged(torch.float32)
    return cpu_native.PagedDecodeAttention(tables, lens, 4, 2, num_blocks=8)(_f32(2, 4, 64), cache, 0.125)


def _attention_bf16():
    cache, tables, lens = _paged(torch.bfloat16)
    return cpu_bf16.PagedDecodeAttention(tables, lens, 4, 2, num_blocks=8)(_bf16(2, 4, 64), cache, 0.125)


def _kv_format() -> KVQuantFormat:
    return KVQuantFormat("int8", 4, 2, 64)


def _attention_q8():
    fmt = _kv_format()
    cache = torch.randint(0, 256, (8, fmt.region_bytes), generator=GEN, dtype=torch.uint8)
    _, tables, lens = _paged(torch.float32)
    attention = cpu_kv_quant.QuantizedPagedDecodeAttention(fmt, tables, lens, 4, 2, num_blocks=8)
    return attention(_f32(2, 4, 64), cache, 0.125)


def _rotary(dtype: torch.dtype):
    qkv, cos_sin, positions, slots = _rotary_inputs(dtype)
    cache, _, _ = _paged(dtype)
    write = cpu_native.rotary_write_kv if dtype == torch.float32 else cpu_bf16.rotary_write_kv
    write(qkv, cos_sin, positions, cache, slots, 4, 2)
    return cache


def _rotary_q8():
    fmt = _kv_format()
    qkv, cos_sin, positions, slots = _rotary_inputs(torch.float32)
    cache = torch.zeros(8, fmt.region_bytes, dtype=torch.uint8)
    cpu_kv_quant.rotary_write_kv(qkv, cos_sin, positions, cache, slots, 4, 2, fmt)
    return cache


def _int8_gemm(bits: int):
    w = _int8(40, 96)
    return cpu_native.gemm_int8(_f32(20, 96), w, _rows(40), w.sum(1, dtype=torch.int32), input_bits=bits)


def _amx_pieces(int8: bool):
    """cpu_amx.c's GEMM pieces as a whole-step decode calls them, on one thread: begin (-2 where
    AMX is not usable, and then the pieces do nothing), pack, rows, end."""
    lib = native_build.library()
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.amx_tiles_begin.restype = i64
    lib.amx_scratch_bytes.argtypes, lib.amx_scratch_bytes.restype = [i64, i64, i64], i64
    m, n, k = 4, 32, 64
    scratch = torch.zeros(int(lib.amx_scratch_bytes(int(int8), m, k)) + 64, dtype=torch.uint8)
    at = scratch.data_ptr() + (-scratch.data_ptr()) % 64
    began = int(lib.amx_tiles_begin())
    if int8:
        x, w, scale, y = _f32(m, k), _int8(n, k), _rows(n), torch.zeros(m, n)
        lib.amx_pack_i8.argtypes = [p, i64, i64, p, i64, i64]
        lib.amx_rows_i8.argtypes = [p, p, p, i64, i64, i64, i64, i64, p, i64, p, i64, i64]
        lib.amx_pack_i8(x.data_ptr(), m, k, at, m, k)
        lib.amx_rows_i8(w.data_ptr(), scale.data_ptr(), None, n, k, m, 0, n, y.data_ptr(), n, at, m, k)
    else:
        x, w, y = _bf16(m, k), _bf16(n, k), torch.zeros(m, n, dtype=torch.bfloat16)
        lib.amx_pack_bf16.argtypes = [p, i64, i64, p]
        lib.amx_rows_bf16.argtypes = [p, p, i64, i64, i64, i64, i64, p, p, i64, p, i64, i64]
        lib.amx_pack_bf16(x.data_ptr(), m, k, at)
        lib.amx_rows_bf16(w.data_ptr(), None, n, k, m, 0, n, y.data_ptr(), None, n, at, m, k)
    lib.amx_tiles_end()
    return began, y


def _decode_step(model_dir, dtype: str, quantization: str = "auto", kv_cache_dtype: str = "auto"):
    """A tiny model's prefill and one decode step through the whole-step kernel."""
    from worker.conftest import PagedSequences

    model, _ = load_model(model_dir, dtype=dtype, quantization_setting=quantization)
    if kv_cache_dtype != "auto":
        model.use_kv_cache_dtype(kv_cache_dtype)
    assert model._whole_step_native
    cache = model.allocate_kv_cache(num_blocks=16, block_size=4)
    seqs = PagedSequences(4)
    logits = model.forward(seqs.prefill([(0, [11, 12, 13]), (1, [14, 15])]), cache)
    return model.forward(seqs.decode(list(enumerate(logits.argmax(-1).tolist()))), cache)


def _entries(model_dir) -> dict[str, tuple[tuple[str, ...], object]]:
    """entry -> (the C symbols it calls, a call of it on small random inputs)."""
    x, w, b = _f32(3, 64), _f32(40, 64), _f32(40)
    xb, wb, bb = _bf16(3, 64), _bf16(40, 64), _bf16(40)
    xs, wi, scale = _f32(20, 64), _int8(40, 64), _rows(40)
    fp8 = _f32(40, 64).to(torch.float8_e4m3fn)
    return {
        "add_rms_norm": (("add_rms_norm_f32",), lambda: cpu_native.add_rms_norm(x, _f32(64), 1e-6, _f32(3, 64))),
        "silu_and_mul": (("silu_and_mul_f32",), lambda: cpu_native.silu_and_mul(_f32(3, 80))),
        "gemv": (("gemv_f32",), lambda: cpu_native.gemv(x, w, b)),
        "gemv_silu": (("gemv_silu_f32",), lambda: cpu_native.gemv_silu(x, w, b)),
        "gemm": (("gemm_f32",), lambda: cpu_native.gemm(xs, w, b)),
        "gemm_packed float32": (("gemm_packed",), lambda: cpu_native.gemm_packed(xs, w, b)),
        "gemm_packed int8": (("gemm_packed",), lambda: cpu_native.gemm_packed(xs, wi, b, scale)),
        "gemm_vector_floats": (("gemm_vector_floats",), lambda: native_build.library().gemm_vector_floats()),
        "amx_usable": (("amx_usable",), lambda: native_build.library().amx_usable()),
        "gemm_8bit_amx": (("gemm_w8_amx",), lambda: cpu_native.gemm_8bit_amx(xs, wi, scale, b)),
        "gemm_int8_amx": (("gemm_i8_amx",), lambda: cpu_native.gemm_int8_amx(xs, wi, scale, b)),
        "gemv_int8": (("gemv_i8",), lambda: cpu_native.gemv_int8(x, wi, scale, b)),
        "gemv_silu_int8": (("gemv_silu_i8",), lambda: cpu_native.gemv_silu_int8(x, wi, scale, b)),
        "gemm_int8 8-bit inputs": (("gemm_i8",), lambda: _int8_gemm(8)),
        "gemm_int8 16-bit inputs": (("gemm_i8",), lambda: _int8_gemm(16)),
        "gemm_int8_is_fast": (("gemm_i8_vnni",), cpu_native.gemm_int8_is_fast),
        "gemv_fp8": (("gemv_fp8",), lambda: cpu_native.gemv_fp8(x, fp8, scale, b)),
        "fp8_to_float32": (("fp8_to_f32",), lambda: cpu_native.fp8_to_float32(fp8)),
        "rotary_write_kv": (("rotary_write_kv_f32",), lambda: _rotary(torch.float32)),
        "PagedDecodeAttention": (("paged_decode_attention_f32",), _attention_f32),
        "bf16 dot_native": (("bf16_dot_native",), cpu_bf16.dot_native),
        "bf16 gemv": (("gemv_bf16",), lambda: cpu_bf16.gemv(xb, wb, bb)),
        "bf16 gemv portable": (("gemv_bf16_portable",), lambda: cpu_bf16.gemv(xb, wb, bb, portable=True)),
        "bf16 gemm": (("gemm_bf16w",), lambda: cpu_bf16.gemm(_bf16(20, 64), wb, bb)),
        "bf16 gemm_amx": (("gemm_bf16_amx",), lambda: cpu_bf16.gemm_amx(_bf16(20, 64), wb, bb)),
        "bf16 widen_8bit int8": (("i8_to_bf16",), lambda: cpu_bf16.widen_8bit(wi)),
        "bf16 widen_8bit fp8": (("fp8_to_bf16",), lambda: cpu_bf16.widen_8bit(fp8)),
        "bf16 scale_columns": (("bf16_scale_cols",), lambda: cpu_bf16.scale_columns(_bf16(3, 40), scale, b)),
        "bf16 add_rms_norm": (("add_rms_norm_bf16",), lambda: cpu_bf16.add_rms_norm(xb, _bf16(64), 1e-6)),
        "bf16 silu_and_mul": (("silu_and_mul_bf16",), lambda: cpu_bf16.silu_and_mul(_bf16(3, 80))),
        "bf16 rotary_write_kv": (("rotary_write_kv_bf16",), lambda: _rotary(torch.bfloat16)),
        "bf16 PagedDecodeAttention": (("paged_decode_attention_bf16",), _attention_bf16),
        "int8 KV rotary_write_kv": (("rotary_write_kv_q8",), _rotary_q8),
        "int8 KV PagedDecodeAttention": (("paged_decode_attention_q8",), _attention_q8),
        "amx pieces bf16": (
            ("amx_tiles_begin", "amx_scratch_bytes", "amx_pack_bf16", "amx_rows_bf16", "amx_tiles_end"),
            lambda: _amx_pieces(int8=False),
        ),
        "amx pieces int8": (("amx_pack_i8", "amx_rows_i8"), lambda: _amx_pieces(int8=True)),
        "decode step float32": (
            ("decode_step_f32", "decode_step_work_floats", "decode_step_phases"),
            lambda: _decode_step(model_dir, "float32"),
        ),
        "decode step bf16": (("decode_step_bf16",), lambda: _decode_step(model_dir, "bfloat16")),
        "decode step int8 weights": (("decode_step_f32",), lambda: _decode_step(model_dir, "float32", "int8")),
        "decode step int8 KV": (
            ("decode_step_kvq8",),
            lambda: _decode_step(model_dir, "float32", kv_cache_dtype="int8"),
        ),
    }  # fmt: skip


# Exported for the other sources to link against; they run inside the entries named.
CALLED_FROM = {
    "paged_attention_rows": "PagedDecodeAttention",
    "kv_q8_quantize_head": "int8 KV rotary_write_kv",
    "gemv_chunk_rows": "gemv",
    "gemv_rows_f32": "gemv",
    "gemv_silu_rows_f32": "gemv_silu",
    "gemv_tiled_rows_f32": "decode step float32",
    "gemv_rows_bf16": "bf16 gemv",
    "gemv_silu_rows_bf16": "decode step bf16",
    "gemv_tiled_rows_bf16": "decode step bf16",
    "gemv_bf16_dp": "bf16 gemv",  # built with AVX-512 BF16 only
    "gemv_rows_i8": "gemv_int8",
    "gemv_silu_rows_i8": "gemv_silu_int8",
    "gemv_rows_fp8": "gemv_fp8",
    "gemv_silu_rows_fp8": "gemv_fp8",
}


BUILD_DEPENDENT = {"gemv_bf16_dp"}


def _exported() -> set[str]:
    """The functions the loaded kernels' shared object exports."""
    lib_path = native_build.library()._name
    out = subprocess.run(["nm", "-D", "--defined-only", lib_path], check=True, capture_output=True, text=True)
    return {
        parts[2] for parts in map(str.split, out.stdout.splitlines()) if len(parts) == 3 and parts[1] == "T"
    }


def _in_child(call) -> tuple[str, str]:
    """Run `call` in a forked child on one thread: ("returned" | "raised" | "signal", detail)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running the parent's cleanup
        os.close(read)
        code, detail = 0, ""
        try:
            torch.set_num_threads(1)
            call()
        except BaseException as exc:  # noqa: BLE001 - any exception is a clean outcome
            code, detail = 3, f"{type(exc).__name__}: {exc}"
        os.write(write, detail.encode()[:2000])
        os._exit(code)
    os.close(write)
    _, status = os.waitpid(pid, 0)  # a child that hangs is stopped by the suite's per-test timeout
    detail = os.read(read, 4096).decode(errors="replace")
    os.close(read)
    if os.WIFSIGNALED(status):
        return "signal", signal.Signals(os.WTERMSIG(status)).name
    return ("returned" if os.WEXITSTATUS(status) == 0 else "raised"), detail


@pytest.fixture(scope="module")
def entries(tiny_llama_dir):
    return _entries(tiny_llama_dir)


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs nm (binutils) to list the exports")
def test_every_export_is_called(entries):
    called = {symbol for symbols, _ in entries.values() for symbol in symbols}
    assert set(CALLED_FROM.values()) <= set(entries)
    assert _exported() - called - set(CALLED_FROM) == set(), "exported and called by no entry here"
    assert called - _exported() == set(), "called here and not exported"
    assert set(CALLED_FROM) - _exported() <= BUILD_DEPENDENT, "named here and not exported"


def test_each_entry_returns_or_raises_and_never_dies_of_a_signal(entries):
    outcomes = {name: _in_child(call) for name, (_, call) in entries.items()}
    died = {name: outcome for name, outcome in outcomes.items() if outcome[0] == "signal"}
    assert died == {}, f"on {native_build.cpu_report()}"
    # what may refuse: AMX where it is not usable, with the error its docstring promises
    raised = {name: detail for name, (kind, detail) in outcomes.items() if kind == "raised"}
    amx = {"gemm_8bit_amx", "gemm_int8_amx", "bf16 gemm_amx"}
    assert set(raised) <= amx, raised
    for name in raised:
        assert "AMX is not usable" in raised[name], raised[name]
    assert set(raised) == (set() if native_build.amx_usable() else amx)


def test_the_amx_pieces_do_nothing_where_amx_is_not_usable():
    began, y = _amx_pieces(int8=False)
    if native_build.amx_usable():
        assert began == 0 and y.abs().sum() > 0
    else:
        assert began == -2 and torch.equal(y, torch.zeros_like(y))


def test_the_amx_gemms_raise_where_amx_is_not_usable():
    if native_build.amx_usable():
        pytest.skip("AMX is usable here: tests/kernels/test_cpu_amx.py checks its products")
    with pytest.raises(RuntimeError, match="AMX is not usable"):
        cpu_bf16.gemm_amx(_bf16(20, 64), _bf16(40, 64))
    with pytest.raises(RuntimeError, match="AMX is not usable"):
        cpu_native.gemm_int8_amx(_f32(20, 64), _int8(40, 64), _rows(40))
    with pytest.raises(RuntimeError, match="AMX is not usable"):
        cpu_native.gemm_8bit_amx(_f32(20, 64), _int8(40, 64), _rows(40))
