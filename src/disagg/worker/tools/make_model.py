"""Random Llama-family checkpoints with a real tokenizer, for tests, demos and benchmarks.

Needs only torch, safetensors and tokenizers. The tokenizer is a real byte-level BPE trained on
a small English corpus generated here, so any UTF-8 text round-trips, and the chat template is
Llama-3 style. The weights are random (see `random_weights`), so generations are gibberish, but the
shapes, files and code paths are those of a real checkpoint.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
EOT_TOKEN = "<|eot_id|>"
HEADER_START = "<|start_header_id|>"
HEADER_END = "<|end_header_id|>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, HEADER_START, HEADER_END, EOT_TOKEN]

# Llama-3 shaped: a header per message, <|eot_id|> closes each turn. Tools, when given, are
# listed as JSON in a system turn of their own so a model can be prompted with them; an
# assistant's earlier calls are written as Llama 3.1 writes them ({"name", "parameters"}, `; `
# between calls), and tool results are ordinary turns of the `tool` role.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\nAvailable tools:\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{%- endfor %}"
    "{{- '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{- raise_exception('unknown role: ' + message['role']) }}"
    "{%- endif %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message.get('tool_calls') %}"
    "{%- for call in message['tool_calls'] %}"
    "{{- {'name': call['function']['name'], 'parameters': call['function']['arguments']} | tojson }}"
    "{%- if not loop.last %}{{- '; ' }}{%- endif %}"
    "{%- endfor %}"
    "{%- else %}"
    "{{- (message['content'] or '') | trim }}"
    "{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int
    train_steps: int = 0  # > 0: trained on the generated corpus (train_lm.py) instead of left random
    train_lr: float = 3e-3  # peak learning rate (warm-up, then cosine decay)
    train_bf16: bool = False  # matmuls under bfloat16 autocast (float32 master weights)


PRESETS = {
    # Loads in milliseconds: for tests.
    "tiny": Preset(128, 384, 4, 4, 2, 1024, 2048),
    # The tiny shape trained for about a minute on CPU: its text reads like the corpus (the demo).
    "tiny-trained": Preset(128, 384, 4, 4, 2, 1024, 2048, train_steps=800),
    # A draft-sized sibling with the same tokenizer, for speculative decoding.
    "tiny-trained-draft": Preset(64, 192, 2, 2, 1, 1024, 2048, train_steps=600),
    # The trained tiny models' tokenizer at 25M parameters (100 MB in float32, three times this
    # CPU's L3): a decode step is bound by reading the weights, as on real models, so verifying a
    # few speculative rows costs about one row; tiny-trained(-draft) is its draft. Wide and shallow
    # (two layers of width 1024) for few per-layer steps; training takes about 3 minutes on 2 idle
    # cores (0.55 s a step under bf16 autocast), far longer on a busy machine.
    "wide-trained": Preset(1024, 2816, 2, 16, 4, 1024, 2048, train_steps=300, train_lr=2e-3, train_bf16=True),
    # About 100M parameters with realistic shapes: for benchmarks.
    "small": Preset(768, 2048, 12, 12, 4, 32000, 4096),
}

DEFAULT_SHARD_BYTES = 200 * 1024 * 1024


# ----------------------------------------------------------------------------- corpus + tokenizer

_SUBJECTS = [
    "the engineer",
    "a small model",
    "the scheduler",
    "our cluster",
    "the router",
    "every worker",
    "the old lighthouse keeper",
    "a curious child",
    "the river",
    "this library",
    "the committee",
    "a quiet village",
    "the storm",
    "my neighbour",
    "the database",
    "a hungry fox",
    "the orchestra",
]
_VERBS = [
    "reads",
    "writes",
    "measures",
    "builds",
    "remembers",
    "explains",
    "carries",
    "watches",
    "follows",
    "answers",
    "repairs",
    "paints",
    "counts",
    "schedules",
    "transfers",
    "predicts",
]
_OBJECTS = [
    "the morning news",
    "a long letter",
    "seven blue boxes",
    "the weather report",
    "every request",
    "an old map of the coast",
    "the numbers in the ledger",
    "a bowl of warm soup",
    "the last train",
    "the cache blocks",
    "a question about time",
    "three bright lanterns",
    "the garden gate",
]
_ENDINGS = [
    "before dawn",
    "with great care",
    "in the evening",
    "without a sound",
    "every Tuesday",
    "as quickly as possible",
    "for the first time",
    "near the harbour",
    "under a grey sky",
    "because it matters",
    "after the meeting",
    "while the kettle boils",
]
_QUESTIONS = [
    "What is the capital of France?",
    "How many legs does a spider have?",
    "Why is the sky blue?",
    "Can you write a short poem about autumn?",
    "Where did you put the keys?",
    "When does the library open?",
    "Who wrote this program?",
    "Which road leads to the sea?",
]
_EXTRA = (
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14 1,000,000. "
    "Punctuation: (a) [b] {c} <d> \"quoted\" 'single' semi; colon: dash - ellipsis... "
    "Code: def f(x): return x * 2  # double it\nfor i in range(10): print(i)\n"
    "URLs: https://example.com/path?q=1&r=2 user@example.org\n"
    "Unicode: café naïve résumé über straße 東京 こんにちは 你好 🙂 🚀 ✓ — “curly quotes”.\n"
)


_ONSETS = [
    "",
    "b",
    "br",
    "c",
    "ch",
    "d",
    "dr",
    "f",
    "fl",
    "g",
    "gr",
    "h",
    "j",
    "k",
    "l",
    "m",
    "n",
    "p",
    "pl",
    "qu",
    "r",
    "s",
    "sh",
    "st",
    "t",
    "th",
    "tr",
    "v",
    "w",
    "z",
]
_NUCLEI = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "y", "io"]
_CODAS = ["", "n", "r", "s", "t", "l", "m", "nd", "st", "ck", "ng", "x"]


def _invented_words(rng: random.Random, lines: int) -> list[str]:
    """Sentences of pronounceable made-up words: enough distinct words for BPE to learn a
    large vocabulary (the English part alone runs out of merges after ~2000 tokens)."""
    out = []
    for _ in range(lines):
        words = []
        for _ in range(rng.randint(5, 12)):
            syllables = rng.randint(1, 3)
            word = "".join(
                rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS) for _ in range(syllables)
            )
            words.append(word.capitalize() if rng.random() < 0.1 else word)
        out.append(" ".join(words) + rng.choice([".", ",", "!", "?", ";"]))
    return out


def training_corpus(seed: int = 0, sentences: int = 600, invented_lines: int = 0) -> list[str]:
    """A deterministic English corpus (templated sentences, questions, numbers, code, some
    non-Latin scripts) plus `invented_lines` of made-up words for large vocabularies."""
    rng = random.Random(seed)
    lines = []
    for i in range(sentences):
        kind = i % 4
        if kind == 3:
            lines.append(rng.choice(_QUESTIONS))
            continue
        sentence = (
            f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_ENDINGS)}"
        )
        lines.append(sentence[0].upper() + sentence[1:] + rng.choice([".", "!", ".", "?"]))
    lines.extend([_EXTRA] * 3)
    lines.extend(_invented_words(rng, invented_lines))
    return lines


def build_tokenizer(vocab_size: int, seed: int = 0):
    """A byte-level BPE `tokenizers.Tokenizer` of exactly `vocab_size` tokens.

    Should training stop short of the size, the rest is filled with reserved special tokens
    (as Llama 3 does). A template post-processor prepends BOS.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
        raise ValueError(f"vocab_size must be at least {256 + len(SPECIAL_TOKENS) + 1}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Small vocabularies are reached from the English part alone; ~1 line of invented words per
    # 10 tokens gets BPE to 32k merges in about a second.
    invented = vocab_size // 10 if vocab_size > 2048 else 0
    tok.train_from_iterator(training_corpus(seed, invented_lines=invented), trainer=trainer)
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_special_tokens([f"<|reserved_special_token_{i}|>" for i in range(missing)])
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    return tok


def write_tokenizer(path: str | Path, vocab_size: int, seed: int = 0) -> dict:
    """Write tokenizer.json and tokenizer_config.json into `path`; return the special ids."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(vocab_size, seed)
    tok.save(str(path / "tokenizer.json"))
    ids = {name: tok.token_to_id(name) for name in SPECIAL_TOKENS}
    added = {
        str(i): {
            "content": tok.id_to_token(i),
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i in sorted(ids.values())
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOT_TOKEN,
        "pad_token": EOS_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return {
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": ids[EOS_TOKEN],
        "eot_token_id": ids[EOT_TOKEN],
    }


# ----------------------------------------------------------------------------- config + weights


def model_config(preset: Preset, token_ids: dict, dtype: str) -> dict:
    """config.json of a Llama 3 shaped model, readable by transformers 4.x and 5.x."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": preset.vocab_size,
        "hidden_size": preset.hidden_size,
        "intermediate_size": preset.intermediate_size,
        "num_hidden_layers": preset.num_hidden_layers,
        "num_attention_heads": preset.num_attention_heads,
        "num_key_value_heads": preset.num_key_value_heads,
        "head_dim": preset.hidden_size // preset.num_attention_heads,
        "hidden_act": "silu",
        "max_position_embeddings": preset.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        # Untied: with a tied head a random model maps each token to itself and repeats forever.
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "bos_token_id": token_ids["bos_token_id"],
        "eos_token_id": token_ids["eot_token_id"],
        "torch_dtype": dtype,
        "use_cache": True,
    }


