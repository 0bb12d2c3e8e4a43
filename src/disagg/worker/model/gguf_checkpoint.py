"""A GGUF file (llama.cpp's checkpoint format) read as the Hugging Face checkpoint it was converted
from: `config.json`'s fields, tensors under their Hugging Face names in float32, the tokenizer's
metadata. Read with the `gguf` package (llama.cpp's own reader); numpy only, no torch, so the
router can read the config too.

Two llama.cpp conventions are undone here. Tensor names: `blk.3.attn_q.weight` is
`model.layers.3.self_attn.q_proj.weight`. RoPE: for the `llama` architecture the converter
permutes the rows of q_proj and k_proj (weights and biases) per head, from Hugging Face's
rotate-half layout (pairs (j, j + D/2)) to interleaved pairs (2j, 2j + 1); the engine rotates
halves, so those rows are permuted back. Qwen2/Qwen3 files are written unpermuted (llama.cpp
rotates halves for them, NeoX style).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import numpy as np

GGUF_SUFFIX = ".gguf"

# general.architecture -> the Hugging Face class it was converted from (Mistral files say "llama")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# Tensor types dequantized at load (`gguf.quants.dequantize`); any other is refused by name.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
# Architectures whose q/k rows llama.cpp's converter permutes (see the module docstring).
_PERMUTED_QK = ("llama",)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_PARTS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")


def is_gguf(path: str | Path) -> bool:
    """`path` is a GGUF file, or a directory holding one and no config.json (`find_gguf`)."""
    return find_gguf(path) is not None


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or the one `.gguf` in a directory without a
    config.json (a Hugging Face checkpoint directory is read as such). None: not GGUF. A directory
    with several `.gguf` files is an error naming them (which one is meant is not guessable)."""
    path = Path(path)
    if path.is_file():
        return path if path.suffix == GGUF_SUFFIX else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(path.glob(f"*{GGUF_SUFFIX}"))
    if len(found) > 1:
        names = ", ".join(f.name for f in found)
        raise ValueError(f"{path} holds several GGUF files ({names}): pass --model the one to serve")
    return found[0] if found else None


def served_name(path: str | Path) -> str:
    """The model name a checkpoint is served under by default (workers and router must agree): a
    directory's name, a GGUF file's name without `.gguf`."""
    path = Path(path)
    return path.name.removesuffix(GGUF_SUFFIX) if path.is_file() else path.name


def hf_tensor_name(name: str) -> str:
    """llama.cpp's tensor name -> the Hugging Face one; an unknown name is an error naming it."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER_NAME.fullmatch(name)
    if match and match.group(2) in _LAYER_PARTS:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_LAYER_PARTS[part]}.{kind}"
    raise ValueError(f"GGUF tensor {name!r} has no counterpart in the supported architectures")


def unpermute_rope_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of a q/k projection's rows (weight [H*D, in] or bias [H*D]):
    per head, row 2j + i of the file is row j + i*D/2 of the Hugging Face tensor."""
    half = rows.shape[0] // num_heads // 2
    out = rows.reshape(num_heads, half, 2, *rows.shape[1:]).swapaxes(1, 2)
    return np.ascontiguousarray(out.reshape(rows.shape))


def plain_reader(path: Path):
    """`gguf.GGUFReader` over a plain ndarray view of the file's mapping, not the `np.memmap` it
    makes: slicing a memmap runs numpy's Python-level subclass hooks, once for each of the ~250k
    parts of a 49k-token vocabulary's metadata (2.6 s for SmolLM2's; 0.7 s on the plain view).
    Same fields, same tensors, still mapped: nothing is read before it is used."""
    return _plain_reader_class()(path)


@functools.cache
def _plain_reader_class():
    import gguf

    class PlainReader(gguf.GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, mapped: np.ndarray) -> None:  # the reader's own np.memmap of the file
            self._plain = mapped.view(np.ndarray)

    return PlainReader


