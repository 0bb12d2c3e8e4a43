"""The native GEMV kernels and the whole-step native decode against their torch twins."""

from __future__ import annotations

import needs
import pytest
import torch
import torch.nn.functional as F
from triton_cases import TOLERANCE, case_id
from worker.conftest import llama_config, save_hf_model

from disagg.kernels import cpu_decode_step, cpu_native, native_build, torch_ops
from disagg.worker.model.llama import decode_layers
from disagg.worker.model.loader import load_model

pytestmark = needs.native

# K sums of products of randn: the error grows with K; this is float32 rounding over K <= 768.
GEMV_TOL = dict(atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("batch", [1, 2, 3, 4, 5, 8], ids=case_id)
@pytest.mark.parametrize("n,k", [(1, 1), (3, 15), (31, 16), (32, 17), (33, 100), (130, 768)], ids=case_id)
@pytest.mark.parametrize("bias", [False, True], ids=case_id)
def test_gemv_matches_linear(batch, n, k, bias):
    """Edge shapes: fewer rows than a block of four, one past a chunk, K below, on and past a
    vector of 16, and batches that leave a partial group of four inputs."""
    g = torch.Generator().manual_seed(batch * 1000 + n + k)
    x, w = torch.randn(batch, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    torch.testing.assert_close(cpu_native.gemv(x, w, b), F.linear(x, w, b), **GEMV_TOL)


@pytest.mark.parametrize("batch", [1, 3, 4, 6], ids=case_id)
@pytest.mark.parametrize("inter,k", [(1, 16), (5, 7), (32, 64), (33, 48), (200, 130)], ids=case_id)
@pytest.mark.parametrize("bias", [False, True], ids=case_id)
def test_gemv_silu_matches_linear_then_silu_and_mul(batch, inter, k, bias):
    g = torch.Generator().manual_seed(batch * 1000 + inter + k)
    x, w = torch.randn(batch, k, generator=g), torch.randn(2 * inter, k, generator=g)
    b = torch.randn(2 * inter, generator=g) if bias else None
    want = torch_ops.silu_and_mul(F.linear(x, w, b))
    torch.testing.assert_close(cpu_native.gemv_silu(x, w, b), want, **GEMV_TOL)


def test_gemv_split_over_threads_equals_one_thread():
    """Rows are handed to threads whole, so the split cannot change a single sum; with more
    threads than cores some are descheduled mid-span and the others take chunks from the back of
    their spans (cpu_kernels.h, chunk_walk): every row is still computed exactly once."""
    g = torch.Generator().manual_seed(7)
    x, w, b = (
        torch.randn(3, 200, generator=g),
        torch.randn(1000, 200, generator=g),
        torch.randn(1000, generator=g),
    )
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, one_silu = cpu_native.gemv(x, w, b), cpu_native.gemv_silu(x, w, b)
        for n in (3, 8, 40):  # 40 threads: more than the 32 chunks, some own no chunk at all
            torch.set_num_threads(n)
            for _ in range(5):
                assert torch.equal(cpu_native.gemv(x, w, b), one)
                assert torch.equal(cpu_native.gemv_silu(x, w, b), one_silu)
    finally:
        torch.set_num_threads(threads)


def test_gemv_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="shapes"):
        cpu_native.gemv(torch.randn(2, 8), torch.randn(4, 9))
    with pytest.raises(ValueError, match="shapes"):
        cpu_native.gemv(torch.randn(2, 8), torch.randn(4, 8), torch.randn(3))
    with pytest.raises(ValueError, match="shapes"):
        cpu_native.gemv_silu(torch.randn(2, 8), torch.randn(5, 8))
    with pytest.raises(ValueError, match="float32"):
        cpu_native.gemv(torch.randn(2, 8).double(), torch.randn(4, 8))


@pytest.fixture(scope="module")
def head_dim_64_dir(tmp_path_factory):
    """The small preset's head size (the kernel's unrolled D = 64 attention), with q/k/v biases."""
    config = llama_config(hidden_size=256, num_attention_heads=4, num_key_value_heads=1, attention_bias=True)
    return save_hf_model(config, tmp_path_factory.mktemp("llama-d64"), seed=3)


def decode_both_ways(
    model_dir,
    paged,
    monkeypatch,
    num_seqs: int,
    steps: int = 4,
    block: int = 4,
    dtype="float32",
    per_op=False,
    amx=False,
    quantization="auto",
):
    """Prefill num_seqs prompts, then decode `steps` tokens each through the whole-step kernel and
    through the torch path (`per_op`: the per-layer native kernels), each with its own cache;
    returns both paths' logits per step, and the caches. The per-layer kernels are the GEMVs the
    whole step runs: where AMX is usable, the plans would multiply 2+ rows on it (other sums), so
    AMX is turned off unless `amx` (then both paths multiply on it)."""
    if per_op and not amx:
        monkeypatch.setattr(native_build, "amx_usable", lambda: False)  # before the load resolves the plans
    model, config = load_model(model_dir, dtype=dtype, quantization_setting=quantization)
    whole_step = model._whole_step_native
    assert whole_step
    g = torch.Generator().manual_seed(num_seqs)
    prompts = [
        torch.randint(10, config.vocab_size, (3 + 5 * i,), generator=g).tolist() for i in range(num_seqs)
    ]
    blocks = max(64, sum(-(-(len(p) + steps) // block) for p in prompts))
    caches = [model.allocate_kv_cache(num_blocks=blocks, block_size=block) for _ in range(2)]
    seqs = [paged(block), paged(block)]
    monkeypatch.setenv("DISAGG_CPU_NATIVE", "0")
    logits = model.forward(seqs[1].prefill(list(enumerate(prompts))), caches[1])
    caches[0].copy_(caches[1])
    seqs[0].prefill(list(enumerate(prompts)))
    steps_out = []
    for _ in range(steps):
        step = list(enumerate(logits.argmax(-1).tolist()))
        monkeypatch.setenv("DISAGG_CPU_NATIVE", "1")
        native = model.forward(seqs[0].decode(step), caches[0])
        if per_op:
            model._whole_step_native = False
        else:
            monkeypatch.setenv("DISAGG_CPU_NATIVE", "0")
        logits = model.forward(seqs[1].decode(step), caches[1])
        model._whole_step_native = whole_step
        steps_out.append((native, logits))
    return steps_out, caches, model


@pytest.mark.parametrize("num_seqs", [1, 2, 3, cpu_decode_step.MAX_BATCH], ids=case_id)
def test_decode_step_matches_the_torch_path(tiny_model_dir, paged, monkeypatch, num_seqs):
    """Llama (llama3 rope), Qwen2 (q/k/v biases), Mistral: logits within float32 rounding, same
    greedy tokens, and the same K/V written into the cache."""
    steps, caches, _ = decode_both_ways(tiny_model_dir, paged, monkeypatch, num_seqs)
    for native, torch_path in steps:
        torch.testing.assert_close(native, torch_path, atol=1e-4, rtol=1e-4)
        assert torch.equal(native.argmax(-1), torch_path.argmax(-1))
    torch.testing.assert_close(caches[0], caches[1], **TOLERANCE[torch.float32])


@pytest.mark.parametrize("num_seqs", [2, 7, 16, 33], ids=case_id)
def test_float32_decode_step_of_many_sequences_equals_the_per_op_gemm(
    tiny_model_dir, paged, monkeypatch, num_seqs
):
    """float32 weights: from two rows the whole step's matmuls run the per-op float32 GEMM's
    register tiles, and it takes batches up to that GEMM's limit: logits and cache equal to the
    per-op path's, bit for bit."""
    steps, caches, model = decode_both_ways(tiny_model_dir, paged, monkeypatch, num_seqs, per_op=True)
    assert model.native_decode_step().max_batch >= 32
    for native, per_op in steps:
        assert torch.equal(native, per_op)
    assert torch.equal(caches[0], caches[1])


def test_decode_step_with_head_dim_64_and_one_kv_head(head_dim_64_dir, paged, monkeypatch):
    steps, caches, _ = decode_both_ways(head_dim_64_dir, paged, monkeypatch, num_seqs=3, block=16)
    for native, torch_path in steps:
        torch.testing.assert_close(native, torch_path, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(caches[0], caches[1], **TOLERANCE[torch.float32])


@pytest.mark.parametrize("num_seqs", [1, 3, cpu_decode_step.MAX_BATCH], ids=case_id)
def test_bf16_decode_step_rounds_where_the_per_op_bf16_kernels_do(
    tiny_model_dir, paged, monkeypatch, num_seqs
):
    """A bf16 model's whole step against its per-layer native bf16 kernels (the same GEMV, norm,
    rotary and attention arithmetic, rounded to bf16 at the same points): equal logits and cache."""
    steps, caches, _ = decode_both_ways(
        tiny_model_dir, paged, monkeypatch, num_seqs, dtype="bfloat16", per_op=True
    )
    for native, per_op in steps:
        assert native.dtype == torch.float32
        assert torch.equal(native, per_op)
    assert torch.equal(caches[0], caches[1])


@needs.amx
@pytest.mark.parametrize("num_seqs", [2, 7, 16, 33], ids=case_id)
def test_bf16_decode_step_on_amx_equals_the_per_op_amx_gemm(tiny_model_dir, paged, monkeypatch, num_seqs):
    """Where AMX is usable a bf16 model's whole step multiplies on its tiles from two rows, in the
    per-op GEMM's own pieces (cpu_amx.c), and takes batches up to that GEMM's limit: logits and
    cache equal to the per-op path's, bit for bit, past one and two blocks of 16 inputs."""
    steps, caches, model = decode_both_ways(
        tiny_model_dir, paged, monkeypatch, num_seqs, dtype="bfloat16", per_op=True, amx=True
    )
    assert model.native_decode_step().max_batch > cpu_decode_step.MAX_BATCH
    for native, per_op in steps:
        assert torch.equal(native, per_op)
    assert torch.equal(caches[0], caches[1])


@needs.amx
@pytest.mark.parametrize("num_seqs", [4, 5, 16, 33], ids=case_id)
def test_int8_decode_step_on_amx_matches_the_per_op_path(tiny_llama_dir, paged, monkeypatch, num_seqs):
    """int8 weights: from W8A8_MIN_ROWS rows the whole step multiplies on AMX-INT8 tiles with the
    per-op int8 GEMM's pieces (the same 16-bit inputs and integer sums), below it the VNNI GEMVs as
    the per-op path: logits within float32 rounding of it, the same greedy tokens."""
    steps, caches, model = decode_both_ways(
        tiny_llama_dir, paged, monkeypatch, num_seqs, per_op=True, amx=True, quantization="int8"
    )
    assert model.native_decode_step().max_batch > cpu_decode_step.MAX_BATCH
    for native, per_op in steps:
        torch.testing.assert_close(native, per_op, atol=1e-4, rtol=1e-4)
        assert torch.equal(native.argmax(-1), per_op.argmax(-1))
    torch.testing.assert_close(caches[0], caches[1], atol=1e-5, rtol=1e-5)


def test_bf16_decode_step_over_more_threads_than_cores(tiny_llama_dir, paged, monkeypatch):
    """Five threads on a smaller machine: descheduled threads' chunks are taken by the others
    (chunk_walk), each GEMV row still computed once, so the result is the per-op path's exactly."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(5)
        steps, caches, _ = decode_both_ways(
            tiny_llama_dir, paged, monkeypatch, 4, dtype="bfloat16", per_op=True
        )
    finally:
        torch.set_num_threads(threads)
    for native, per_op in steps:
        assert torch.equal(native, per_op)
    assert torch.equal(caches[0], caches[1])


def test_bf16_decode_step_refuses_what_it_cannot_run(tiny_llama_dir):
    """A bf16 step takes bf16 embeddings and a bf16 cache, no quantized cache, no 8-bit weights."""
    from disagg.kernels.kv_quant import KVQuantFormat
    from disagg.worker.model.quantization import quantize

    model, _ = load_model(tiny_llama_dir, dtype="bfloat16")
    step = model.native_decode_step()
    cache = model.allocate_kv_cache(num_blocks=4, block_size=4)
    hidden = torch.randn(1, model.config.hidden_size, dtype=torch.bfloat16)
    pos, slots = torch.tensor([2]), torch.tensor([2])
    tables, lens = torch.tensor([[0]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    with pytest.raises(ValueError, match="bfloat16"):
        step(hidden.float(), pos, slots, cache, tables, lens)
    with pytest.raises(ValueError, match="bfloat16"):
        step(hidden.clone(), pos, slots, cache.float(), tables, lens)
    kv_format = KVQuantFormat("int8", 4, model.num_kv_heads, model.head_dim)
    with pytest.raises(ValueError, match="needs a float32 model"):
        step(hidden.clone(), pos, slots, cache, tables, lens, kv_format)
    assert torch.isfinite(step(hidden.clone(), pos, slots, cache, tables, lens)).all()
    layers = decode_layers(model.weights)
    layers[0].o = quantize(layers[0].o.float(), "int8")
    assert not cpu_decode_step.supports(layers[0].o, torch.bfloat16)
    with pytest.raises(ValueError, match="takes bf16 weights"):
        cpu_decode_step.NativeDecodeStep(
            layers, model.weights.norm, model.weights.lm_head, model.cos_sin_cache,
            num_q_heads=model.num_heads, num_kv_heads=model.num_kv_heads, eps=1e-6, scale=model.scale,
        )  # fmt: skip


def test_bf16_decode_step_with_head_dim_64_and_one_kv_head(head_dim_64_dir, paged, monkeypatch):
    """The unrolled D = 64 attention, a group of four query heads, q/k/v biases, 16-token blocks.
    (How far bf16 rounding takes the per-op kernels from float32 is their own tests' business:
    tests/kernels/test_cpu_bf16.py, and the model-level bounds in tests/worker/model/test_bf16.py.)"""
    steps, caches, _ = decode_both_ways(
        head_dim_64_dir, paged, monkeypatch, num_seqs=3, block=16, dtype="bfloat16", per_op=True
    )
    for native, per_op in steps:
        assert torch.equal(native, per_op)
    assert torch.equal(caches[0], caches[1])


def test_decode_step_runs_whole_in_the_kernel_for_small_batches_only(tiny_llama_dir, paged, monkeypatch):
    """Batches up to the step's max_batch take the whole-step kernel (its phase clock moves), larger
    ones not."""
    model, _ = load_model(tiny_llama_dir)
    step = model.native_decode_step()
    step.phase_seconds = torch.zeros(len(cpu_decode_step.PHASES), dtype=torch.float64)
    n = step.max_batch + 1
    cache = model.allocate_kv_cache(num_blocks=2 * n, block_size=4)
    seqs = paged(4)
    model.forward(seqs.prefill([(i, [10 + i, 11, 12]) for i in range(n)]), cache)
    model.forward(seqs.decode([(i, 20) for i in range(n)]), cache)
    assert not step.phase_seconds.any()
    model.forward(seqs.decode([(i, 20) for i in range(n - 1)]), cache)
    assert (step.phase_seconds > 0).all()


def test_decode_step_refuses_what_it_cannot_run(tiny_llama_dir):
    model, _ = load_model(tiny_llama_dir)
    step = model.native_decode_step()
    cache = model.allocate_kv_cache(num_blocks=4, block_size=4)
    hidden = torch.randn(1, model.config.hidden_size)
    pos, slots = torch.tensor([2]), torch.tensor([2])
    tables, lens = torch.tensor([[0]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    with pytest.raises(ValueError, match="hidden"):
        step(
            torch.randn(step.max_batch + 1, model.config.hidden_size),
            pos,
            slots,
            cache,
            tables,
            lens,
        )
    with pytest.raises(ValueError, match="seq_lens"):
        step(hidden.clone(), pos, slots, cache, tables, torch.tensor([5], dtype=torch.int32))
    with pytest.raises(IndexError, match="block_tables"):
        step(hidden.clone(), pos, slots, cache, torch.tensor([[4]], dtype=torch.int32), lens)
    with pytest.raises(IndexError, match="slot_mapping"):
        step(hidden.clone(), pos, torch.tensor([16]), cache, tables, lens)
    with pytest.raises(ValueError, match="kv_caches"):
        step(hidden.clone(), pos, slots, cache[:1].contiguous(), tables, lens)
    logits = step(hidden.clone(), pos, slots, cache, tables, lens)
    assert logits.shape == (1, model.vocab_size) and torch.isfinite(logits).all()


@pytest.mark.parametrize("batch", [1, 2, 4, 5, 8], ids=case_id)
@pytest.mark.parametrize("n,k", [(1, 1), (3, 15), (33, 100), (64, 128), (130, 300), (40, 768)], ids=case_id)
@pytest.mark.parametrize("bias", [False, True], ids=case_id)
def test_gemv_int8_matches_linear_of_the_dequantized_weight(batch, n, k, bias):
    """Edge shapes around the 32- and 128-weight steps of the int8 loop and the groups of four
    inputs. With VNNI the inputs are rounded to int16 per row (relative 3e-5 of the row's
    largest value): the tolerance is that, summed over K, not float32 rounding."""
    g = torch.Generator().manual_seed(batch * 1000 + n + k)
    x = torch.randn(batch, k, generator=g)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) / 127
    b = torch.randn(n, generator=g) if bias else None

    # each input off by at most half a step of max|x| / 16383; K such errors, random signs
    def tol(weight):
        return dict(
            atol=4 * k**0.5 * float(x.abs().max()) / 16383 / 2 * float(weight.abs().max()) + 1e-5, rtol=1e-4
        )

    want = F.linear(x, w.float() * scale[:, None], b)
    torch.testing.assert_close(cpu_native.gemv_int8(x, w, scale, b), want, **tol(w.float() * scale[:, None]))
    b2 = torch.randn(2 * n, generator=g) if bias else None
    w2 = torch.randint(-127, 128, (2 * n, k), generator=g, dtype=torch.int8)
    s2 = torch.rand(2 * n, generator=g) / 127
    want2 = torch_ops.silu_and_mul(F.linear(x, w2.float() * s2[:, None], b2))
    # SiLU's slope is at most 1.1 and up (its factor) is bounded by the same sum: twice the GEMV's error
    got2 = cpu_native.gemv_silu_int8(x, w2, s2, b2)
    up = F.linear(x, w2.float() * s2[:, None], b2)[:, n:]
    atol = tol(w2.float() * s2[:, None])["atol"] * (
        1.1 * float(up.abs().max()) + 1.1 * float(want2.abs().max()) + 1
    )
    torch.testing.assert_close(got2, want2, atol=atol, rtol=1e-4)


def test_gemv_int8_is_exact_at_the_integer_extremes_of_long_rows():
    """Every weight +-127 and every input its row's largest value (rounded to 16383): each int32 lane
    sums its largest products. Rows of 20000 weights pass AVX2's 8192-weight integer blocks (one
    lane would overflow int32 over the whole row), 70 inputs pass one input block (64)."""
    k = 20000
    x = torch.ones(70, k)
    x[1::2] *= -1.0
    w = torch.full((3, k), 127, dtype=torch.int8)
    w[1] = -127
    w[2, ::3] = -127
    scale = torch.ones(3)
    want = x.double() @ w.double().t()  # inputs rounded to exactly +-16383 * (1 / 16383)
    torch.testing.assert_close(cpu_native.gemv_int8(x, w, scale).double(), want, atol=0.0, rtol=1e-6)


def test_gemv_int8_refuses_bad_parts():
    x, w, s = torch.randn(2, 8), torch.zeros(4, 8, dtype=torch.int8), torch.ones(4)
    with pytest.raises(ValueError, match="int8"):
        cpu_native.gemv_int8(x, w.float(), s)
    with pytest.raises(ValueError, match="shapes"):
        cpu_native.gemv_int8(x, w, torch.ones(3))
    with pytest.raises(ValueError, match="shapes"):
        cpu_native.gemv_silu_int8(x, w[:3], s[:3])


def test_gemv_fp8_widens_every_e4m3_value_exactly():
    """Every e4m3fn byte but NaN, through the vector loop (first 224) and the scalar tail."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    w = values[~torch.isnan(values.float())][:240].reshape(1, 240).contiguous()
    got = cpu_native.gemv_fp8(torch.eye(240), w, torch.ones(1))
    assert torch.equal(got[:, 0], w.float()[0])


@pytest.mark.parametrize("batch", [1, 3, 5], ids=case_id)
@pytest.mark.parametrize("n,k", [(1, 7), (33, 100), (70, 768)], ids=case_id)
def test_gemv_fp8_matches_linear_of_the_dequantized_weight(batch, n, k):
    g = torch.Generator().manual_seed(batch * 100 + n + k)
    w = (torch.randn(n, k, generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale, x, b = torch.rand(n, generator=g), torch.randn(batch, k, generator=g), torch.randn(n, generator=g)
    want = F.linear(x, w.float() * scale[:, None], b)
    torch.testing.assert_close(cpu_native.gemv_fp8(x, w, scale, b), want, atol=1e-3, rtol=1e-4)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        cpu_native.gemv_fp8(x, w.float(), scale)


def test_gemv_int8_row_sums_beyond_int32_stay_exact():
    """Inputs at their rounded maximum against weights of 127 of the same sign: the row's integer
    sum (4096 * 16383 * 127 ~ 8.5e9) is past int32, each lane's is not."""
    x, w = torch.ones(2, 4096), torch.full((3, 4096), 127, dtype=torch.int8)
    x[1] = -1.0
    got = cpu_native.gemv_int8(x, w, torch.ones(3))
    torch.testing.assert_close(
        got, torch.tensor([[4096.0 * 127] * 3, [-4096.0 * 127] * 3]), atol=0, rtol=1e-6
    )


def test_fp8_to_float32_is_torchs_conversion():
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(300, 77, generator=g) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(cpu_native.fp8_to_float32(w), w.float())


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_decode_step_runs_8bit_weights_whole_in_the_kernel(tiny_llama_dir, paged, scheme):
    """8-bit models keep the whole-step kernel (its phase clock moves); one model mixing int8 and
    fp8 weights is refused by it, naming the kinds."""
    from disagg.worker.model.quantization import quantize

    model, _ = load_model(tiny_llama_dir, quantization_setting=scheme)
    step = model.native_decode_step()
    step.phase_seconds = torch.zeros(len(cpu_decode_step.PHASES), dtype=torch.float64)
    cache = model.allocate_kv_cache(num_blocks=16, block_size=4)
    seqs = paged(4)
    model.forward(seqs.prefill([(0, [10, 11, 12])]), cache)
    model.forward(seqs.decode([(0, 20)]), cache)
    assert (step.phase_seconds > 0).all()
    layers = decode_layers(model.weights)
    other = "fp8" if scheme == "int8" else "int8"
    layers[0].o = quantize(layers[0].o.dequantize(), other)
    with pytest.raises(ValueError, match="one kind of 8-bit weights per model"):
        cpu_decode_step.NativeDecodeStep(
            layers, model.weights.norm, model.weights.lm_head, model.cos_sin_cache,
            num_q_heads=model.num_heads, num_kv_heads=model.num_kv_heads, eps=1e-6, scale=model.scale,
        )  # fmt: skip