def tensor_shapes(preset: Preset) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the checkpoint in a fixed order (the order weights are drawn in)."""
    h, inter, d = (
        preset.hidden_size,
        preset.intermediate_size,
        preset.hidden_size // preset.num_attention_heads,
    )
    q, kv = preset.num_attention_heads * d, preset.num_key_value_heads * d
    shapes = [("model.embed_tokens.weight", (preset.vocab_size, h))]
    for i in range(preset.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (inter, h)),
            (p + "mlp.up_proj.weight", (inter, h)),
            (p + "mlp.down_proj.weight", (h, inter)),
        ]
    shapes += [("model.norm.weight", (h,)), ("lm_head.weight", (preset.vocab_size, h))]
    return shapes


def count_parameters(preset: Preset) -> int:
    total = 0
    for _, shape in tensor_shapes(preset):
        n = 1
        for s in shape:
            n *= s
        total += n
    return total


def random_weights(preset: Preset, seed: int, dtype, progress=None) -> dict:
    """Norms at 1, embeddings normal(0, 1), projections normal(0, 1/sqrt(fan_in)); a preset to be
    trained starts from the usual normal(0, 0.02) instead.

    Unit-variance activations make attention sharp and position-dependent, so greedy
    continuations wander through the vocabulary; with the small 0.02 init of trained models'
    configs, a random model's next token depends almost only on the current one and falls into
    a loop of two or three tokens.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in tensor_shapes(preset):
        if name.endswith("norm.weight"):
            t = torch.ones(shape)
        else:
            std = 1.0 if name == "model.embed_tokens.weight" else shape[1] ** -0.5
            if preset.train_steps:
                std = 0.02
            t = torch.empty(shape).normal_(0.0, std, generator=gen)
        tensors[name] = t.to(dtype)
        if progress and name.endswith("down_proj.weight"):
            progress(f"initialised layer {int(name.split('.')[2]) + 1}/{preset.num_hidden_layers}")
    return tensors


