"""`EngineArgs`: every engine setting, its default, its help text and its validation, in one place.

`LLM(...)` and `LLMEngine(...)` take these settings as keywords (or an `EngineArgs`); the `worker`,
`generate` and `up` commands generate their flags from the fields here (`add_cli_args`), and the
operator names the flags it puts on pods through `cli_flag`, so a setting cannot mean one thing in
one place and another elsewhere. Standard library only: the operator imports it without torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from disagg.worker.engine.settings import ENV_PREFIX, Settings
from disagg.worker.engine.settings import env_name as env_name
from disagg.worker.engine.settings import setting as _setting
from disagg.worker.model.precisions import DTYPES, KV_CACHE_DTYPES, QUANTIZATIONS

__all__ = ["DTYPES", "ENV_PREFIX", "KV_CACHE_DTYPES", "QUANTIZATIONS", "SPECULATIVE_METHODS", "EngineArgs"]

SPECULATIVE_METHODS = ("ngram", "draft")


@dataclass
class EngineArgs(Settings):
    GROUP = "engine"
    CLI_EXCLUDED = ("model",)  # a command names its model itself

    model: str = field(
        default="",
        metadata={"help": "model directory (config.json, *.safetensors, tokenizer.json) or a GGUF file"},
    )
    dtype: str = _setting(
        "auto",
        "weights and activations; auto: the checkpoint's own torch_dtype (float32 when it names none we run)",
        choices=("auto", *DTYPES),
    )
    quantization: str = _setting(
        "auto",
        "weights of the layers' matmuls: int8 (per-channel scales, activations stay in dtype) or fp8 "
        "(e4m3, per-channel scales); auto: the checkpoint's own (compressed-tensors), else none",
        choices=("auto", "none", *QUANTIZATIONS),
    )
    kv_cache_dtype: str = _setting(
        "auto",
        "how the KV cache stores K and V: int8 or fp8 (e4m3), one float32 scale per token and KV head "
        "kept inside each block; auto: the model's dtype",
        choices=("auto", *KV_CACHE_DTYPES),
    )
    device: str = _setting("auto", "cpu, cuda or cuda:N; auto: cuda when a GPU is visible, else cpu")
    block_size: int = _setting(16, "tokens per KV-cache block", minimum=1)
    max_num_seqs: int = _setting(256, "most sequences in one decode batch", minimum=1)
    max_num_batched_tokens: int = _setting(2048, "token budget of one prefill step (longer prompts are chunked)",
                                           minimum=1)  # fmt: skip
    max_model_len: int | None = _setting(None, "longest sequence (prompt + output); default: the model's limit",
                                         minimum=2)  # fmt: skip
    enable_prefix_caching: bool = _setting(True, "reuse the KV blocks of prompt prefixes already computed")
    mixed_steps: bool = _setting(
        True,
        "a step carries every running request's next token and, in the rest of the token budget, prompt "
        "chunks (decode is never starved, prompts progress every step); off: decode and prefill steps alternate",
    )
    num_gpu_blocks: int | None = _setting(
        None, "KV-cache blocks to allocate (overrides kv_cache_memory and gpu_memory_utilization)", minimum=1
    )
    kv_cache_memory: int | None = _setting(
        None, "bytes for the KV cache (overrides gpu_memory_utilization)", minimum=1
    )
    gpu_memory_utilization: float = _setting(
        0.9,
        "share of the accelerator's free memory (after the weights) the KV cache takes; "
        "on CPU the cache is sized from host memory",
        minimum=0.0,
        maximum=1.0,
        exclusive_min=True,
    )
    kv_host_cache_memory: int | None = _setting(
        None,
        "bytes of host memory (page-locked on CUDA) for prefix-cache blocks evicted from the KV cache; "
        "a later prompt with their prefix copies them back instead of recomputing; default: off",
        minimum=1,
    )
    kv_disk_cache_dir: str | None = _setting(
        None,
        "a local directory (this engine's alone: locked, emptied at start and exit) for the blocks the "
        "host tier evicts, one checksummed file each; needs kv_host_cache_memory; default: off",
    )
    kv_disk_cache_size: int = _setting(8 << 30, "bytes the disk tier may hold", minimum=1)
    cuda_graphs: bool | None = _setting(None, "capture decode steps as CUDA graphs (default: on CUDA)")
    seed: int = _setting(0, "seed of the per-request seeds of unseeded sampled requests")
    threads: int | None = _setting(
        None,
        "torch intra-op threads on CPU (default: torch's choice; with tensor_parallel_size N, each rank "
        "takes 1/N of the cores)",
        minimum=1,
    )
    tensor_parallel_size: int = _setting(
        1,
        "ranks the model is split over (one process each, one GPU each on CUDA); heads, MLP features "
        "and vocabulary are divided among them",
        minimum=1,
    )
    tensor_parallel_local_ranks: int | None = _setting(
        None,
        "ranks this worker runs on its own host (rank 0 and the next ones); the others join from other "
        "hosts with `disagg tp-ranks`, authenticated with the internal credential; default: all",
        minimum=1,
    )
    tensor_parallel_port: int = _setting(
        29500,
        "with ranks on other hosts: the port they connect to, on every interface (the rendezvous store "
        "takes the next one)",
        minimum=1,
        maximum=65534,
    )
    tensor_parallel_join_timeout: float = _setting(
        600.0,
        "seconds the worker waits for its ranks on other hosts to join",
        minimum=0.0,
        exclusive_min=True,
    )
    speculative_method: str | None = _setting(
        None,
        "speculative decoding: ngram (prompt lookup in the prompt and output) or draft (a smaller "
        "model with the same tokenizer, speculative_draft_model); default: off",
        choices=SPECULATIVE_METHODS,
    )
    num_speculative_tokens: int = _setting(4, "tokens proposed per sequence and verified in one pass",
                                           minimum=1, maximum=16)  # fmt: skip
    speculative_draft_model: str | None = _setting(None, "draft model directory (speculative_method draft)")
    speculative_ngram_min: int = _setting(1, "shortest n-gram the ngram proposer matches", minimum=1)
    speculative_ngram_max: int = _setting(
        4, "longest n-gram the ngram proposer matches (tried first)", minimum=1
    )
    speculative_max_batch: int = _setting(
        8,
        "decode steps of more sequences than this are not speculated (verifying costs more there)",
        minimum=1,
    )
    speculative_adaptive: bool = _setting(
        True,
        "time verify steps at start-up and speculate only as far as it is measured to be faster than "
        "plain decoding (off: always propose num_speculative_tokens)",
    )
    speculative_min_acceptance: float = _setting(
        0.1,
        "a request whose recent share of accepted proposals falls below this pauses speculating",
        minimum=0.0,
        maximum=1.0,
    )

    def __post_init__(self):
        self.model = str(self.model)
        self.check()
        if self.num_gpu_blocks is not None and self.kv_cache_memory is not None:
            raise ValueError("set at most one of num_gpu_blocks and kv_cache_memory")
        if self.speculative_method == "draft" and not self.speculative_draft_model:
            raise ValueError("speculative_draft_model must be set when speculative_method is draft")
        if self.speculative_draft_model and self.speculative_method != "draft":
            raise ValueError("speculative_draft_model is only used with speculative_method draft")
        local = self.tensor_parallel_local_ranks
        if local is not None and local > self.tensor_parallel_size:
            raise ValueError(
                f"tensor_parallel_local_ranks must be <= tensor_parallel_size ({self.tensor_parallel_size}), "
                f"got {local}"
            )
        if self.tensor_parallel_size > 1 and self.speculative_method is not None:
            raise ValueError(
                "speculative_method: speculative decoding is not supported with tensor_parallel_size > 1 yet"
            )
        if self.tensor_parallel_size > 1 and self.quantization in QUANTIZATIONS:
            raise ValueError(
                "quantization: 8-bit weights are not supported with tensor_parallel_size > 1 yet"
            )
        if self.tensor_parallel_size > 1 and self.kv_cache_dtype in KV_CACHE_DTYPES:
            raise ValueError(
                "kv_cache_dtype: a quantized KV cache is not supported with tensor_parallel_size > 1 yet"
            )
        if self.kv_disk_cache_dir and self.kv_host_cache_memory is None:
            raise ValueError(
                "kv_disk_cache_dir needs kv_host_cache_memory: blocks reach the disk through host memory"
            )
        if self.tensor_parallel_size > 1 and self.kv_host_cache_memory is not None:
            raise ValueError(
                "kv_host_cache_memory: KV tiers are not supported with tensor_parallel_size > 1 yet"
            )
        if self.kv_host_cache_memory is not None and not self.enable_prefix_caching:
            raise ValueError(
                "kv_host_cache_memory needs enable_prefix_caching: the tiers keep prefix-cache blocks"
            )
        if self.speculative_ngram_min > self.speculative_ngram_max:
            raise ValueError(
                f"speculative_ngram_min must be <= speculative_ngram_max ({self.speculative_ngram_max}), "
                f"got {self.speculative_ngram_min}"
            )

    def without_speculation(self) -> EngineArgs:
        """These settings for a prefill worker, which never decodes (no draft model to load)."""
        return dataclasses.replace(self, speculative_method=None, speculative_draft_model=None)

    # ---- resolution of the "auto" values -----------------------------------------------
    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return checkpoint_dtype(Path(self.model))

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    # ---- command lines -----------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, *, model: bool = True, env: bool = False,
                     defaults: dict[str, Any] | None = None) -> None:  # fmt: skip
        """One flag per setting (`--block-size` for `block_size`); with `env`, DISAGG_BLOCK_SIZE
        gives the default (what a pod's environment sets)."""
        super().add_cli_args(parser, env=env, skip=() if model else ("model",), defaults=defaults)


def cli_flag(name: str) -> str:
    """The command-line flag of a setting; refuses names that are not settings."""
    return EngineArgs.cli_flag(name)


def default(name: str) -> Any:
    return EngineArgs.default(name)


def checkpoint_dtype(model_dir: Path) -> str:
    """The dtype a checkpoint declares (config.json's torch_dtype or dtype), float32 when it names
    none the engine runs."""
    config = model_dir / "config.json"
    raw = json.loads(config.read_text()) if config.is_file() else {}
    # transformers 5 writes `dtype`, 4.x `torch_dtype`: the same precedence as ModelConfig
    name = str(raw.get("dtype") or raw.get("torch_dtype") or "float32").removeprefix("torch.")
    return name if name in DTYPES else "float32"
