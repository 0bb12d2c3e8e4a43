"""The native CPU decode-attention kernel against the torch twin, and the model using it."""

from __future__ import annotations

from pathlib import Path

import needs
import pytest
import torch
from triton_cases import TOLERANCE, case_id, paged_cache

from disagg.kernels import cpu_native, torch_ops
from disagg.worker.model.loader import load_model

pytestmark = needs.native


@pytest.mark.parametrize("page", [16, 32], ids=case_id)
@pytest.mark.parametrize("head_dim", [64, 128], ids=case_id)
@pytest.mark.parametrize("q_heads,kv_heads", [(8, 8), (8, 2), (8, 1), (9, 3)], ids=case_id)
def test_matches_the_torch_twin(page, head_dim, q_heads, kv_heads):
    # lengths of 1, on and one past a block boundary, and a long one, in one ragged batch
    seq_lens = [1, page, page + 1, 3 * page - 1, 5 * page + 7]
    gen = torch.Generator().manual_seed(page + head_dim + kv_heads)
    cache, tables = paged_cache(seq_lens, page, kv_heads, head_dim, torch.float32, gen)
    q = torch.randn(len(seq_lens), q_heads, head_dim, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_dim**-0.5
    want = torch_ops.decode_attention(q, cache, tables, lens, scale)
    got = cpu_native.PagedDecodeAttention(tables, lens, q_heads, kv_heads)(q, cache, scale)
    torch.testing.assert_close(got, want, **TOLERANCE[torch.float32])


def test_split_over_threads_equals_one_call(monkeypatch):
    seq_lens = [40, 3, 77, 16, 9, 120, 1, 64]
    gen = torch.Generator().manual_seed(1)
    cache, tables = paged_cache(seq_lens, 16, 2, 64, torch.float32, gen)
    q = torch.randn(len(seq_lens), 4, 64, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    one = cpu_native.PagedDecodeAttention(tables, lens, 4, 2)
    monkeypatch.setattr(cpu_native, "_PARALLEL_MIN_WORK", 0)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    split = cpu_native.PagedDecodeAttention(tables, lens, 4, 2)
    assert one.threads == 1 and split.threads == 3
    assert torch.equal(split(q, cache, 0.125), one(q, cache, 0.125))


def test_the_library_shares_torchs_openmp_runtime():
    """Two OpenMP runtimes in one process would mean two thread pools fighting for the cores."""
    with open("/proc/self/maps") as f:
        runtimes = {line.split()[-1] for line in f if "libgomp" in line or "libiomp" in line}
    assert len(runtimes) == 1, runtimes


def test_strided_q_view_is_read_correctly():
    """The model passes q as a column slice of its fused qkv output."""
    gen = torch.Generator().manual_seed(2)
    cache, tables = paged_cache([5, 33], 16, 2, 64, torch.float32, gen)
    qkv = torch.randn(2, (4 + 2 * 2) * 64, generator=gen)
    q = qkv[:, : 4 * 64].view(2, 4, 64)
    lens = torch.tensor([5, 33], dtype=torch.int32)
    want = torch_ops.decode_attention(q.contiguous(), cache, tables, lens, 0.125)
    got = cpu_native.PagedDecodeAttention(tables, lens, 4, 2)(q, cache, 0.125)
    torch.testing.assert_close(got, want, **TOLERANCE[torch.float32])


def test_bad_inputs_are_refused():
    gen = torch.Generator().manual_seed(3)
    cache, tables = paged_cache([4], 16, 2, 64, torch.float32, gen)
    with pytest.raises(ValueError, match="num_kv_heads"):
        cpu_native.PagedDecodeAttention(tables, torch.tensor([4], dtype=torch.int32), 3, 2)
    attn = cpu_native.PagedDecodeAttention(tables, torch.tensor([0], dtype=torch.int32), 4, 2)
    with pytest.raises(ValueError, match="seq_lens"):
        attn(torch.randn(1, 4, 64), cache, 0.125)
    attn = cpu_native.PagedDecodeAttention(tables, torch.tensor([4], dtype=torch.int32), 4, 2)
    with pytest.raises(TypeError, match="float32"):
        attn(torch.randn(1, 4, 64).bfloat16(), cache.bfloat16(), 0.125)
    with pytest.raises(ValueError, match="plan"):
        attn(torch.randn(2, 4, 64), cache, 0.125)


def test_add_rms_norm_matches_torch_and_updates_the_residual():
    gen = torch.Generator().manual_seed(4)
    x, res = torch.randn(5, 96, generator=gen), torch.randn(5, 96, generator=gen)
    weight = torch.randn(96, generator=gen)
    want_sum = x + res
    want = torch_ops.rms_norm(want_sum, weight, 1e-5)
    got = cpu_native.add_rms_norm(x, weight, 1e-5, res)
    torch.testing.assert_close(got, want, **TOLERANCE[torch.float32])
    torch.testing.assert_close(res, want_sum, atol=0, rtol=0)
    torch.testing.assert_close(cpu_native.add_rms_norm(x, weight, 1e-5), torch_ops.rms_norm(x, weight, 1e-5))
    with pytest.raises(ValueError, match="residual"):
        cpu_native.add_rms_norm(x, weight, 1e-5, res[:2])
    with pytest.raises(ValueError, match="x: .*float32"):
        cpu_native.add_rms_norm(x.double(), weight, 1e-5)


def test_silu_and_mul_matches_torch_over_the_whole_exp_range():
    gate = torch.linspace(-120, 120, 4001)
    x = torch.cat([gate, torch.linspace(-3, 3, 4001)]).view(1, -1)
    torch.testing.assert_close(cpu_native.silu_and_mul(x), torch_ops.silu_and_mul(x), atol=1e-6, rtol=2e-6)


@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (8, 2)], ids=case_id)
def test_rotary_write_kv_matches_the_torch_ops(q_heads, kv_heads):
    gen = torch.Generator().manual_seed(6)
    d, page, tokens = 64, 16, 7
    cos_sin = torch.randn(100, d, generator=gen)
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * d, generator=gen)
    positions = torch.tensor([0, 5, 17, 99, 3, 3, 42])
    slots = torch.tensor([0, 17, 33, -1, 2, 47, 16])  # one token not written
    cache = torch.randn(3, 2, page, kv_heads, d, generator=gen)
    want_qkv, want_cache = qkv.clone(), cache.clone()
    q = want_qkv[:, : q_heads * d].view(tokens, q_heads, d)
    k = want_qkv[:, q_heads * d : (q_heads + kv_heads) * d].view(tokens, kv_heads, d)
    v = want_qkv[:, (q_heads + kv_heads) * d :].view(tokens, kv_heads, d)
    torch_ops.rotary_embedding(positions, q, k, cos_sin)
    torch_ops.write_kv_cache(k, v, want_cache, slots)
    cpu_native.rotary_write_kv(qkv, cos_sin, positions, cache, slots, q_heads, kv_heads)
    torch.testing.assert_close(qkv, want_qkv, **TOLERANCE[torch.float32])
    torch.testing.assert_close(cache, want_cache, **TOLERANCE[torch.float32])
    with pytest.raises(ValueError, match="int64"):
        cpu_native.rotary_write_kv(qkv, cos_sin, positions.int(), cache, slots, q_heads, kv_heads)
    with pytest.raises(ValueError, match="heads"):
        cpu_native.rotary_write_kv(qkv, cos_sin, positions, cache, slots, q_heads + 1, kv_heads)


