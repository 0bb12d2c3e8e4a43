"""The native CPU kernels' build: C sources in `csrc/` next to this module, compiled on first use
into one shared object, loaded through ctypes (the modules binding its entries: `cpu_native`,
`cpu_bf16`, `cpu_kv_quant`, `cpu_decode_step`).

Plain C with no Python or torch headers, built with the system C compiler alone: each source
compiled apart, one per CPU at once, then linked (`build_in_background` starts it while a model
loads). They are built with -march=native less every instruction set this process may not execute
(`cpu_isa`: CPUID as the process itself reads it, so an emulated or masked CPU gets code it can
run), or for the target `$DISAGG_CPU_NATIVE_ARCH` names, which must be one this CPU can run.
The shared object is cached per source, compiler, flags and CPU, in `$DISAGG_CACHE_DIR`, else
`$XDG_CACHE_HOME/disagg` or `~/.cache/disagg`, else `disagg-cache-<uid>` in the temp directory
(read-only root file systems). Code is loaded from there, so a cache directory must be private:
owned by this user, a real directory, mode 0700 (one of ours that is wider is tightened; in one
that is root's, such as a kubelet-made emptyDir, a per-user `uid-<uid>` subdirectory is
used under the same rules; a symlink is refused). A shared object is loaded only if it is ours, writable by no
one else, and its bytes hash to the sha256 in its name. Without a compiler, or with `DISAGG_CPU_NATIVE=0`, `available()` is False and the
engine keeps the plain-torch path: results agree within float32 rounding, only speed differs.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import stat
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from disagg.kernels import cpu_isa

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).with_name("csrc")
# Built together into one shared object; the headers are shared by all of them.
_SOURCES = tuple(
    SOURCE_DIR / name
    for name in (
        "cpu_kernels.c",
        "cpu_paged_attention.c",
        "cpu_gemv.c",
        "cpu_gemm.c",
        "cpu_gemm_packed.c",
        "cpu_gemv_int8.c",
        "cpu_gemm_int8.c",
        "cpu_gemv_fp8.c",
        "cpu_decode_step.c",
        "cpu_kv_quant.c",
        "cpu_bf16.c",
        "cpu_isa.c",
        "cpu_amx.c",
    )
)
_HEADERS = (SOURCE_DIR / "cpu_kernels.h", SOURCE_DIR / "paged_attention.h")
_BASE_FLAGS = ["-O3", "-fopenmp", "-ffast-math", "-fno-finite-math-only", "-fPIC", "-shared"]
# CPUID as this process reads it (cpu_isa.py), built for the compiler's baseline target.
_PROBE = SOURCE_DIR / "cpu_probe.c"
_PROBE_FLAGS = ["-O2", "-fPIC", "-shared"]
# The CPU the kernels are built for: this one unless DISAGG_CPU_NATIVE_ARCH names another target
# of the compiler (x86: -march, e.g. x86-64-v3 for AVX2 without AVX-512; aarch64: -mcpu), for
# a cache shared by different machines or to run another CPU's code path here.
ARCH_ENV = "DISAGG_CPU_NATIVE_ARCH"
_NO_AMX = ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")
_ARCH_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")


def _flags(usable: frozenset[str]) -> list[str]:
    """The kernels' compiler flags for a process that may execute the features `usable`
    (cpu_isa names; empty off x86-64)."""
    arch = os.environ.get(ARCH_ENV, "native")
    if not _ARCH_NAME.fullmatch(arch):
        raise ValueError(f"{ARCH_ENV}={arch!r} is not a compiler target name")
    machine = platform.machine()
    if machine != "x86_64":
        return _BASE_FLAGS + ([f"-mcpu={arch}"] if machine == "aarch64" else [])
    # The whole cache streams through once per layer, so the widest vectors pay (AVX-512 where present).
    # AMX off: only cpu_amx.c uses it, in a region of its own behind a run-time check, and a CPU may
    # list it (CPUID, /proc/cpuinfo) while the kernel has not granted it (see cpu_isa.c, `amx_usable`).
    flags = [f"-march={arch}", "-mprefer-vector-width=512", *_NO_AMX]
    if arch == "native":  # the compiler's view of the CPU, less what this process may not execute
        return _BASE_FLAGS + flags + [f for f in cpu_isa.disable_flags(usable) if f not in _NO_AMX]
    cpu_isa.check_level(arch, usable)
    if arch in cpu_isa.LEVELS:  # a level's code paths, as a CPU of that level runs them: no AMX either
        flags.append("-DDISAGG_NO_AMX")
    return _BASE_FLAGS + flags


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: str | None = None
_background: threading.Thread | None = None  # `build_in_background`'s thread
_cpu: cpu_isa.CpuId | None = None  # what this process may execute, once `available()` asked
_built_for: list[str] = []  # the loaded kernels' compiler flags


def _cache_dirs() -> list[Path]:
    dirs = []
    if os.environ.get("DISAGG_CACHE_DIR"):
        dirs.append(Path(os.environ["DISAGG_CACHE_DIR"]))
    xdg = os.environ.get("XDG_CACHE_HOME")
    dirs.append(Path(xdg) / "disagg" if xdg else Path.home() / ".cache" / "disagg")
    # per user: a fixed shared name could be created first by someone else
    dirs.append(Path(tempfile.gettempdir()) / f"disagg-cache-{os.getuid()}")
    return dirs


class UnsafeCache(RuntimeError):
    pass


def _private_dir(directory: Path) -> Path:
    """`directory`, created 0700 if missing, or its per-user subdirectory `uid-<uid>` when the
    directory is root's (a kubelet makes an emptyDir `root:<fsGroup>`, mode 2777). What is
    returned is always ours, a real directory, and 0700; anything else is refused."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeCache(f"{directory} is not a directory (a symlink?)")
    if st.st_uid != os.getuid():
        # Only root's: root can replace anything anyway, while another user owning the parent
        # could swap our subdirectory for theirs.
        if st.st_uid != 0:
            raise UnsafeCache(f"{directory} belongs to uid {st.st_uid}, not to this user ({os.getuid()})")
        own = directory / f"uid-{os.getuid()}"
        try:
            own.mkdir(mode=0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise UnsafeCache(
                f"{directory} belongs to uid {st.st_uid}, not to this user ({os.getuid()}), "
                f"and {own.name} cannot be made in it: {exc.strerror}"
            ) from exc
        return _owned_dir(own)
    return _owned_dir(directory)


def _owned_dir(directory: Path) -> Path:
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeCache(f"{directory} is not a directory (a symlink?)")
    if st.st_uid != os.getuid():
        raise UnsafeCache(f"{directory} belongs to uid {st.st_uid}, not to this user ({os.getuid()})")
    if st.st_mode & 0o077:
        os.chmod(directory, 0o700)  # ours but open to others: close it before trusting its files
    return directory


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _trusted(path: Path) -> bool:
    """A cached shared object we may load: our regular file, writable only by us, intact."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        log.warning("ignoring native kernel cache file %s: not a private file of this user", path)
        return False
    digest = path.stem.rsplit("-", 1)[-1]
    if _sha256(path) != digest:
        log.warning("ignoring native kernel cache file %s: its content does not match its name", path)
        return False
    return True


def _cpu_signature() -> str:
    """The host's CPU as the kernel lists it: what `-march=native` in the compiler's process sees."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return os.uname().machine


@functools.cache
def _compiler_version(compiler: str) -> str:
    """What `compiler --version` says (part of every cache key: asked once for the probe and the kernels)."""
    return subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout


def _build(compiler: str, stem: str, sources: tuple[Path, ...], flags: list[str], identity: str) -> Path:
    """The shared object built from `sources` with `flags`, from the cache when there (its name:
    `stem`, a key of everything that goes into it, including `identity`, and its sha256)."""
    version = _compiler_version(compiler)
    key = hashlib.sha256(
        "\0".join(
            [
                *(f.read_text() for f in sources),
                compiler,
                version,
                *flags,
                "link",
                *_link_flags(flags),
                identity,
            ]
        ).encode()
    ).hexdigest()[:16]
    last_error: Exception | None = None
    for directory in _cache_dirs():
        try:
            directory = _private_dir(directory)
            for found in sorted(directory.glob(f"{stem}-{key}-*.so")):
                if _trusted(found):
                    return found
            # Built under a private name and renamed: workers starting together never load a half-written file.
            fd, tmp = tempfile.mkstemp(dir=directory, suffix=".so.tmp")
            os.close(fd)
            try:
                _compile(compiler, flags, [s for s in sources if s.suffix == ".c"], tmp, directory)
                os.chmod(tmp, 0o500)
                target = directory / f"{stem}-{key}-{_sha256(Path(tmp))}.so"
                os.replace(tmp, target)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            return target
        except subprocess.CalledProcessError as exc:
            raise RuntimeError(f"{compiler} failed: {exc.stderr.strip()[-2000:]}") from exc
        except (OSError, UnsafeCache) as exc:  # not writable, or not private: try the next place
            log.warning("native kernel cache %s not used: %s", directory, exc)
            last_error = exc
    raise RuntimeError(f"no writable cache directory for native kernels: {last_error}")


def _read_cpu(compiler: str) -> cpu_isa.CpuId:
    """CPUID and XCR0 as this process reads them, through the probe (built for any x86-64 CPU)."""
    if platform.machine() != "x86_64":
        return cpu_isa.CpuId(x86=False)
    probe = ctypes.CDLL(str(_build(compiler, "cpu_probe", (_PROBE,), _PROBE_FLAGS, "")))
    probe.cpu_probe_cpuid.argtypes = [ctypes.c_uint32, ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint32)]
    probe.cpu_probe_cpuid.restype = None
    probe.cpu_probe_xcr0.restype = ctypes.c_uint64
    registers = {}
    for leaf, subleaf in cpu_isa.LEAVES:
        out = (ctypes.c_uint32 * 4)()
        probe.cpu_probe_cpuid(leaf, subleaf, out)
        registers[(leaf, subleaf)] = tuple(out)
    return cpu_isa.CpuId(x86=True, registers=registers, xcr0=int(probe.cpu_probe_xcr0()))


