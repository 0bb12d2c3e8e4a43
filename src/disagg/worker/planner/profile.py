"""An engine's measured service times: what the planner and the autoscaling simulation run on.

Prefill seconds are linear in the prompt's tokens (compute-bound); a decode step's seconds are
interpolated from the measured batch sizes (memory-bound at small batches, so nearly flat at
first), measured at a short context (`decode_context` tokens per row), plus, for the context its
rows carry beyond that, `context_seconds_per_token` per token (attention reads every cached token
of every row: on a CPU core, summarization's ~1500-token contexts made a small model's decode
steps 25-60% slower than at 40 tokens). A KV transfer moves `kv_bytes_per_token` at
`transfer_bytes_per_second`.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Profile:
    prefill_fixed: float
    prefill_per_token: float
    decode_batches: np.ndarray
    decode_steps: np.ndarray
    kv_bytes_per_token: float = 0.0
    transfer_bytes_per_second: float = float("inf")
    context_seconds_per_token: float = 0.0  # 0: a profile that did not measure it
    decode_context: float = 0.0

    @classmethod
    def from_json(cls, data: dict) -> Profile:
        try:
            pts = np.array(data["prefill_seconds_by_tokens"], dtype=float)
            dec = np.array(data["decode_step_seconds_by_batch"], dtype=float)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(
                f"profile: needs prefill_seconds_by_tokens and decode_step_seconds_by_batch ({e})"
            ) from e
        if pts.ndim != 2 or len(pts) < 2 or dec.ndim != 2 or len(dec) < 2:
            raise ValueError("profile: needs at least two points for prefill and for decode")
        per_token, fixed = np.polyfit(pts[:, 0], pts[:, 1], 1)
        order = np.argsort(dec[:, 0])
        # A bigger batch never steps faster; a dip is noise from other processes on the machine.
        steps = np.maximum.accumulate(dec[order, 1])
        return cls(
            max(fixed, 0.0),
            max(per_token, 1e-7),
            dec[order, 0],
            steps,
            float(data.get("kv_bytes_per_token", 0.0)),
            float(data.get("transfer_bytes_per_second") or float("inf")),
            max(float(data.get("decode_seconds_per_context_token", 0.0)), 0.0),
            float(data.get("decode_context_tokens", 0.0)),
        )

    def prefill_seconds(self, tokens):
        return self.prefill_fixed + self.prefill_per_token * np.asarray(tokens, dtype=float)

    def step_seconds(self, batch):
        """Measured decode step time, interpolated, extrapolated linearly past the last point."""
        b, s = self.decode_batches, self.decode_steps
        slope = (s[-1] - s[-2]) / (b[-1] - b[-2])
        batch = np.asarray(batch, dtype=float)
        return np.where(batch <= b[-1], np.interp(batch, b, s), s[-1] + slope * (batch - b[-1]))

    def context_seconds(self, batch: int, context_tokens: float) -> float:
        """What a decode step of `batch` rows holding `context_tokens` in all adds to `step_seconds`."""
        return self.context_seconds_per_token * max(context_tokens - batch * self.decode_context, 0.0)

    def decode_seconds(self, batch: int, context_tokens: float) -> float:
        """One decode step of `batch` rows whose contexts sum to `context_tokens`."""
        return float(self.step_seconds(batch)) + self.context_seconds(batch, context_tokens)

    def transfer_seconds(self, tokens):
        return np.asarray(tokens, dtype=float) * self.kv_bytes_per_token / self.transfer_bytes_per_second

    def describe(self) -> str:
        steps = ", ".join(
            f"B={int(b)} {1e3 * s:.1f} ms"
            for b, s in zip(self.decode_batches, self.decode_steps, strict=True)
        )
        out = (f"prefill {1e3 * self.prefill_fixed:.1f} ms + {1e6 * self.prefill_per_token:.1f} us/token; "
               f"decode step {steps}")  # fmt: skip
        if self.context_seconds_per_token:
            out += (f" at {self.decode_context:.0f} tokens of context, + {1e6 * self.context_seconds_per_token:.2f}"
                    " us per further context token of each row")  # fmt: skip
        if self.kv_bytes_per_token:
            out += (f"; KV {self.kv_bytes_per_token / 1024:.1f} KiB/token at "
                    f"{self.transfer_bytes_per_second / 2**30:.2f} GiB/s")  # fmt: skip
        return out


def decode_step_seconds(
    engine, prompts: list[list[int]], steps: int, attempts: int = 2, clock=time.perf_counter
) -> float:
    """The fastest of `attempts` runs of `steps` decode steps over a batch of `prompts` (prefilled
    first, outside the timing), timed by `clock`."""
    from disagg.worker import SamplingParams

    runs = []
    for attempt in range(attempts):
        ids = [f"profile-{len(prompts)}-{attempt}-{i}" for i in range(len(prompts))]
        for rid, p in zip(ids, prompts, strict=True):
            engine.add_request(rid, p, SamplingParams(max_tokens=steps + 8, ignore_eos=True))
        started = set()
        while len(started) < len(prompts):  # prefill every request first
            started.update(o.request_id for o in engine.step())
        t0 = clock()
        for _ in range(steps):
            engine.step()
        runs.append((clock() - t0) / steps)
        for rid in ids:
            engine.abort(rid)
    return min(runs)


def measure(
    model_dir: str | Path,
    transfer_bytes_per_second: float | None = None,
    progress=None,
    clock=time.perf_counter,
) -> dict:
    """Prefill seconds vs prompt length and decode step seconds vs batch, on the real engine
    (the fastest of a few runs: other processes on the machine only ever add time), timed by
    `clock`."""
    from disagg.worker import LLM, SamplingParams

    say = progress or (lambda message: print(message, file=sys.stderr, flush=True))
    llm = LLM(model_dir, max_num_seqs=64, max_num_batched_tokens=4096, enable_prefix_caching=False)
    rng = np.random.default_rng(0)
    vocab = llm.engine.config.vocab_size

    def prompt(n: int) -> list[int]:
        return rng.integers(10, vocab - 10, size=n).tolist()

    llm.generate([prompt(64)], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    prefill = []
    for tokens in (64, 256, 512, 1024):
        runs = []
        for _ in range(3):
            t0 = clock()
            llm.generate([prompt(tokens)], SamplingParams(max_tokens=1, ignore_eos=True))
            runs.append(clock() - t0)
        prefill.append([tokens, min(runs)])
        say(f"  prefill {tokens:5d} tokens: {prefill[-1][1] * 1000:8.1f} ms")
    decode = []
    engine = llm.engine
    steps = 12
    for batch in (1, 4, 16, 32, 64):
        decode.append(
            [batch, decode_step_seconds(engine, [prompt(32) for _ in range(batch)], steps, clock=clock)]
        )
        say(f"  decode batch {batch:3d}: {decode[-1][1] * 1000:8.1f} ms/step")
    short_context = 32 + 1 + steps / 2  # the prompt, its first token, half the measured steps
    # the same batch of 4 over long prompts: what each further token of context costs a step
    long_prompt = min(1024, engine.max_model_len - steps - 16)
    long_step = decode_step_seconds(engine, [prompt(long_prompt) for _ in range(4)], steps, clock=clock)
    long_context = long_prompt + 1 + steps / 2
    per_context = max(long_step - dict(decode)[4], 0.0) / (4 * (long_context - short_context))
    say(f"  decode batch   4 at {long_context:.0f} tokens of context: {long_step * 1000:8.1f} ms/step")
    # all layers, K and V (and a quantized cache's scales)
    bytes_per_token = engine.model.kv_cache_block_bytes(engine.block_size) / engine.block_size
    return {
        "model": str(model_dir),
        "machine": f"{platform.machine()} cpus={len(os.sched_getaffinity(0))} load={os.getloadavg()[0]:.1f}",
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "prefill_seconds_by_tokens": prefill,
        "decode_step_seconds_by_batch": decode,
        "decode_context_tokens": short_context,
        "decode_seconds_per_context_token": per_context,
        "kv_bytes_per_token": bytes_per_token,
        "transfer_bytes_per_second": transfer_bytes_per_second,
    }


def load(path: str | Path) -> tuple[Profile, dict]:
    data = json.loads(Path(path).read_text())
    return Profile.from_json(data), data


def save(data: dict, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=2) + "\n")