class GGUFCheckpoint:
    """One GGUF file: its metadata as Hugging Face config dicts, its tensors by Hugging Face name.

    Tensor data stays memory-mapped; `tensor(name)` dequantizes one on demand, so building the
    model layer by layer holds about one float32 layer beyond the file.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        try:
            self._reader = plain_reader(self.path)
        except Exception as exc:  # truncated, not GGUF, an unknown type id: the reader's own words
            raise ValueError(f"{self.path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
        self.arch = self.string("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise ValueError(
                f"{self.path.name}: unsupported GGUF architecture {self.arch!r}; "
                f"supported: {', '.join(ARCHITECTURES)}"
            )
        self._tensors = {}
        for t in self._reader.tensors:
            if t.tensor_type.name not in SUPPORTED_TYPES:
                raise ValueError(
                    f"{self.path.name}: tensor {t.name} has type {t.tensor_type.name}, which is not "
                    f"supported; supported: {', '.join(SUPPORTED_TYPES)}"
                )
            self._tensors[hf_tensor_name(t.name)] = t
        # the reader maps what the header promises; a cut-off file leaves the last tensors short
        for name, t in self._tensors.items():
            if t.data.nbytes != t.n_bytes:
                raise ValueError(f"{self.path.name} is truncated: tensor {t.name} ({name}) is cut short")

    # ---- metadata --------------------------------------------------------------------------
    def has(self, key: str) -> bool:
        return self._reader.get_field(key) is not None

    def value(self, key: str, default=None):
        """A scalar, string or array field's value; `default` when the file lacks it."""
        field = self._reader.get_field(key)
        return default if field is None else field.contents()

    def string(self, key: str) -> str:
        value = self.value(key)
        if not isinstance(value, str):
            raise ValueError(f"{self.path.name}: GGUF metadata {key!r} is missing")
        return value

    def arch_value(self, key: str, default=None):
        """`{architecture}.{key}`, e.g. `llama.block_count`."""
        return self.value(f"{self.arch}.{key}", default)

    def config_dict(self) -> dict:
        """The `config.json` this file was converted from, as far as the engine reads it."""

        def need(key: str):
            value = self.arch_value(key)
            if value is None:
                raise ValueError(f"{self.path.name}: GGUF metadata {self.arch}.{key} is missing")
            return value

        hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
        head_dim = int(self.arch_value("attention.key_length", hidden // heads))
        rotary = int(self.arch_value("rope.dimension_count", head_dim))
        if rotary != head_dim:
            raise ValueError(
                f"{self.path.name}: RoPE on {rotary} of {head_dim} head dimensions is not supported"
            )
        if "rope_freqs.weight" in self.tensor_names_gguf():
            raise ValueError(f"{self.path.name}: per-frequency RoPE factors (rope_freqs) are not supported")
        vocab = self.arch_value("vocab_size") or len(self.value("tokenizer.ggml.tokens") or ())
        raw = {
            "architectures": [ARCHITECTURES[self.arch]],
            "vocab_size": int(vocab or self._tensors["model.embed_tokens.weight"].shape[-1]),
            "hidden_size": hidden,
            "intermediate_size": int(need("feed_forward_length")),
            "num_hidden_layers": int(need("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self.arch_value("attention.head_count_kv", heads)),
            "head_dim": head_dim,
            "rms_norm_eps": _decimal(need("attention.layer_norm_rms_epsilon")),
            "rope_theta": _decimal(self.arch_value("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self.arch_value("context_length", 2048)),
            "tie_word_embeddings": "lm_head.weight" not in self._tensors,
            "attention_bias": self.arch == "llama"
            and "model.layers.0.self_attn.q_proj.bias" in self._tensors,
            "dtype": "float32",  # dequantized at load: float32 unless the engine is told otherwise
            "bos_token_id": self.value("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.eos_token_ids(),
        }
        scaling = self.arch_value("rope.scaling.type")
        if scaling not in (None, "none"):
            raw["rope_scaling"] = {"rope_type": scaling, "factor": self.arch_value("rope.scaling.factor")}
        return raw

    def eos_token_ids(self) -> list[int]:
        """End of sequence and end of turn (llama.cpp stops on both)."""
        keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
        return list(dict.fromkeys(int(v) for k in keys if (v := self.value(k)) is not None))

    # ---- tensors ---------------------------------------------------------------------------
    def tensor_names_gguf(self) -> list[str]:
        return [t.name for t in self._reader.tensors]

    def tensor_names(self) -> list[str]:
        """Hugging Face names of every tensor in the file."""
        return list(self._tensors)

    def tensor(self, name: str) -> np.ndarray:
        """Tensor `name` (Hugging Face naming and row order) dequantized to float32."""
        from gguf.quants import dequantize

        t = self._tensors[name]
        data = dequantize(t.data, t.tensor_type)
        # llama.cpp lists dims fastest-first: ne = (in, out) is the numpy shape (out, in)
        data = data.reshape(tuple(int(n) for n in reversed(t.shape)))
        if self.arch in _PERMUTED_QK:
            if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
                data = unpermute_rope_rows(data, int(self.arch_value("attention.head_count")))
            elif name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
                heads = self.arch_value("attention.head_count")
                data = unpermute_rope_rows(data, int(self.arch_value("attention.head_count_kv", heads)))
        # a float32 tensor comes back as a read-only view of the mapped file: torch wants its own copy
        return np.require(data, np.float32, ["C", "W"])


def _decimal(value: float) -> float:
    """A float32 field as the decimal it was written from (1e-05, not 9.999999747378752e-06): the
    shortest repr that reads back as the same float32."""
    return float(str(np.float32(value)))


@functools.lru_cache(maxsize=2)
def _open(path: str, mtime_ns: int, size: int) -> GGUFCheckpoint:
    return GGUFCheckpoint(path)


def open_gguf(path: str | Path) -> GGUFCheckpoint:
    """The checkpoint at `path` (a file or a directory holding one), parsed once per process and
    file version: config, tokenizer and weights all read it, and parsing the metadata of a 49k-token
    vocabulary takes most of a second."""
    file = find_gguf(path)
    if file is None:
        raise FileNotFoundError(f"no GGUF file at {path}")
    stat = file.stat()
    return _open(str(file.resolve()), stat.st_mtime_ns, stat.st_size)