def _compile(compiler: str, flags: list[str], sources: list[Path], target: str, directory: Path) -> None:
    """Build the shared object `target`: the sources compiled apart, as many at once as this
    process has CPUs (the largest first), then linked. A cold cache (every new pod) then waits
    for the slowest source rather than for all of them in turn. Every compiler is started from
    this one thread: a child forked while other threads of the process fork too can hang before
    it runs the compiler under an emulator (qemu-user, `make test-isa`)."""
    compile_flags = [f for f in flags if f != "-shared"]
    with tempfile.TemporaryDirectory(dir=directory, prefix="objects-") as objects:
        obj = {src: os.path.join(objects, f"{i}.o") for i, src in enumerate(sources)}
        waiting = sorted(sources, key=lambda src: src.stat().st_size, reverse=True)
        slots = min(len(sources), len(os.sched_getaffinity(0)))
        running: list[tuple[subprocess.Popen, list[str], object]] = []
        try:
            while waiting or running:
                while waiting and len(running) < slots:
                    src = waiting.pop(0)
                    args = [compiler, *compile_flags, "-c", "-o", obj[src], str(src)]
                    errors = tempfile.TemporaryFile(mode="w+", dir=objects)
                    running.append(
                        (subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=errors), args, errors)
                    )
                done = [job for job in running if job[0].poll() is not None]
                if not done:
                    time.sleep(0.01)
                for proc, args, errors in done:
                    running.remove((proc, args, errors))
                    errors.seek(0)
                    message = errors.read()
                    errors.close()
                    if proc.returncode:
                        raise subprocess.CalledProcessError(proc.returncode, args, stderr=message)
        finally:
            for proc, _, errors in running:  # after a compiler error: the others are not waited for
                proc.kill()
                proc.wait()
                errors.close()
        subprocess.run(
            [compiler, *_link_flags(flags), "-o", target, *obj.values(), "-lm"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip


def _link_flags(flags: list[str]) -> list[str]:
    """Linked without -ffast-math: with it GCC (before 13) links crtfastmath.o into the shared object,
    whose constructor turns on flush-to-zero and denormals-are-zero for the whole process as it is
    loaded, torch's arithmetic included."""
    return [f for f in flags if f != "-ffast-math"]


def _load() -> ctypes.CDLL:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    global _cpu
    _cpu = _read_cpu(compiler)
    usable = _cpu.usable()
    flags = _flags(usable)
    identity = _cpu_signature() + "\0" + ",".join(sorted(usable))
    lib = ctypes.CDLL(str(_build(compiler, "cpu_kernels", (*_SOURCES, *_HEADERS), flags, identity)))
    _built_for[:] = flags
    lib.amx_usable.argtypes, lib.amx_usable.restype = [], ctypes.c_int64
    return lib


def available() -> bool:
    """Whether the native kernels can be used here (built and loaded once per process)."""
    global _lib, _error
    if os.environ.get("DISAGG_CPU_NATIVE", "1") == "0":
        return False
    with _lock:
        if _lib is None and _error is None:
            try:
                _lib = _load()
            except Exception as exc:
                _error = str(exc)
                log.warning("native CPU kernels unavailable, using the torch path: %s", exc)
    return _lib is not None


def library() -> ctypes.CDLL:
    """The loaded kernels (raises when unavailable), for the modules that bind their entries."""
    if not available():
        raise RuntimeError(f"native CPU kernels unavailable: {_error or 'disabled by DISAGG_CPU_NATIVE=0'}")
    return _lib


def bind(signatures: dict[str, tuple[list, object]]) -> ctypes.CDLL:
    """The loaded kernels with the entries named in `signatures` (name -> (argtypes, restype)) typed
    (raises when unavailable). Each binding module passes its own entries, once."""
    lib = library()
    with _lock:
        for name, (argtypes, restype) in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
    return lib


def build_in_background() -> None:
    """Have `available()` build (or find) the kernels in a thread of their own: what needs them
    first waits for it, and whatever the process does meanwhile (loading a model's weights) runs
    beside the compiler."""
    global _background
    if not _lock.acquire(blocking=False):
        return  # a build is under way
    try:
        if os.environ.get("DISAGG_CPU_NATIVE", "1") == "0" or _lib is not None or _error is not None:
            return
        if _background is None or not _background.is_alive():
            _background = threading.Thread(target=available, name="native-kernel-build")
            _background.start()
    finally:
        _lock.release()


def cpu_features() -> frozenset[str]:
    """The instruction sets this process may execute (`cpu_isa` names: "avx2", "avx512f",
    "amx-tile", ...), as CPUID and XCR0 answer it; empty without the native kernels."""
    return _cpu.usable() if available() else frozenset()


@functools.cache
def amx_usable() -> bool:
    """Whether this process may run AMX tile instructions: the CPU lists AMX (CPUID), the kernel
    enabled its state (XCR0), granted it to this process (arch_prctl ARCH_REQ_XCOMP_PERM, asked
    here), and a probe ran in a forked child without dying. /proc/cpuinfo alone is not enough: on
    some hosts it lists AMX and the first tile instruction is an illegal instruction. The native
    kernels are built with AMX off; cpu_amx.c's GEMMs turn it on for themselves, and the matmul
    plans pick them only where this holds (as torch's oneDNN GEMMs use it)."""
    return available() and bool(library().amx_usable())


def cpu_report() -> str:
    """The CPU and the instructions the native kernels run with, for benchmarks to print beside
    their figures: its name, what this process may execute, and what the kernels were built for."""
    if not available():
        return f"native kernels unavailable: {_error or 'disabled by DISAGG_CPU_NATIVE=0'}"
    usable = _cpu.usable()
    arch = next(
        (f.removeprefix("-march=") for f in _built_for if f.startswith("-march=")), platform.machine()
    )
    built = {f for f in cpu_isa.LEVELS.get(arch, usable) & usable if not f.startswith("amx")}
    amx = "AMX in use" if amx_usable() else "no AMX"
    return f"{_cpu.brand()}; executes {cpu_isa.describe(usable)}; kernels built for {arch}: {cpu_isa.describe(built)}, {amx}"