def test_step_bounds_are_checked_before_the_kernels_trust_them():
    cpu_native.check_step_bounds(torch.tensor([0, 9]), torch.tensor([-1, 31]), 10, 32)
    with pytest.raises(IndexError, match="positions"):
        cpu_native.check_step_bounds(torch.tensor([10]), torch.tensor([0]), 10, 32)
    with pytest.raises(IndexError, match="slot_mapping"):
        cpu_native.check_step_bounds(torch.tensor([1]), torch.tensor([32]), 10, 32)
    tables = torch.tensor([[0, 7]], dtype=torch.int32)
    with pytest.raises(IndexError, match="block_tables"):
        cpu_native.PagedDecodeAttention(tables, torch.tensor([20], dtype=torch.int32), 4, 2, num_blocks=7)


def test_model_with_and_without_the_native_kernels(tiny_llama_dir, paged, monkeypatch):
    """Prefill and decode steps through the model: logits within float32 rounding, same argmax."""
    model, config = load_model(tiny_llama_dir)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(10, config.vocab_size, (n,), generator=g).tolist() for n in (7, 12, 3)]
    caches = [model.allocate_kv_cache(num_blocks=16, block_size=4) for _ in range(2)]
    seqs = [paged(4), paged(4)]

    def both(build):
        out = []
        for native, s, c in zip("10", seqs, caches, strict=True):
            monkeypatch.setenv("DISAGG_CPU_NATIVE", native)
            out.append(model.forward(build(s), c))
        torch.testing.assert_close(out[0], out[1], atol=1e-4, rtol=1e-4)
        assert torch.equal(out[0].argmax(-1), out[1].argmax(-1))
        return out[0]

    logits = both(lambda s: s.prefill(list(enumerate(prompts))))
    for _ in range(6):
        step = list(enumerate(logits.argmax(-1).tolist()))
        logits = both(lambda s, step=step: s.decode(step))
    torch.testing.assert_close(caches[0], caches[1], **TOLERANCE[torch.float32])


