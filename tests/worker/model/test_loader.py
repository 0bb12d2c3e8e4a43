"""Checkpoint loading: sharded files, tied embeddings, dtypes, config variants, clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from disagg.worker.model.config import ModelConfig, parse_rope
from disagg.worker.model.llama import rope_inv_freq
from disagg.worker.model.loader import load_model

BLOCK = 16


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _logits(model, paged, ids):
    return model.forward(paged(BLOCK).prefill([(0, ids)]), model.allocate_kv_cache(4, BLOCK))


def test_sharded_equals_unsharded(tiny_llama_dir, tiny_llama_sharded_dir, paged):
    assert (tiny_llama_sharded_dir / "model.safetensors.index.json").is_file()
    assert len(list(tiny_llama_sharded_dir.glob("model-*.safetensors"))) > 1
    single, _ = load_model(tiny_llama_dir)
    sharded, _ = load_model(tiny_llama_sharded_dir)
    for a, b in zip(single.weights.layers, sharded.weights.layers, strict=True):
        for name in ("qkv", "o", "gate_up", "down", "input_norm", "post_norm"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert torch.equal(single.weights.lm_head, sharded.weights.lm_head)
    ids = list(range(3, 40))
    assert torch.equal(_logits(single, paged, ids), _logits(sharded, paged, ids))


def test_tied_and_untied_heads(tiny_qwen2_dir, tiny_llama_dir):
    qwen, config = load_model(tiny_qwen2_dir)
    assert config.tie_word_embeddings and config.qkv_bias and not config.o_bias
    assert qwen.weights.lm_head is qwen.weights.embed
    assert qwen.weights.layers[0].qkv_bias.shape == ((4 + 2 + 2) * 16,)
    llama, _ = load_model(tiny_llama_dir)
    assert llama.weights.lm_head is not llama.weights.embed
    assert llama.weights.layers[0].qkv_bias is None
    # int8 quantizes a tied head into its own copy (lookups keep the table); fp8 keeps the table as the head
    int8, _ = load_model(tiny_qwen2_dir, quantization_setting="int8")
    assert int8.weights.lm_head.scheme == "int8" and int8.weights.embed.dtype == torch.float32
    fp8, _ = load_model(tiny_qwen2_dir, quantization_setting="fp8")
    assert fp8.weights.layers[0].qkv.scheme == "fp8" and fp8.weights.lm_head is fp8.weights.embed


def test_dtype_conversion(tiny_llama_dir):
    model, _ = load_model(tiny_llama_dir, dtype="float16")
    assert model.weights.layers[1].gate_up.dtype == torch.float16
    assert model.weights.layers[1].gate_up.shape == (2 * 128, 64)
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, float16, got 'int8'"):
        load_model(tiny_llama_dir, dtype="int8")


def test_missing_and_unexpected_tensors_are_named(tiny_llama_dir, tmp_path):
    ckpt = _copy(tiny_llama_dir, tmp_path / "ckpt")
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\): model.layers.1.mlp.up_proj.weight"):
        load_model(ckpt)

    tensors = load_file(tiny_llama_dir / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # ignored buffer
    tensors["model.layers.0.extra.weight"] = torch.ones(2)
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(ValueError, match=r"1 unexpected tensor\(s\): model.layers.0.extra.weight"):
        load_model(ckpt)

    tensors = load_file(tiny_llama_dir / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(65)
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \(65,\), config.json implies \(64,\)"):
        load_model(ckpt)


def test_unsupported_architecture_is_named(tiny_llama_dir, tmp_path):
    ckpt = _copy(tiny_llama_dir, tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM, MistralForCausalLM"):
        load_model(ckpt)


def test_missing_files_are_named(tiny_llama_sharded_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        load_model(tmp_path / "absent")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        load_model(empty)
    shutil.copy(tiny_llama_sharded_dir / "config.json", empty / "config.json")
    with pytest.raises(FileNotFoundError, match="expected model.safetensors or model.safetensors.index.json"):
        load_model(empty)
    ckpt = _copy(tiny_llama_sharded_dir, tmp_path / "sharded")
    (ckpt / "model-00002-of-00006.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00006.safetensors"):
        load_model(ckpt)


_BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def test_config_fields_and_defaults():
    config = ModelConfig.from_dict({**_BASE, "eos_token_id": 7, "torch_dtype": "bfloat16"})
    assert config.num_key_value_heads == 4 and config.head_dim == 16
    assert config.eos_token_ids == (7,) and config.torch_dtype == "bfloat16"
    assert config.rope.type == "default" and config.rope.theta == 10000.0
    config = ModelConfig.from_dict({**_BASE, "eos_token_id": 7, "dtype": "float16"}, {"eos_token_id": [7, 9]})
    assert config.eos_token_ids == (7, 9) and config.torch_dtype == "float16"
    with pytest.raises(ValueError, match="missing the field 'intermediate_size'"):
        ModelConfig.from_dict({k: v for k, v in _BASE.items() if k != "intermediate_size"})
    with pytest.raises(ValueError, match="hidden_act must be 'silu'"):
        ModelConfig.from_dict({**_BASE, "hidden_act": "gelu"})


def test_sliding_window_limits_the_context(tiny_mistral_dir):
    config = ModelConfig.from_pretrained(tiny_mistral_dir)
    assert config.sliding_window == 128 and config.max_model_len == 128
    qwen = ModelConfig.from_dict({**_BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 32})
    assert qwen.sliding_window is None  # Qwen2 only slides with use_sliding_window


@pytest.mark.parametrize(
    "raw",
    [
        {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 4.0}},  # transformers 4.x
        {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5}},  # transformers 5.x
    ],
)
def test_rope_both_config_styles(raw):
    rope = parse_rope(raw)
    assert (rope.type, rope.factor, rope.theta) == ("linear", 4.0, 5e5)


def test_rope_errors():
    with pytest.raises(ValueError, match="unsupported rope scaling type 'yarn'.*default, linear, llama3"):
        parse_rope({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="needs the field 'low_freq_factor'"):
        parse_rope({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}})


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 3.0}])
def test_rope_frequencies_match_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_config = LlamaConfig(**{k: v for k, v in _BASE.items() if k != "architectures"}, rope_scaling=scaling)
    ours = ModelConfig.from_dict({**_BASE, **json.loads(hf_config.to_json_string())})
    expected = LlamaRotaryEmbedding(hf_config).inv_freq
    torch.testing.assert_close(rope_inv_freq(ours.rope, ours.head_dim), expected, atol=0, rtol=0)
