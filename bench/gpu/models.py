"""The checkpoints the GPU check runs, made once per run in its work folder.

`small`: the preset of `disagg make-model` (random weights, bf16). `llama3-8b-4l`: one Llama-3-8B
layer's shapes (hidden 4096, 32/8 heads of 128, intermediate 14336) four layers deep, with the
32000-token tokenizer: a decode step that reads 2.3 GB of weights, like a real model's, without
writing 16 GB to disk. `tiny-trained` and its draft are carried from the checkout (their training
takes a minute of CPU): held-out style prompts then have one clear greedy answer, which random
weights in bf16 do not.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
from pathlib import Path

from common import ROOT, log  # noqa: E402

CARRIED = ROOT / ".gpu" / "models"
TRAINED = ("tiny-trained", "tiny-trained-draft")


def ensure(name: str, work: Path) -> Path:
    """The directory of checkpoint `name` (small, llama3-8b-4l, tiny-trained, tiny-trained-draft)."""
    from disagg.worker.tools.make_model import PRESETS, make_model

    if name in TRAINED:
        for base in (CARRIED, ROOT / ".models"):
            if (base / name / "config.json").is_file():
                return base / name
        raise FileNotFoundError(f"{name}: not in {CARRIED}; `make gpu-wheels` puts it there")
    if name == "small":
        return make_model(work / name, preset="small", dtype="bfloat16", progress=log)
    if name == "llama3-8b-4l":
        spec = dataclasses.replace(
            PRESETS["small"], hidden_size=4096, intermediate_size=14336, num_hidden_layers=4,
            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
        )  # fmt: skip
        return make_model(work / name, preset=spec, dtype="bfloat16", progress=log)
    raise ValueError(f"unknown checkpoint {name!r}")


def carry() -> None:
    """`make gpu-wheels`: the trained tiny models (made under .models once) copied into .gpu/models."""
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_model import ensure_model

    for name in TRAINED:
        src = ensure_model(ROOT / ".models" / name, name)
        dst = CARRIED / name
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)
        log(f"{dst}: {sum(f.stat().st_size for f in dst.rglob('*') if f.is_file()) / 2**20:.1f} MiB")


if __name__ == "__main__":
    if sys.argv[1:] != ["--carry"]:
        raise SystemExit("usage: python bench/gpu/models.py --carry")
    carry()