def save_weights(path: Path, tensors: dict, shard_bytes: int, progress=None) -> list[str]:
    """model.safetensors, or shards of at most ~shard_bytes plus model.safetensors.index.json."""
    from safetensors.torch import save_file

    shards: list[dict] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        (path / "model.safetensors").chmod(0o644)
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file_name, shard in zip(names, shards, strict=True):
        save_file(shard, str(path / file_name), metadata={"format": "pt"})
        (path / file_name).chmod(0o644)
        weight_map.update(dict.fromkeys(shard, file_name))
        if progress:
            progress(f"wrote {file_name}")
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return names


def trained(path: Path, config: dict, tensors: dict, preset: Preset, seed: int, progress=None) -> dict:
    """`tensors` trained for the preset's steps on chat turns and sentences of the corpus, tokenized
    with the checkpoint's own tokenizer and chat template (already written into `path`)."""
    from disagg.worker.engine.tokenizer import Tokenizer
    from disagg.worker.tools.train_lm import train, training_text

    tok = Tokenizer.from_pretrained(path)

    def render(messages: list[dict]) -> str:
        return tok.apply_chat_template(messages, add_generation_prompt=False)

    docs = training_text(training_corpus(seed), render, seed, documents=4000)
    end = tok.encode(EOS_TOKEN, add_special_tokens=False)
    token_docs = [
        tok.encode(d, add_special_tokens=False) if d.startswith(BOS_TOKEN) else tok.encode(d) + end
        for d in docs
    ]
    train(tensors, config, token_docs, preset.train_steps, seed, lr=preset.train_lr, bf16=preset.train_bf16,
          progress=progress)  # fmt: skip
    return tensors


