"""Fixtures of the worker tests (the kernel tests import the checkpoints too).

Tiny random Llama, Qwen2, Qwen3 and Mistral checkpoints built with `transformers` (no downloads).
Each is float32, hidden 64, 2 layers, 4 query heads / 2 KV heads, saved with safetensors next to
the project's own byte-level BPE tokenizer files. Weights are drawn wider than the usual 0.02 and
norms/biases are perturbed, so attention is sharp and a wrong position, head or bias shows up in
the logits instead of vanishing in near-uniform softmaxes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from disagg.worker.model.forward_batch import ForwardBatch
from disagg.worker.tools.make_model import write_tokenizer

TINY_VOCAB = 512
_COMMON = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))


def save_hf_model(config, path: Path, seed: int = 0, max_shard_size: str | None = None) -> Path:
    """Build `config`'s causal LM with transformers, randomize it, save it with a tokenizer."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    ids = write_tokenizer(path, config.vocab_size)
    gen = {"bos_token_id": ids["bos_token_id"], "eos_token_id": [ids["eos_token_id"], ids["eot_token_id"]]}
    (path / "generation_config.json").write_text(json.dumps(gen) + "\n")
    return path


def llama_config(**overrides):
    from transformers import LlamaConfig

    kwargs = dict(
        _COMMON,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        rope_theta=10000.0,
        bos_token_id=0,
        eos_token_id=1,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def qwen2_config(**overrides):
    from transformers import Qwen2Config

    kwargs = dict(_COMMON, tie_word_embeddings=True, rope_theta=1000000.0, bos_token_id=0, eos_token_id=1)
    kwargs.update(overrides)
    return Qwen2Config(**kwargs)


def qwen3_config(**overrides):
    """head_dim 32 with 4 heads in hidden 64: q/o projections wider than the model, as Qwen3's are."""
    from transformers import Qwen3Config

    kwargs = dict(
        _COMMON, head_dim=32, tie_word_embeddings=False, rope_theta=1000000.0, bos_token_id=0, eos_token_id=1
    )
    kwargs.update(overrides)
    return Qwen3Config(**kwargs)


def mistral_config(**overrides):
    from transformers import MistralConfig

    kwargs = dict(
        _COMMON,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        sliding_window=128,
        bos_token_id=0,
        eos_token_id=1,
    )
    kwargs.update(overrides)
    return MistralConfig(**kwargs)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """Llama with llama3 rope scaling, untied embeddings, GQA."""
    return save_hf_model(llama_config(), tmp_path_factory.mktemp("tiny-llama"), seed=1)


@pytest.fixture(scope="session")
def tiny_llama_sharded_dir(tmp_path_factory) -> Path:
    """The same weights as `tiny_llama_dir`, split across several safetensors shards + index."""
    return save_hf_model(
        llama_config(), tmp_path_factory.mktemp("tiny-llama-sharded"), seed=1, max_shard_size="100KB"
    )


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    """Qwen2: q/k/v bias, tied embeddings."""
    return save_hf_model(qwen2_config(), tmp_path_factory.mktemp("tiny-qwen2"), seed=2)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> Path:
    """Qwen3: per-head q/k RMSNorm, no biases, head_dim * heads != hidden."""
    return save_hf_model(qwen3_config(), tmp_path_factory.mktemp("tiny-qwen3"), seed=4)


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory) -> Path:
    """Mistral with a sliding window larger than any test sequence."""
    return save_hf_model(mistral_config(), tmp_path_factory.mktemp("tiny-mistral"), seed=3)


@pytest.fixture(scope="session", params=["llama", "qwen2", "mistral"])
def tiny_model_dir(request) -> Path:
    """Each of the three tiny architectures in turn."""
    return request.getfixturevalue(f"tiny_{request.param}_dir")


def load_hf_model(path: str | Path, dtype: torch.dtype = torch.float32):
    """The transformers model saved in `path`, in eval mode, for comparisons."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@pytest.fixture(scope="session")
def hf_model():
    """`hf_model(path, dtype=torch.float32)`: load the transformers model saved in `path`."""
    return load_hf_model


class PagedSequences:
    """Tracks each sequence's length and block table, and packs steps into ForwardBatches."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.next_block = 0
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    @property
    def blocks_used(self) -> int:
        return self.next_block

    def _slot(self, seq: int, pos: int) -> int:
        table = self.tables.setdefault(seq, [])
        while len(table) <= pos // self.block_size:
            table.append(self.next_block)
            self.next_block += 1
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _pack(self, steps: list[tuple[int, list[int]]], is_prefill: bool) -> ForwardBatch:
        ids, positions, slots, seq_lens, cu = [], [], [], [], [0]
        for seq, tokens in steps:
            start = self.lens.get(seq, 0)
            for j, tok in enumerate(tokens):
                ids.append(tok)
                positions.append(start + j)
                slots.append(self._slot(seq, start + j))
            self.lens[seq] = start + len(tokens)
            seq_lens.append(self.lens[seq])
            cu.append(cu[-1] + len(tokens))
        width = max(len(self.tables[seq]) for seq, _ in steps)
        tables = [self.tables[seq] + [0] * (width - len(self.tables[seq])) for seq, _ in steps]
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            logits_indices=torch.tensor(cu[1:], dtype=torch.int64) - 1,
            is_prefill=is_prefill,
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32) if is_prefill else None,
        )

    def prefill(self, chunks: list[tuple[int, list[int]]]) -> ForwardBatch:
        """One packed prefill step: (sequence id, next chunk of its prompt) per sequence."""
        return self._pack(chunks, is_prefill=True)

    def decode(self, tokens: list[tuple[int, int]]) -> ForwardBatch:
        """One decode step: (sequence id, its next token) per sequence."""
        return self._pack([(seq, [tok]) for seq, tok in tokens], is_prefill=False)


@pytest.fixture
def paged():
    """`paged(block_size)`: a fresh PagedSequences (hand-built ForwardBatches, sequential blocks)."""
    return PagedSequences


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules that run tiny models: they gain nothing from intra-op threads, and on a busy
    machine spinning worker threads make every op many times slower. Restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---- the `make_model` tiny preset: what the router, serving and cli tests serve -----------------


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from disagg.worker.tools.make_model import make_model

    return make_model(tmp_path_factory.mktemp("models") / "tiny", preset="tiny")


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    """The tiny model's tokenizer, for the router's in-process tests."""
    from disagg.worker.engine.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="session")
def reference_llm(tiny_model):
    """The colocated engine in this process: what every served output must equal."""
    import torch

    from disagg.worker import LLM

    torch.set_num_threads(1)
    return LLM(model=str(tiny_model), num_gpu_blocks=512)
