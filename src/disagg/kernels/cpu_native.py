"""Native CPU kernels: C sources next to this module, compiled on first use, called through ctypes.

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

import torch

from disagg.kernels import cpu_isa

log = logging.getLogger(__name__)

# Built together into one shared object; the header is shared by all of them.
_SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in (
        "cpu_kernels.c",
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
_HEADER = Path(__file__).with_name("cpu_kernels.h")
_BASE_FLAGS = ["-O3", "-fopenmp", "-ffast-math", "-fno-finite-math-only", "-fPIC", "-shared"]
# CPUID as this process reads it (cpu_isa.py), built for the compiler's baseline target.
_PROBE = Path(__file__).with_name("cpu_probe.c")
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


# Below this many (query head x cached token) visits a call is too short to split over threads.
_PARALLEL_MIN_WORK = 8192

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
    lib = ctypes.CDLL(str(_build(compiler, "cpu_kernels", (*_SOURCES, _HEADER), flags, identity)))
    _built_for[:] = flags
    p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    signatures = {
        "paged_decode_attention_f32": (
            [p, i64, p, p, i64, p, p, i64, i64, i64, i64, i64, f32, p, i64, i64],
            ctypes.c_int,
        ),
        "add_rms_norm_f32": ([p, p, p, p, i64, i64, f32], None),
        "silu_and_mul_f32": ([p, p, i64, i64], None),
        "rotary_write_kv_f32": ([p, i64, p, p, p, p, i64, i64, i64, i64, i64], None),
        "gemv_f32": ([p, p, p, p, i64, i64, i64, i64], None),
        "gemv_silu_f32": ([p, p, p, p, i64, i64, i64, i64], None),
        "gemm_f32": ([p, p, p, p, i64, i64, i64, i64], None),
        "gemm_vector_floats": ([], i64),
        "amx_usable": ([], i64),
        "gemm_w8_amx": ([p, ctypes.c_int, p, p, p, p, i64, i64, i64, i64], ctypes.c_int),
        "gemm_i8_amx": ([p, p, p, p, p, i64, i64, i64, i64], ctypes.c_int),
        "gemm_packed": ([p, i64, p, p, p, p, i64, i64, i64, i64], ctypes.c_int),
        "gemv_i8": ([p, p, p, p, p, i64, i64, i64, i64], ctypes.c_int),
        "gemv_silu_i8": ([p, p, p, p, p, i64, i64, i64, i64], ctypes.c_int),
        "gemm_i8": ([p, p, p, p, p, p, i64, i64, i64, i64, i64], ctypes.c_int),
        "gemm_i8_vnni": ([], ctypes.c_int),
        "gemv_fp8": ([p, p, p, p, p, i64, i64, i64, i64], None),
        "fp8_to_f32": ([p, p, i64, i64], None),
        "decode_step_f32": ([p, p, i64, p, p, p, i64, i64, p, i64, p, i64, p, p, i64, p], ctypes.c_int),
        "decode_step_bf16": ([p, p, i64, p, p, p, i64, i64, p, i64, p, i64, p, p, i64, p], ctypes.c_int),
        "decode_step_kvq8": (
            [p, p, i64, p, p, p, i64, i64, i64, ctypes.c_int, p, i64, p, i64, p, p, i64, p],
            ctypes.c_int,
        ),
        "decode_step_work_floats": ([p, i64, i64, i64], i64),
        "decode_step_phases": ([], i64),
        "rotary_write_kv_q8": ([p, i64, p, p, p, p, i64, i64, i64, i64, i64, i64, ctypes.c_int], None),
        "paged_decode_attention_q8": (
            [p, i64, p, p, i64, p, p, i64, i64, i64, i64, i64, i64, ctypes.c_int, f32, p, i64, i64],
            ctypes.c_int,
        ),
    }
    for name, (argtypes, restype) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
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


def cpu_features() -> frozenset[str]:
    """The instruction sets this process may execute (`cpu_isa` names: "avx2", "avx512f",
    "amx-tile", ...), as CPUID and XCR0 answer it; empty without the native kernels."""
    return _cpu.usable() if available() else frozenset()


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


def library() -> ctypes.CDLL:
    """The loaded kernels (raises when unavailable), for the modules that bind more of them."""
    return _require()


def _require() -> ctypes.CDLL:
    if not available():
        raise RuntimeError(f"native CPU kernels unavailable: {_error or 'disabled by DISAGG_CPU_NATIVE=0'}")
    return _lib


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
    return add_rms_norm_call(_require().add_rms_norm_f32, torch.float32, x, weight, eps, residual)


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
    return silu_and_mul_call(_require().silu_and_mul_f32, torch.float32, x)


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
    _require().gemv_f32(
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
    _require().gemm_f32(
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
    if _require().gemm_packed(
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
    return int(_require().gemm_vector_floats())


@functools.cache
def amx_usable() -> bool:
    """Whether this process may run AMX tile instructions: the CPU lists AMX (CPUID), the kernel
    enabled its state (XCR0), granted it to this process (arch_prctl ARCH_REQ_XCOMP_PERM, asked
    here), and a probe ran in a forked child without dying. /proc/cpuinfo alone is not enough: on
    some hosts it lists AMX and the first tile instruction is an illegal instruction. The native
    kernels are built with AMX off; cpu_amx.c's GEMMs turn it on for themselves, and the matmul
    plans pick them only where this holds (as torch's oneDNN GEMMs use it)."""
    return available() and bool(_require().amx_usable())


def raise_for_amx(rc: int, what: str) -> None:
    """The return code of a cpu_amx.c GEMM as an exception (0: none)."""
    if rc == -2:
        raise RuntimeError("AMX is not usable in this process (amx_usable() is False)")
    if rc:
        raise MemoryError(f"{what}: no memory for its buffers")


def gemm_8bit_amx(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """float32 x [M, K] rounded to bf16 times 8-bit weight [N, K] (int8 or float8_e4m3fn, widened
    exactly to bf16 in tiles) on AMX (cpu_amx.c), float32 sums times `scale` [N] (+ bias) in
    float32. Only where `amx_usable()`."""
    check_cpu(torch.float32, x=x, scale=scale, **({} if bias is None else {"bias": bias}))
    if weight.dtype not in (torch.int8, torch.float8_e4m3fn) or not weight.is_contiguous():
        raise ValueError(f"weight: need contiguous int8 or float8_e4m3fn, got {weight.dtype}")
    (m, k), n = x.shape, weight.shape[0]
    if weight.shape[1] != k or scale.shape != (n,) or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"x {tuple(x.shape)}, weight {tuple(weight.shape)}: shapes do not match")
    y = torch.empty(m, n, dtype=torch.float32)
    rc = _require().gemm_w8_amx(
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
    `amx_usable()`."""
    _check_int8_weight(x, weight, scale, bias, 1)
    (m, k), n = x.shape, weight.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if m == 0:
        return y
    rc = _require().gemm_i8_amx(
        weight.data_ptr(), scale.data_ptr(), None if bias is None else bias.data_ptr(), x.data_ptr(),
        y.data_ptr(), m, n, k, torch.get_num_threads(),
    )  # fmt: skip
    raise_for_amx(rc, "gemm_int8_amx")
    return y


def narrow_tiles() -> bool:
    """Whether the kernels were built without AVX-512 (8-float tiles): the packed-panel GEMM then
    takes the products of many rows."""
    return available() and gemm_vector_floats() < 16


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
    _require().gemv_silu_f32(
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
    if _require().gemv_i8(
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
    if _require().gemm_i8(
        weight.data_ptr(), scale.data_ptr(), row_sums.data_ptr(), None if bias is None else bias.data_ptr(),
        x.data_ptr(), y.data_ptr(), m, n, k, input_bits, torch.get_num_threads(),
    ):  # fmt: skip
        raise MemoryError("gemm_int8: no memory for the rounded inputs")
    return y


def gemm_int8_is_fast() -> bool:
    """Whether `gemm_int8` runs a vector path here: AVX-512 VNNI, or built without AVX-512, AVX-VNNI
    or AVX2 (else it sums in plain loops: correct, slow). `narrow_tiles()` tells the two apart."""
    return bool(_require().gemm_i8_vnni())


def gemv_silu_int8(
    x: torch.Tensor, gate_up: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`gemv_silu` for int8 gate_up [2I, K] with per-row scales."""
    _check_int8_weight(x, gate_up, scale, bias, 2)
    (b, k), n = x.shape, gate_up.shape[0]
    out = torch.empty(b, n // 2, dtype=torch.float32)
    if _require().gemv_silu_i8(
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
    _require().gemv_fp8(
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
    _require().fp8_to_f32(weight.data_ptr(), out.data_ptr(), weight.numel(), torch.get_num_threads())
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
        _require().rotary_write_kv_f32, torch.float32, qkv, cos_sin_cache, positions, kv_cache, slot_mapping,
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
        _require()
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
        code = _lib.paged_decode_attention_f32(
            q.data_ptr(), q.stride(0), kv_cache.data_ptr(), self.tables.data_ptr(), self.tables.shape[1],
            self.lens.data_ptr(), out.data_ptr(), b, hq, self.num_kv_heads, d, kv_cache.shape[2], scale,
            self.scratch.data_ptr(), self.max_len, self.threads,
        )  # fmt: skip
        if code:
            raise ValueError(f"seq_lens: every length must be in [1, {self.max_len}]")
        return out
