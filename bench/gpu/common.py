"""What every step of the GPU check shares: its record of checks and figures, the device's
measured ceilings, relative errors and event timing."""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class StepResult:
    """Checks (name -> passed, with a detail) and figures (name -> value, unit) of one step."""

    checks: list[dict] = field(default_factory=list)
    figures: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def check(self, name: str, passed: bool, detail: str = "") -> bool:
        self.checks.append({"name": name, "passed": bool(passed), "detail": detail})
        log(f"  {'ok  ' if passed else 'FAIL'} {name}{': ' + detail if detail else ''}")
        return bool(passed)

    def figure(self, name: str, value: float, unit: str, detail: str = "") -> None:
        self.figures.append({"name": name, "value": value, "unit": unit, "detail": detail})
        log(f"  {name}: {value:.4g} {unit}{' (' + detail + ')' if detail else ''}")

    def note(self, text: str) -> None:
        self.notes.append(text)
        log(f"  note: {text}")

    @property
    def passed(self) -> bool:
        return all(c["passed"] for c in self.checks)

    def to_json(self) -> dict:
        return {"checks": self.checks, "figures": self.figures, "notes": self.notes}


@dataclass
class Context:
    """Where a step runs: its device, its scale (`full` on a GPU; `smoke`: the smallest shapes,
    for proving the steps on a CPU) and the folder for models and shared measurements."""

    device: str
    scale: str
    work: Path

    @property
    def full(self) -> bool:
        return self.scale == "full"

    def synchronize(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """‖got − ref‖ / ‖ref‖ in float64 (NaN anywhere gives NaN, which fails every bound)."""
    g, r = got.double().flatten().cpu(), ref.double().flatten().cpu()
    if not torch.isfinite(g).all():
        return math.nan
    denom = r.norm().item()
    return (g - r).norm().item() / (denom if denom else 1.0)


# bf16 and fp16 operands: between 1e-3 and 1e-2 against a float64 reference; float32 far below
REL_BOUND = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def time_ms(fn, ctx: Context, warmup: int = 3, repeat: int = 20) -> float:
    """Median milliseconds of `fn()`: CUDA events on a GPU, the host clock elsewhere."""
    for _ in range(warmup):
        fn()
    ctx.synchronize()
    samples = []
    if ctx.device.startswith("cuda"):
        for _ in range(repeat):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
    else:
        for _ in range(repeat):
            t = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t) * 1e3)
    return statistics.median(samples)


def measure_ceilings(ctx: Context) -> dict:
    """The device's two ceilings, measured once per run and shared by the steps through the work
    folder: device-to-device copy bandwidth (bytes read + written per second) and the bf16 (float32
    on a CPU) matrix-product rate, both on random data."""
    path = ctx.work / "ceilings.json"
    if path.is_file():
        return json.loads(path.read_text())
    n_bytes = (2 << 30) if ctx.full else (64 << 20)
    src = torch.randn(n_bytes // 4, device=ctx.device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), ctx, repeat=10)
    copy_bw = 2 * n_bytes / (ms / 1e3)
    n = 8192 if ctx.full else 512
    dtype = torch.bfloat16 if ctx.device.startswith("cuda") else torch.float32
    a = torch.randn(n, n, device=ctx.device, dtype=dtype)
    b = torch.randn(n, n, device=ctx.device, dtype=dtype)
    ms = time_ms(lambda: a @ b, ctx, repeat=10)
    flops = 2 * n**3 / (ms / 1e3)
    ceilings = {"copy_bytes_per_s": copy_bw, "matmul_flops": flops, "matmul_dtype": str(dtype)}
    ctx.work.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(ceilings))
    return ceilings
