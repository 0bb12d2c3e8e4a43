"""`make gpu-check`: every GPU path of the product, proven in one command on a bare GPU machine.

    python bench/gpu/check.py --wheels .gpu/wheels                # on the GPU machine
    python bench/gpu/check.py --dry-run                           # lists the steps, runs none
    python bench/gpu/check.py --smoke --only kernels,engine       # the steps' code on a CPU, tiny shapes

With CUDA, it first installs the carried wheels (`make gpu-wheels`) into a private folder, then
runs each step in its own process, under its own time budget and within an overall deadline, so
that a failure, a hang or a poisoned CUDA context ends only that step. Each step's checks and
figures go to `gpu-check.json` and a table to `gpu-check.txt` in `--out`; the table is printed last.
Without CUDA (and without `--smoke`) it is a dry run: it lists the steps and exits 0 saying none ran.
The exit status is 1 when any step that ran failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@dataclass(frozen=True)
class Step:
    name: str
    title: str
    budget_s: int  # the step's process is killed past this
    module: str


STEPS = (
    Step("kernels", "Triton kernels vs torch twins (fp32/bf16/fp16, 8-bit; small and Llama-3-8B shapes)", 120, "step_kernels"),
    Step("graphs", "decode CUDA graphs: capture every bucket, replay = eager", 60, "step_graphs"),
    Step("pd", "prefill and decode processes on one GPU, KV GPU to GPU: output = colocated", 180, "step_pd"),
    Step("engine", "engine vs transformers on the GPU: greedy identical, ragged-workload throughput", 120, "step_engine"),
    Step("roofline", "decode step vs HBM floor (B=1, 64); 2048-token prefill vs bf16 matmul peak", 100, "step_roofline"),
    Step("spec_kvq", "speculative decoding and the 8-bit KV cache on the GPU", 80, "step_spec_kvq"),
    Step("kv_tiers", "KV tiers: VRAM -> pinned host -> disk and back bit for bit; copy rates", 120, "step_kv_tiers"),
    Step("real_model", "SmolLM2 GGUF: greedy = transformers, perplexity per precision, throughput", 240, "step_real_model"),
)  # fmt: skip


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def install_wheels(wheels: Path, site: Path) -> dict:
    """The carried wheels into `site` (a private --target folder put first on PYTHONPATH)."""
    files = sorted(str(w) for w in wheels.glob("*.whl"))
    if not files:
        return {"installed": [], "error": f"no wheels in {wheels}"}
    t = time.perf_counter()
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--upgrade", "--target", str(site), *files]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    return {
        "installed": [Path(f).name for f in files],
        "seconds": round(time.perf_counter() - t, 1),
        "error": done.stderr.strip()[-2000:] if done.returncode else "",
    }


def environment() -> dict:
    import torch

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            platform.processor(),
        ),  # fmt: skip
        "load_1min": os.getloadavg()[0],
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), sms=p.multi_processor_count,
                   cuda=torch.version.cuda)  # fmt: skip
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.sm,clocks.mem", "--format=csv,noheader"],
                             capture_output=True, text=True)  # fmt: skip
        env["nvidia_smi"] = smi.stdout.strip()
    return env


def run_step(step: Step, device: str, scale: str, work: Path, result: Path) -> None:
    """The child's side: run one step and write its record to `result`."""
    sys.path.insert(0, str(HERE))
    from common import Context

    ctx = Context(device=device, scale=scale, work=work)
    record: dict = {}
    try:
        module = __import__(step.module)
        r = module.run(ctx)
        record = {"status": "passed" if r.passed else "failed", **r.to_json()}
    except Exception as e:  # one step's failure is its own result, never the run's end
        record = {
            "status": "error",
            "error": f"{type(e).__name__}: {e}",
            "traceback": traceback.format_exc()[-4000:],
        }
        log(traceback.format_exc())
    result.write_text(json.dumps(record, indent=1, default=str))


def spawn(step: Step, args, env: dict, work: Path, remaining: float) -> dict:
    budget = min(step.budget_s * args.budget_scale, remaining)
    result = Path(tempfile.mkstemp(prefix=f"gpu-check-{step.name}-", suffix=".json")[1])
    cmd = [sys.executable, str(Path(__file__).resolve()), "--run-step", step.name, "--result", str(result),
           "--device", args.device, "--scale", args.scale, "--work", str(work)]  # fmt: skip
    log(f"== {step.name}: {step.title} (budget {budget:.0f} s)")
    t = time.perf_counter()
    try:
        subprocess.run(cmd, env=env, timeout=budget, check=False, start_new_session=True)
        record = json.loads(result.read_text() or "{}") or {
            "status": "error",
            "error": "the step wrote no result",
        }
    except subprocess.TimeoutExpired:
        record = {"status": "timeout", "error": f"over its budget of {budget:.0f} s"}
    except json.JSONDecodeError:
        record = {"status": "error", "error": "the step died before writing its result"}
    finally:
        result.unlink(missing_ok=True)
    record["seconds"] = round(time.perf_counter() - t, 1)
    log(f"== {step.name}: {record['status']} in {record['seconds']} s")
    return record


