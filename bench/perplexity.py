"""Perplexity of one fixed real text under each weight and KV-cache precision, as ratios to float32.

    python bench/perplexity.py                      # the default model (SmolLM2-135M-Instruct GGUF)
    python bench/perplexity.py --model DIR_OR_GGUF --text FILE
    python bench/perplexity.py --llama-cpp LLAMA_CPP/build/bin    # and llama.cpp's F32, Q8_0, file type

The text (`bench/data/perplexity.txt`: prose from this project's README, Apache-2.0) is scored
in one prefill step, every position's logits kept: perplexity is exp of the mean negative
log-likelihood of each next token, and the mean KL divergence KL(float32 || setting) over
positions says how far each setting's whole next-token distribution moved, which perplexity on
one text can hide. The weights all come from the same checkpoint (for a GGUF: dequantized, so
float32 is the file's own values and the 8-bit settings requantize them per output channel).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from machine import cpu_name  # noqa: E402

from disagg.worker.engine.tokenizer import Tokenizer
from disagg.worker.model.forward_batch import ForwardBatch
from disagg.worker.model.loader import load_model
from disagg.worker.model.pretrained import require_default_model

TEXT = Path(__file__).resolve().parent / "data" / "perplexity.txt"
BLOCK = 16
# (label, dtype, weight quantization, KV cache dtype); float32 first: the others are its ratios
SETTINGS = (
    ("float32", "float32", "none", "auto"),
    ("bf16", "bfloat16", "none", "auto"),
    ("int8 weights", "float32", "int8", "auto"),
    ("fp8 weights", "float32", "fp8", "auto"),
    ("int8 KV cache", "float32", "none", "int8"),
    ("fp8 KV cache", "float32", "none", "fp8"),
)


def one_sequence_prefill(ids: list[int]) -> ForwardBatch:
    """The whole text as one prefill step of one sequence, logits at every position."""
    n = len(ids)
    blocks = math.ceil(n / BLOCK)
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.arange(n, dtype=torch.int64),
        slot_mapping=torch.arange(n, dtype=torch.int64),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        logits_indices=torch.arange(n, dtype=torch.int64),
        is_prefill=True,
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
    )


def log_probs(
    model_path: str, ids: list[int], dtype: str, quantization: str, kv: str, device: str = "cpu"
) -> torch.Tensor:
    """[len(ids) - 1, vocab] float32 log-probabilities of each next token under one setting."""
    model, _ = load_model(model_path, dtype=dtype, device=device, quantization_setting=quantization)
    model.use_kv_cache_dtype(kv)
    cache = model.allocate_kv_cache(math.ceil(len(ids) / BLOCK), BLOCK)
    with torch.inference_mode():
        logits = model.forward(one_sequence_prefill(ids).to(device), cache)
    return F.log_softmax(logits[:-1].float(), dim=-1)


def llama_cpp_rows(bin_dir: Path, model: str, text: Path) -> None:
    """llama.cpp's own perplexity of the same GGUF on the same text, for its F32, Q8_0 and the
    file's own type (requantized from the file: the same weights as the rows above). Its tool
    scores 128-token windows' second halves, not one pass over the text, so only its ratios to
    its own F32 compare with the ratios above."""
    env = {**os.environ, "LD_LIBRARY_PATH": str(bin_dir)}
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        own = Path(model).stem.rsplit(".", 1)[-1]  # the file's own type, e.g. Q4_1
        files = {
            "F32": Path(tmp) / "f32.gguf",
            "Q8_0": Path(tmp) / "q8_0.gguf",
            f"{own} (the file)": Path(model),
        }
        for kind in ("F32", "Q8_0"):
            subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize", model, str(files[kind]), kind],
                           check=True, capture_output=True, env=env)  # fmt: skip
        for label, path in files.items():
            run = subprocess.run(
                [str(bin_dir / "llama-perplexity"), "-m", str(path), "-f", str(text), "-c", "128", "-b", "128",
                 "-t", str(os.cpu_count() or 1)],
                check=True, capture_output=True, text=True, env=env,
            )  # fmt: skip
            found = re.search(r"Final estimate: PPL = ([0-9.]+)", run.stdout + run.stderr)
            out[label] = float(found.group(1))
    print(f"\nllama.cpp ({bin_dir}), 128-token windows:")
    for label, ppl in out.items():
        print(f"{'llama.cpp ' + label:<28}{ppl:>12.3f}{ppl / out['F32']:>9.4f}{os.getloadavg()[0]:>18.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint directory or GGUF file (default: the installed SmolLM2)")
    p.add_argument("--text", type=Path, default=TEXT)
    p.add_argument("--max-tokens", type=int, default=1024, help="score at most this many tokens")
    p.add_argument("--llama-cpp", type=Path, metavar="BIN_DIR",
                   help="a llama.cpp build's bin folder (llama-perplexity, llama-quantize): add its rows for a GGUF")  # fmt: skip
    args = p.parse_args()
    model = args.model or str(require_default_model())
    ids = Tokenizer.from_pretrained(model).encode(args.text.read_text())[: args.max_tokens]
    targets = torch.tensor(ids[1:])
    print(f"model {model}\ntext {args.text} ({len(ids)} tokens)\ncpu {cpu_name()}, {os.cpu_count()} cores")
    print(f"\n{'setting':<16}{'perplexity':>12}{'ratio':>9}{'mean KL':>11}{'load':>7}{'seconds':>9}")
    reference = None
    for label, dtype, quantization, kv in SETTINGS:
        start = time.perf_counter()
        lp = log_probs(model, ids, dtype, quantization, kv)
        seconds = time.perf_counter() - start
        ppl = math.exp(-lp.gather(1, targets[:, None]).mean().item())
        if reference is None:
            reference = (lp, ppl)
        ref_lp, ref_ppl = reference
        kl = (ref_lp.exp() * (ref_lp - lp)).sum(-1).mean().item()
        load = os.getloadavg()[0]
        print(
            f"{label:<16}{ppl:>12.3f}{ppl / ref_ppl:>9.4f}{kl:>11.5f}{load:>7.2f}{seconds:>9.1f}", flush=True
        )
    if args.llama_cpp is not None:
        llama_cpp_rows(args.llama_cpp, model, args.text)


if __name__ == "__main__":
    main()
