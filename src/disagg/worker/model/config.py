"""A Llama-family model's configuration, read from a Hugging Face checkpoint directory (no torch:
the router reads it too).

Reads `config.json` (written by transformers 4.x or 5.x: RoPE settings may be `rope_theta` +
`rope_scaling` or a single `rope_parameters` dict) and `generation_config.json` for the EOS ids, or
the same fields from a GGUF file's metadata (`gguf_checkpoint`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from disagg.worker.model import gguf_checkpoint

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: base theta plus optional frequency scaling ("linear" or "llama3")."""

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # q/k/v projections carry a bias (Qwen2; Llama with attention_bias)
    o_bias: bool  # o_proj carries a bias (Llama/Mistral with attention_bias)
    mlp_bias: bool
    qk_norm: bool  # per-head RMSNorm of q and k before RoPE (Qwen3)
    torch_dtype: str  # dtype the checkpoint was saved in
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    path: str = ""

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + output) this model serves correctly.

        Sliding-window attention is not implemented: within the window it equals full
        attention, so sequences are limited to the window instead.
        """
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @property
    def num_parameters(self) -> int:
        """Parameter count implied by the shapes (tied embeddings counted once)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        attn = h * (q + 2 * kv) + q * h
        if self.qkv_bias:
            attn += q + 2 * kv
        if self.o_bias:
            attn += h
        mlp = 3 * h * i + (2 * i + h if self.mlp_bias else 0)
        per_layer = attn + mlp + 2 * h + (2 * d if self.qk_norm else 0)
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + embed + h

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if gguf_checkpoint.is_gguf(path):
            return cls.from_dict(gguf_checkpoint.open_gguf(path).config_dict(), path=str(path))
        if not path.is_dir():
            raise FileNotFoundError(f"model directory not found: {path}")
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"config.json not found in model directory {path}")
        raw = json.loads(config_file.read_text())
        gen_file = path / "generation_config.json"
        generation = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
        return cls.from_dict(raw, generation, str(path))

    @classmethod
    def from_dict(cls, raw: dict, generation: dict | None = None, path: str = "") -> ModelConfig:
        generation = generation or {}
        architectures = raw.get("architectures") or []
        arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            got = ", ".join(architectures) if architectures else "none given"
            raise ValueError(
                f"unsupported architecture in config.json ({got}); supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.json hidden_act must be 'silu', got {act!r}")

        def req(name: str):
            if raw.get(name) is None:
                raise ValueError(f"config.json is missing the field {name!r}")
            return raw[name]

        hidden = int(req("hidden_size"))
        heads = int(req("num_attention_heads"))
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise ValueError(
                f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
            )
        attention_bias = bool(raw.get("attention_bias", False))
        is_qwen2 = arch == "Qwen2ForCausalLM"  # q/k/v always biased, o_proj never
        sliding = raw.get("sliding_window")
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not raw.get("use_sliding_window", False):
            sliding = None
        return cls(
            architecture=arch,
            vocab_size=int(req("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(req("intermediate_size")),
            num_hidden_layers=int(req("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=parse_rope(raw),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=(not is_qwen2) and attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=generation.get("bos_token_id", raw.get("bos_token_id")),
            eos_token_ids=_id_tuple(generation.get("eos_token_id", raw.get("eos_token_id"))),
            path=path,
        )


def _id_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def parse_rope(raw: dict) -> RopeConfig:
    """RoPE settings from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling`."""
    params = dict(raw.get("rope_scaling") or {})
    if raw.get("rope_parameters"):
        params = {**params, **raw["rope_parameters"]}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope scaling type {kind!r} in config.json; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if kind == "default":
        return RopeConfig(theta=theta)

    def need(name: str):
        if params.get(name) is None:
            raise ValueError(f"rope scaling of type {kind!r} needs the field {name!r}")
        return params[name]

    if kind == "linear":
        return RopeConfig(theta=theta, type="linear", factor=float(need("factor")))
    return RopeConfig(
        theta=theta,
        type="llama3",
        factor=float(need("factor")),
        low_freq_factor=float(need("low_freq_factor")),
        high_freq_factor=float(need("high_freq_factor")),
        original_max_position_embeddings=int(need("original_max_position_embeddings")),
    )