def _compiler() -> str:
    import os
    import shutil

    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@pytest.fixture
def one_source():
    """Builds one small source through the cache: its rules do not depend on what is compiled, and
    one source builds in a second, all of them in ~15 s (the suite's own build compiles them all)."""
    source = (cpu_native._HEADER.with_name("cpu_gemv.c"),)
    return lambda: cpu_native._build(_compiler(), "cpu_kernels", source, cpu_native._BASE_FLAGS, "")


def test_cache_dir_is_made_private_and_files_carry_their_content_hash(tmp_path, monkeypatch, one_source):
    import hashlib
    import os

    cache = tmp_path / "cache"
    cache.mkdir(mode=0o777)
    os.chmod(cache, 0o777)
    monkeypatch.setenv("DISAGG_CACHE_DIR", str(cache))
    built = one_source()
    assert built.parent == cache and os.stat(cache).st_mode & 0o777 == 0o700
    assert built.stem.rsplit("-", 1)[1] == hashlib.sha256(built.read_bytes()).hexdigest()
    assert one_source() == built  # found again, not rebuilt
    # a tampered file is not loaded: a fresh one is built beside it
    os.chmod(built, 0o700)
    built.write_bytes(built.read_bytes() + b"\0")
    again = one_source()
    assert again == built and cpu_native._trusted(again)


def test_cache_dirs_of_others_or_symlinks_are_refused(tmp_path, monkeypatch, one_source):
    import os

    target = tmp_path / "elsewhere"
    target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(cpu_native.UnsafeCache):
        cpu_native._private_dir(link)
    if os.getuid() != 0:
        pytest.skip("chown to another user needs root")
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    os.chown(foreign, 65534, 65534)
    with pytest.raises(cpu_native.UnsafeCache):
        cpu_native._private_dir(foreign)
    # a planted object under the right name in a directory of ours, owned by someone else: not loaded
    ours = tmp_path / "ours"
    monkeypatch.setenv("DISAGG_CACHE_DIR", str(ours))
    built = one_source()
    os.chown(built, 65534, 65534)
    assert not cpu_native._trusted(built)
    assert one_source() == built  # rebuilt by us under the same content name
    assert os.stat(built).st_uid == os.getuid()


@needs.x86_64
def test_amx_counts_only_where_granted_and_probed():
    """`amx_usable` is never more than the CPU lists; where it holds, this process survived a tile
    instruction (the probe's child did) and the kernels still run. The kernels themselves are
    built with AMX off."""
    usable = cpu_native.amx_usable()
    if not needs.has("amx-tile"):
        assert not usable
    assert {"-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"} <= set(cpu_native._built_for)
    x = torch.randn(3, 8)
    torch.testing.assert_close(cpu_native.gemm(x, torch.eye(8)), x)