def table(report: dict) -> str:
    env = report["environment"]
    head = env.get("gpu") or "no GPU"
    lines = [f"gpu-check on {head} (torch {env.get('torch')}, triton {env.get('triton')}, CUDA {env.get('cuda')}); "
             f"host {env.get('cpu')}, load {env.get('load_1min', 0):.2f}"]  # fmt: skip
    if report.get("wheels"):
        w = report["wheels"]
        lines.append(
            f"wheels: {len(w['installed'])} installed in {w.get('seconds', 0)} s"
            + (f"; ERROR {w['error']}" if w.get("error") else "")
        )
    lines.append(f"{'step':<10} {'status':<8} {'time':>7}  checks")
    for name, rec in report["steps"].items():
        checks = rec.get("checks", [])
        passed = sum(c["passed"] for c in checks)
        lines.append(f"{name:<10} {rec['status']:<8} {rec.get('seconds', 0):>6.1f}s  {passed}/{len(checks)} passed"
                     + (f"  {rec['error']}" if rec.get("error") else ""))  # fmt: skip
        for c in checks:
            if not c["passed"]:
                lines.append(f"    FAIL {c['name']}: {c['detail']}")
        for f in rec.get("figures", []):
            lines.append(
                f"    {f['name']}: {f['value']:.4g} {f['unit']}"
                + (f"  ({f['detail']})" if f["detail"] else "")
            )
        for n in rec.get("notes", []):
            lines.append(f"    note: {n}")
    lines.append(report["summary"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / ".gpu" / "out"),
                   help="folder for gpu-check.json and gpu-check.txt (default: %(default)s)")  # fmt: skip
    p.add_argument("--wheels", default=None, help="carried wheel folder to install first (with CUDA only)")
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "disagg-gpu-check"),
                   help="models and shared measurements (default: %(default)s)")  # fmt: skip
    p.add_argument("--only", default="", help="comma-separated step names (default: all)")
    p.add_argument("--dry-run", action="store_true", help="list the steps, run none")
    p.add_argument("--smoke", action="store_true", help="run the steps on this machine's CPU at tiny shapes")
    p.add_argument(
        "--deadline", type=float, default=560.0, help="seconds for all steps (default: %(default)s)"
    )
    p.add_argument(
        "--budget-scale", type=float, default=1.0, help="multiply every step's budget (default: %(default)s)"
    )
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    p.add_argument("--scale", default="full", choices=("full", "smoke"), help=argparse.SUPPRESS)
    p.add_argument("--run-step", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    by_name = {s.name: s for s in STEPS}
    if args.run_step:
        run_step(by_name[args.run_step], args.device, args.scale, Path(args.work), Path(args.result))
        return 0
    only = [n for n in args.only.split(",") if n]
    unknown = [n for n in only if n not in by_name]
    if unknown:
        p.error(f"--only: unknown steps {unknown}; steps are {', '.join(by_name)}")
    steps = [s for s in STEPS if not only or s.name in only]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = cuda_available()
    if args.dry_run or not (gpu or args.smoke):
        why = "--dry-run" if args.dry_run else "no CUDA device"
        report = {"environment": {"python": platform.python_version()}, "ran": False,
                  "steps": {s.name: {"status": "not run", "title": s.title, "budget_s": s.budget_s} for s in steps}}  # fmt: skip
        report["summary"] = f"dry run ({why}): none of the {len(steps)} steps ran"
        (out / "gpu-check.json").write_text(json.dumps(report, indent=1))
        for s in steps:
            print(f"  {s.name:<10} not run  {s.title} (budget {s.budget_s} s)")
        print(report["summary"])
        return 0
    if args.smoke:
        args.device, args.scale = "cpu", "smoke"
    env = dict(os.environ)
    report: dict = {"ran": True}
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    (work / "ceilings.json").unlink(missing_ok=True)
    if args.wheels and gpu:
        site = work / "site"
        report["wheels"] = install_wheels(Path(args.wheels), site)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    if args.device == "cpu":  # the Triton kernels run in Triton's interpreter on a CPU
        env.update(TRITON_INTERPRET="1", DISAGG_KERNELS="triton")
    env["PYTHONUNBUFFERED"] = "1"
    report["environment"] = environment()
    start = time.monotonic()
    report["steps"] = {}
    for step in steps:
        remaining = args.deadline - (time.monotonic() - start)
        if remaining < 10:
            report["steps"][step.name] = {"status": "skipped", "error": "the run's deadline was reached"}
            continue
        report["steps"][step.name] = spawn(step, args, env, work, remaining)
    statuses = [rec["status"] for rec in report["steps"].values()]
    others = ", ".join(f"{n}: {r['status']}" for n, r in report["steps"].items() if r["status"] != "passed")
    report["summary"] = (
        f"{statuses.count('passed')} of {len(steps)} steps passed ({others or 'all'}) in {time.monotonic() - start:.0f} s"
    )
    (out / "gpu-check.json").write_text(json.dumps(report, indent=1, default=str))
    text = table(report)
    (out / "gpu-check.txt").write_text(text + "\n")
    print(text)
    return 0 if all(s == "passed" for s in statuses) else 1


if __name__ == "__main__":
    raise SystemExit(main())