# ----------------------------------------------------------------------------- the command

MARKER_FILE = "make_model.json"  # what this directory was made with, so a rerun is a no-op
_WRITTEN_PATTERNS = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "model.safetensors",
    "model-*-of-*.safetensors",
    "model.safetensors.index.json",
    MARKER_FILE,
)


def make_model(
    path: str | Path,
    preset: str | Preset = "tiny",
    seed: int = 0,
    dtype: str = "float32",
    shard_size: int | None = None,
    force: bool = False,
    progress=None,
) -> Path:
    """Write a random checkpoint of `preset` (a name of PRESETS, or a `Preset` of other shapes)
    into `path` and return the path.

    Running it again with the same arguments on the directory it made does nothing. A
    non-empty directory holding anything else is refused unless `force`, which replaces the
    checkpoint files (and only those).
    """
    import torch

    if not isinstance(preset, Preset) and preset not in PRESETS:
        raise ValueError(f"preset must be one of {', '.join(PRESETS)}, got {preset!r}")
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in dtypes:
        raise ValueError(f"dtype must be one of {', '.join(dtypes)}, got {dtype!r}")
    if shard_size is not None and shard_size <= 0:
        raise ValueError(f"shard_size must be positive, got {shard_size}")
    path = Path(path)
    spec = preset if isinstance(preset, Preset) else PRESETS[preset]
    name = asdict(spec) if isinstance(preset, Preset) else preset
    recipe = {"preset": name, "seed": seed, "dtype": dtype, "shard_size": shard_size}
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()):
        marker = path / MARKER_FILE
        if not force and marker.is_file() and json.loads(marker.read_text()) == recipe:
            return path
        if not force:
            raise FileExistsError(
                f"{path} is not empty; pass --force (force=True) to overwrite its checkpoint"
            )
        for pattern in _WRITTEN_PATTERNS:
            for old in path.glob(pattern):
                old.unlink()
    path.mkdir(parents=True, exist_ok=True)

    if progress:
        label = preset if isinstance(preset, str) else "custom shapes"
        progress(f"{label}: {count_parameters(spec) / 1e6:.1f}M parameters, {dtype}")
    token_ids = write_tokenizer(path, spec.vocab_size, seed=0)
    config = model_config(spec, token_ids, dtype)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {
        "bos_token_id": token_ids["bos_token_id"],
        "eos_token_id": [token_ids["eos_token_id"], token_ids["eot_token_id"]],
    }
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tensors = random_weights(spec, seed, torch.float32 if spec.train_steps else dtypes[dtype], progress)
    if spec.train_steps:
        tensors = {
            name: t.to(dtypes[dtype])
            for name, t in trained(path, config, tensors, spec, seed, progress).items()
        }
    save_weights(path, tensors, shard_size or DEFAULT_SHARD_BYTES, progress)
    (path / MARKER_FILE).write_text(json.dumps(recipe) + "\n")
    return path
