"""`disagg make-model`: checkpoints transformers can load, matched by our loader, deterministic."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from disagg.worker.cli import main as cli_main
from disagg.worker.engine.tokenizer import Tokenizer
from disagg.worker.model.config import ModelConfig
from disagg.worker.model.loader import load_model
from disagg.worker.tools.make_model import PRESETS, count_parameters, make_model, model_config

BLOCK = 16


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("made") / "tiny", preset="tiny", seed=0)


def _greedy(model, paged, ids: list[int], steps: int) -> list[int]:
    seqs = paged(BLOCK)
    kv = model.allocate_kv_cache(16, BLOCK)
    logits = model.forward(seqs.prefill([(0, ids)]), kv)
    out = []
    for _ in range(steps):
        out.append(int(logits[0].argmax()))
        logits = model.forward(seqs.decode([(0, out[-1])]), kv)
    return out


def test_tiny_checkpoint_loads_in_transformers_and_matches(tiny_dir, hf_model, paged):
    model, config = load_model(tiny_dir)
    spec = PRESETS["tiny"]
    assert (config.architecture, config.hidden_size, config.num_hidden_layers) == ("LlamaForCausalLM", 128, 4)
    assert config.num_key_value_heads < config.num_attention_heads and config.vocab_size >= 512
    tokenizer = Tokenizer.from_pretrained(tiny_dir)
    assert tokenizer.vocab_size == config.vocab_size == spec.vocab_size
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about foxes."}])
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    hf = hf_model(tiny_dir)
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0, -1]
    logits = model.forward(paged(BLOCK).prefill([(0, ids)]), model.allocate_kv_cache(8, BLOCK))
    torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=1e-4)


def test_tiny_generations_are_not_degenerate(tiny_dir, paged):
    model, _ = load_model(tiny_dir)
    tokenizer = Tokenizer.from_pretrained(tiny_dir)
    for text in ("Hello", "What is the capital of France?"):
        out = _greedy(model, paged, tokenizer.encode(text), 32)
        assert len(set(out)) >= 10, out
        assert len(set(out[-16:])) >= 4, out  # not stuck in a short loop either


def test_deterministic_for_a_seed(tiny_dir, tmp_path):
    again = load_file(make_model(tmp_path / "again", seed=0) / "model.safetensors")
    first = load_file(tiny_dir / "model.safetensors")
    assert again.keys() == first.keys() and all(torch.equal(again[k], first[k]) for k in first)
    assert (tmp_path / "again" / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()
    other = load_file(make_model(tmp_path / "other", seed=1) / "model.safetensors")
    assert not torch.equal(
        other["model.layers.0.mlp.up_proj.weight"], first["model.layers.0.mlp.up_proj.weight"]
    )


def test_sharded_output_loads_the_same(tiny_dir, tmp_path, paged):
    sharded = make_model(tmp_path / "sharded", seed=0, shard_size=300_000)
    shards = sorted(p.name for p in sharded.glob("model-*.safetensors"))
    assert len(shards) > 2 and (sharded / "model.safetensors.index.json").is_file()
    assert not (sharded / "model.safetensors").exists()
    a, _ = load_model(tiny_dir)
    b, _ = load_model(sharded)
    ids = list(range(10, 30))
    assert _greedy(a, paged, ids, 5) == _greedy(b, paged, ids, 5)


def test_refuses_to_overwrite_unless_forced(tmp_path, capsys):
    target = tmp_path / "m"
    assert cli_main(["make-model", str(target)]) == 0
    before = (target / "model.safetensors").stat().st_mtime_ns
    assert cli_main(["make-model", str(target)]) == 0  # same recipe: nothing to do
    assert (target / "model.safetensors").stat().st_mtime_ns == before
    assert cli_main(["make-model", str(target), "--seed", "5"]) == 1
    assert "not empty; pass --force" in capsys.readouterr().err
    (target / "notes.txt").write_text("keep me")
    assert cli_main(["make-model", str(target), "--seed", "5", "--force", "--dtype", "bfloat16"]) == 0
    assert (target / "notes.txt").read_text() == "keep me"
    assert ModelConfig.from_pretrained(target).torch_dtype == "bfloat16"
    assert load_file(target / "model.safetensors")["model.norm.weight"].dtype == torch.bfloat16


def test_bad_arguments(tmp_path):
    with pytest.raises(
        ValueError,
        match="preset must be one of tiny, tiny-trained, tiny-trained-draft, wide-trained, small, got 'huge'",
    ):
        make_model(tmp_path / "x", preset="huge")
    with pytest.raises(ValueError, match="dtype must be one of"):
        make_model(tmp_path / "x", dtype="int4")
    (tmp_path / "file").write_text("")
    with pytest.raises(FileExistsError, match="not a directory"):
        make_model(tmp_path / "file")


def test_small_preset_shapes_and_parameter_count():
    spec = PRESETS["small"]
    config = ModelConfig.from_dict(model_config(spec, {"bos_token_id": 0, "eot_token_id": 4}, "float32"))
    assert config.hidden_size >= 768 and config.num_hidden_layers >= 12 and config.vocab_size >= 32000
    assert config.num_attention_heads == 12 and config.num_key_value_heads == 4
    assert config.intermediate_size >= 2048
    assert config.num_parameters == count_parameters(spec)
    assert 90e6 <= count_parameters(spec) <= 130e6


def test_wide_trained_preset_is_memory_bound_and_shares_the_draft_tokenizer():
    """The speculative-decoding target: a decode step reads weights far beyond a CPU's last-level
    cache (so verifying a few rows costs about one), with the vocabulary of the trained tiny presets
    (its drafts), trained with the fast recipe."""
    spec = PRESETS["wide-trained"]
    assert count_parameters(spec) * 4 >= 80e6
    assert count_parameters(spec) <= 40e6  # trains in minutes on a CPU
    for draft in ("tiny-trained", "tiny-trained-draft"):
        assert PRESETS[draft].vocab_size == spec.vocab_size
    assert spec.train_steps > 0 and spec.train_bf16
    config = ModelConfig.from_dict(model_config(spec, {"bos_token_id": 0, "eot_token_id": 4}, "float32"))
    assert config.num_parameters == count_parameters(spec)
    assert config.hidden_size % config.num_attention_heads == 0


@pytest.mark.slow
def test_small_preset_end_to_end(tmp_path, paged):
    path = make_model(tmp_path / "small", preset="small", seed=0)
    assert len(list(path.glob("model-*.safetensors"))) >= 2  # ~500 MB in float32: sharded
    tokenizer = Tokenizer.from_pretrained(path)
    assert tokenizer.vocab_size == 32000
    # The BPE learned (almost) the whole vocabulary instead of padding it with reserved tokens.
    assert len(tokenizer.special_token_ids) < 100
    model, _ = load_model(path)
    out = _greedy(model, paged, tokenizer.encode("Once upon a time"), 24)
    assert len(set(out)) >= 8
