"""The native kernels' build and load (`native_build`): the private, content-hashed cache, the
sources compiled at once then linked, the build begun in the background, and what loading the
kernels leaves of the process (its OpenMP runtime, its floating-point mode)."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading
from pathlib import Path

import needs
import pytest
import torch

from disagg.kernels import cpu_native, native_build

pytestmark = needs.native


def test_the_library_shares_torchs_openmp_runtime():
    """Two OpenMP runtimes in one process would mean two thread pools fighting for the cores."""
    with open("/proc/self/maps") as f:
        runtimes = {line.split()[-1] for line in f if "libgomp" in line or "libiomp" in line}
    assert len(runtimes) == 1, runtimes


def _compiler() -> str:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@pytest.fixture
def one_source():
    """Builds one small source through the cache: its rules do not depend on what is compiled, and
    one source builds in a second, all of them in ~15 s (the suite's own build compiles them all)."""
    source = (native_build.SOURCE_DIR / "cpu_gemv.c",)
    return lambda: native_build._build(_compiler(), "cpu_kernels", source, native_build._BASE_FLAGS, "")


def test_cache_dir_is_made_private_and_files_carry_their_content_hash(tmp_path, monkeypatch, one_source):
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
    assert again == built and native_build._trusted(again)


def test_cache_dirs_of_others_or_symlinks_are_refused(tmp_path, monkeypatch, one_source):
    target = tmp_path / "elsewhere"
    target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(native_build.UnsafeCache):
        native_build._private_dir(link)
    if os.getuid() != 0:
        pytest.skip("chown to another user needs root")
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    os.chown(foreign, 65534, 65534)
    with pytest.raises(native_build.UnsafeCache):
        native_build._private_dir(foreign)
    # a planted object under the right name in a directory of ours, owned by someone else: not loaded
    ours = tmp_path / "ours"
    monkeypatch.setenv("DISAGG_CACHE_DIR", str(ours))
    built = one_source()
    os.chown(built, 65534, 65534)
    assert not native_build._trusted(built)
    assert one_source() == built  # rebuilt by us under the same content name
    assert os.stat(built).st_uid == os.getuid()


@needs.x86_64
def test_amx_counts_only_where_granted_and_probed():
    """`amx_usable` is never more than the CPU lists; where it holds, this process survived a tile
    instruction (the probe's child did) and the kernels still run. The kernels themselves are
    built with AMX off."""
    usable = native_build.amx_usable()
    if not needs.has("amx-tile"):
        assert not usable
    assert {"-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"} <= set(native_build._built_for)
    x = torch.randn(3, 8)
    torch.testing.assert_close(cpu_native.gemm(x, torch.eye(8)), x)


def test_cache_on_a_kubelet_made_empty_dir_uses_a_private_subdirectory(as_user):
    """A kubelet makes an emptyDir `root:<fsGroup>` with mode 2777; a non-root worker caches its
    kernels in its own 0700 `uid-<uid>` subdirectory there."""
    parent = Path(tempfile.mkdtemp(prefix="disagg-emptydir-"))
    try:
        os.chown(parent, 0, 1000)
        os.chmod(parent, 0o2777)

        def cache_dir() -> str:
            got = native_build._private_dir(parent)
            st = os.lstat(got)
            return f"{got}|{st.st_uid}|{st.st_mode & 0o777:o}"

        report = as_user(1000, 1000, cache_dir)
        assert report == f"{parent / 'uid-1000'}|1000|700", report
    finally:
        shutil.rmtree(parent)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: the sources compile in turn")
def test_a_cold_cache_compiles_the_sources_at_once_then_links_them(tmp_path, monkeypatch):
    """Each source is compiled on its own, together with the others (here: each compile waits
    until both began, and notes when it gave up waiting), then the objects are linked."""
    sources = tuple(native_build.SOURCE_DIR / n for n in ("cpu_gemv.c", "cpu_isa.c"))
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
    built = native_build._build(str(wrapper), "cpu_kernels", sources, native_build._BASE_FLAGS, "")
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
    began, finish, builds = threading.Event(), threading.Event(), []

    def slow_load():
        builds.append(threading.current_thread().name)
        began.set()
        finish.wait(30)
        return "lib"

    monkeypatch.setattr(native_build, "_lib", None)
    monkeypatch.setattr(native_build, "_error", None)
    monkeypatch.setattr(native_build, "_load", slow_load)
    native_build.build_in_background()
    assert began.wait(30)
    native_build.build_in_background()  # under way: returns at once, starts nothing
    answered = []
    waiter = threading.Thread(target=lambda: answered.append(native_build.available()))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not answered  # held until the build ends
    finish.set()
    waiter.join(30)
    assert answered == [True] and builds == ["native-kernel-build"]
    native_build.build_in_background()  # built: nothing starts again
    assert builds == ["native-kernel-build"]


def test_loading_the_kernels_leaves_the_processs_floating_point_mode_alone():
    """No flush-to-zero or denormals-are-zero for torch (or anything else in the process) after the
    kernels are loaded (a shared object linked with -ffast-math sets both as it loads)."""
    assert native_build.available()
    tiny = torch.tensor([1e-39])  # a float32 subnormal
    assert (tiny * 1.0).item() != 0.0 and (tiny / 2).item() != 0.0
