"""A GGUF file's tokenizer rebuilt as a `tokenizers` one: llama.cpp stores a byte-level BPE
("gpt2") tokenizer as its vocabulary, merges, token types and a pre-tokenizer name; the split
rules behind each name live in llama.cpp's code, and are spelled out here for the names supported.

Returns what `Tokenizer` takes from a Hugging Face checkpoint: the backend, the tokenizer_config
fields (special tokens, `add_bos_token`, chat template) and the generation config's EOS ids.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from disagg.worker.model.gguf_checkpoint import GGUFCheckpoint

# llama.cpp's token types (llama_token_type)
_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2():
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2():
    # StarCoder's and SmolLM's: every digit its own piece, then GPT-2's split
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


def _split(pattern: str):
    return lambda: pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


# tokenizer.ggml.pre -> the pre-tokenizer llama.cpp runs for it (llama-vocab.cpp)
PRE_TOKENIZERS = {
    "default": _gpt2,
    "gpt-2": _gpt2,
    "smollm": _digits_then_gpt2,
    "starcoder": _digits_then_gpt2,
    "refact": _digits_then_gpt2,
    "llama-bpe": _split(_LLAMA3_SPLIT),
    "llama3": _split(_LLAMA3_SPLIT),
    "smaug-bpe": _split(_LLAMA3_SPLIT),
    "qwen2": _split(_QWEN2_SPLIT),
}
_BOS_BY_DEFAULT = ("llama-bpe", "llama3", "smaug-bpe")


def build(checkpoint: GGUFCheckpoint) -> tuple[HFTokenizer, dict, dict]:
    """(backend, tokenizer_config, generation_config) from the file's `tokenizer.*` metadata.
    Refuses, naming it, a tokenizer model or pre-tokenizer this module does not know."""
    name = checkpoint.path.name
    kind = checkpoint.value("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"{name}: GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2')"
        )
    pre = checkpoint.value("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"{name}: GGUF pre-tokenizer {pre!r} is not supported; supported: {', '.join(PRE_TOKENIZERS)}"
        )
    tokens: list[str] = checkpoint.value("tokenizer.ggml.tokens")
    merges = checkpoint.value("tokenizer.ggml.merges")
    if not tokens or not merges:
        raise ValueError(f"{name}: GGUF tokenizer metadata lacks tokenizer.ggml.tokens or .merges")
    vocab = {token: i for i, token in enumerate(tokens)}
    backend = HFTokenizer(
        models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False)
    )
    backend.pre_tokenizer = PRE_TOKENIZERS[pre]()
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    # control tokens (<|im_start|>, ...) match whole and are special; user-defined ones match whole
    types = checkpoint.value("tokenizer.ggml.token_type") or [1] * len(tokens)
    backend.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == _CONTROL
        ]
    )
    backend.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == _USER_DEFINED
        ]
    )

    def token(key: str) -> str | None:
        i = checkpoint.value(f"tokenizer.ggml.{key}")
        return None if i is None else tokens[int(i)]

    config = {
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "pad_token": token("padding_token_id"),
        "unk_token": token("unknown_token_id"),
        # a file that does not say: llama.cpp's default, BOS only for its Llama 3 pre-tokenizers
        "add_bos_token": bool(checkpoint.value("tokenizer.ggml.add_bos_token", pre in _BOS_BY_DEFAULT)),
    }
    template = checkpoint.value("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return backend, config, {"eos_token_id": checkpoint.eos_token_ids()}