def test_cache_on_a_kubelet_made_empty_dir_uses_a_private_subdirectory(as_user):
    """A kubelet makes an emptyDir `root:<fsGroup>` with mode 2777; a non-root worker caches its
    kernels in its own 0700 `uid-<uid>` subdirectory there."""
    import os
    import shutil
    import tempfile

    parent = Path(tempfile.mkdtemp(prefix="disagg-emptydir-"))
    try:
        os.chown(parent, 0, 1000)
        os.chmod(parent, 0o2777)

        def cache_dir() -> str:
            got = cpu_native._private_dir(parent)
            st = os.lstat(got)
            return f"{got}|{st.st_uid}|{st.st_mode & 0o777:o}"

        report = as_user(1000, 1000, cache_dir)
        assert report == f"{parent / 'uid-1000'}|1000|700", report
    finally:
        shutil.rmtree(parent)


@pytest.mark.skipif(
    len(__import__("os").sched_getaffinity(0)) < 2, reason="one CPU: the sources compile in turn"
)
def test_a_cold_cache_compiles_the_sources_at_once_then_links_them(tmp_path, monkeypatch):
    """Each source is compiled on its own, together with the others (here: each compile waits
    until both began, and notes when it gave up waiting), then the objects are linked."""
    import os

    sources = tuple(cpu_native._HEADER.with_name(n) for n in ("cpu_gemv.c", "cpu_isa.c"))
    log = tmp_path / "log"
    log.mkdir()
    wrapper = tmp_path / "cc"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {log}/calls\n'
        'case " $* " in *" -c "*)\n'
        f"  touch {log}/began.$$; i=0\n"
        f'  while [ "$(ls {log} | grep -c began)" -lt 2 ]; do\n'
        f"    i=$((i + 1)); [ $i -gt 300 ] && {{ touch {log}/alone; break; }}; sleep 0.1\n"
        "  done;;\n"
        "esac\n"
        f'exec {_compiler()} "$@"\n'
    )
    os.chmod(wrapper, 0o755)
    monkeypatch.setenv("DISAGG_CACHE_DIR", str(tmp_path / "cache"))
    built = cpu_native._build(str(wrapper), "cpu_kernels", sources, cpu_native._BASE_FLAGS, "")
    calls = [c.split() for c in (log / "calls").read_text().splitlines() if "--version" not in c]
    compiles = [c for c in calls if "-c" in c]
    assert sorted(Path(c[-1]).name for c in compiles) == ["cpu_gemv.c", "cpu_isa.c"]
    assert all("-shared" not in c for c in compiles) and not (log / "alone").exists()
    link = calls[-1]
    assert "-c" not in link and "-shared" in link and sum(a.endswith(".o") for a in link) == 2
    assert built.is_file() and not any(p.name.startswith("objects-") for p in built.parent.iterdir())


def test_a_build_begun_in_the_background_is_the_one_its_first_user_waits_for(monkeypatch):
    """`build_in_background` starts the build; `available()` called meanwhile waits for that
    build, and nothing is built twice."""
    import threading

    began, finish, builds = threading.Event(), threading.Event(), []

    def slow_load():
        builds.append(threading.current_thread().name)
        began.set()
        finish.wait(30)
        return "lib"

    monkeypatch.setattr(cpu_native, "_lib", None)
    monkeypatch.setattr(cpu_native, "_error", None)
    monkeypatch.setattr(cpu_native, "_load", slow_load)
    cpu_native.build_in_background()
    assert began.wait(30)
    cpu_native.build_in_background()  # under way: returns at once, starts nothing
    answered = []
    waiter = threading.Thread(target=lambda: answered.append(cpu_native.available()))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not answered  # held until the build ends
    finish.set()
    waiter.join(30)
    assert answered == [True] and builds == ["native-kernel-build"]
    cpu_native.build_in_background()  # built: nothing starts again
    assert builds == ["native-kernel-build"]


def test_loading_the_kernels_leaves_the_processs_floating_point_mode_alone():
    """No flush-to-zero or denormals-are-zero for torch (or anything else in the process) after the
    kernels are loaded (a shared object linked with -ffast-math sets both as it loads)."""
    assert cpu_native.available()
    tiny = torch.tensor([1e-39])  # a float32 subnormal
    assert (tiny * 1.0).item() != 0.0 and (tiny / 2).item() != 0.0
