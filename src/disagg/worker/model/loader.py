"""Load a checkpoint into `LlamaForCausalLM` (no transformers needed): Hugging Face safetensors
(a single `model.safetensors` or shards listed in `model.safetensors.index.json`) or a GGUF file
(`gguf_checkpoint`: its tensors dequantized to float32, then converted like safetensors ones).
q/k/v and gate/up are concatenated into fused weights here, once, so every forward pass runs
fewer, larger matmuls.

`--quantization int8` from a Q8_0 GGUF dequantizes the file's 32-weight blocks and quantizes again
with one scale per output channel: the 8-bit values are not kept as stored.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from disagg.kernels import quantized
from disagg.kernels.quantized import QuantizedWeight
from disagg.worker.model import gguf_checkpoint, parallel, precisions, quantization
from disagg.worker.model.config import ModelConfig
from disagg.worker.model.llama import LayerWeights, LlamaForCausalLM, ModelWeights
from disagg.worker.model.parallel import ShardPlan, TensorParallel

log = logging.getLogger(__name__)

DTYPES = {name: getattr(torch, name) for name in precisions.DTYPES}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """'float32' | 'bfloat16' | 'float16' (or the torch dtype itself) -> torch.dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype}")
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[name]


SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Buffers some checkpoints carry that are recomputed here.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
# Beside a pre-quantized `*.weight`: its scale, and the static activation scale of W8A8
# checkpoints (unused: activations stay in the model dtype).
_QUANT_SUFFIXES = (".weight_scale", ".input_scale")


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, single or sharded."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory not found: {path}")
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not weight_map:
            raise ValueError(f"{index} has no weight_map")
        files = [path / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"weight shard {f.name} listed in {INDEX_FILE} not found in {path}")
        return files
    single = path / SINGLE_FILE
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no weights in {path}: expected {SINGLE_FILE} or {INDEX_FILE}")


class CheckpointTensors(Mapping):
    """Tensor name -> tensor over a checkpoint's files, read from disk only when asked for.

    Building the model one layer at a time from this keeps peak memory near one copy of the
    weights instead of two.
    """

    def __init__(self, files: list[Path]):
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where: dict[str, int] = {}
        for i, handle in enumerate(self._handles):
            for name in handle.keys():
                if name in self._where:
                    raise ValueError(
                        f"tensor {name} appears in more than one weight file (again in {files[i].name})"
                    )
                self._where[name] = i

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._handles[self._where[name]].get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


class GGUFTensors(Mapping):
    """Tensor name -> float32 tensor over a GGUF file (Hugging Face names and row order), each
    dequantized when asked for. `progress(done, total)` is called after every tensor read."""

    def __init__(
        self, checkpoint: gguf_checkpoint.GGUFCheckpoint, progress: Callable[[int, int], None] | None = None
    ):
        self._checkpoint = checkpoint
        self._names = checkpoint.tensor_names()
        self._progress = progress
        self._done = 0

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        t = torch.from_numpy(self._checkpoint.tensor(name))
        self._done += 1
        if self._progress is not None:
            self._progress(self._done, len(self._names))
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def log_progress(label: str, every: float = 2.0) -> Callable[[int, int], None]:
    """A `progress(done, total)` that logs `label: done/total` at most every `every` seconds and at
    the end: a model that takes a while to load says where it is."""
    start = last = time.monotonic()

    def report(done: int, total: int) -> None:
        nonlocal last
        now = time.monotonic()
        if done == total or now - last >= every:
            last = now
            log.info("%s: %d/%d tensors (%.1fs)", label, done, total, now - start)

    return report


def expected_names(config: ModelConfig) -> list[str]:
    """Every tensor name the checkpoint must hold (lm_head optional when tying)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names.append(f"{p}self_attn.{proj}.weight")
        if config.qkv_bias:
            names += [f"{p}self_attn.{proj}.bias" for proj in ("q_proj", "k_proj", "v_proj")]
        if config.o_bias:
            names.append(f"{p}self_attn.o_proj.bias")
        if config.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names.append(f"{p}mlp.{proj}.weight")
            if config.mlp_bias:
                names.append(f"{p}mlp.{proj}.bias")
    return names


def build_weights(
    config: ModelConfig,
    tensors: Mapping[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
    shard: ShardPlan | None = None,
    quantize: str | None = None,
    prequantized: bool = False,
) -> ModelWeights:
    """Check names and shapes, convert, fuse. Missing or unexpected tensors are errors naming them.

    With a `shard` plan, only that rank's slices are kept (`parallel`'s split). `quantize` ("int8" |
    "fp8"): the matmul weights and the LM head are quantized here, layer by layer. `prequantized`: the
    checkpoint holds them quantized already, with `*.weight_scale`."""
    if shard is not None and (quantize is not None or prequantized):
        raise ValueError(
            "quantization: 8-bit weights are not supported with tensor_parallel_size > 1 yet "
            "(use one or the other)"
        )
    names = {k for k in tensors if not k.endswith(_IGNORED_SUFFIXES)}
    wanted = expected_names(config)
    missing = [n for n in wanted if n not in names]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {', '.join(missing[:10])}")
    allowed = set(wanted) | {"lm_head.weight"}
    if prequantized:
        allowed |= {n.removesuffix(".weight") + sfx for n in allowed if n.endswith("proj.weight") or
                    n == "lm_head.weight" for sfx in _QUANT_SUFFIXES}  # fmt: skip
    unexpected = sorted(names - allowed)
    if unexpected:
        raise ValueError(
            f"checkpoint has {len(unexpected)} unexpected tensor(s): {', '.join(unexpected[:10])}"
        )

    h, d, i_size = config.hidden_size, config.head_dim, config.intermediate_size
    q_rows, kv_rows = config.num_attention_heads * d, config.num_key_value_heads * d

    def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"tensor {name} has shape {tuple(t.shape)}, config.json implies {shape}")
        return t

    def place(*parts: torch.Tensor) -> torch.Tensor:
        fused = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        if shard is not None and len(parts) == 1:
            fused = fused.clone()  # a slice would keep the whole checkpoint tensor alive
        return fused.to(device=device, dtype=dtype).contiguous()

    # the identity without a plan, else this rank's slice (see `parallel`)
    def qkv(*full: torch.Tensor) -> list[torch.Tensor]:
        return list(full) if shard is None else parallel.qkv_rows(shard, full, d)

    def o_cols(t: torch.Tensor) -> torch.Tensor:
        return t if shard is None else parallel.o_columns(shard, t, d)

    def mlp(t: torch.Tensor) -> torch.Tensor:
        return t if shard is None else parallel.mlp_rows(shard, t)

    def down_cols(t: torch.Tensor) -> torch.Tensor:
        return t if shard is None else parallel.down_columns(shard, t)

    def vocab(t: torch.Tensor) -> torch.Tensor:
        return t if shard is None else parallel.vocab_rows(shard, t)

    def matmul(
        *parts: tuple[str, tuple[int, int]], split=None, scheme: str | None = quantize
    ) -> torch.Tensor | QuantizedWeight:
        """A (fused) matmul weight: as stored when pre-quantized, else in dtype (this rank's `split`
        of the full tensors under tensor parallelism), quantized to `scheme` if one is given."""
        scaled = [name.removesuffix("weight") + "weight_scale" in tensors for name, _ in parts]
        if prequantized and any(scaled):
            if not all(scaled):
                raise ValueError(f"{', '.join(n for n, _ in parts)} are fused, but only some are quantized")
            data = [get(name, shape) for name, shape in parts]
            scales = [tensors[name + "_scale"] for name, _ in parts]
            w = quantization.prequantized(data, scales, [name for name, _ in parts])
            return QuantizedWeight(w.data.to(device), w.scale.to(device))
        full = [get(name, shape) for name, shape in parts]
        w = place(*(full if split is None else split(full)))
        if scheme is None or prequantized:
            return w
        q = quantization.quantize(w, scheme)  # in float32 from the dtype-rounded weight
        return QuantizedWeight(q.data.to(device), q.scale.to(device))

    layers = []
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        qkv_bias = o_bias = gate_up_bias = down_bias = None
        if config.qkv_bias:
            qkv_bias = place(
                *qkv(
                    get(a + "q_proj.bias", (q_rows,)),
                    get(a + "k_proj.bias", (kv_rows,)),
                    get(a + "v_proj.bias", (kv_rows,)),
                )
            )
        if config.o_bias:
            o_bias = place(get(a + "o_proj.bias", (h,)))
        if config.mlp_bias:
            gate_up_bias = place(
                mlp(get(m + "gate_proj.bias", (i_size,))), mlp(get(m + "up_proj.bias", (i_size,)))
            )
            down_bias = place(get(m + "down_proj.bias", (h,)))
        layers.append(
            LayerWeights(
                input_norm=place(get(p + "input_layernorm.weight", (h,))),
                qkv=matmul(
                    (a + "q_proj.weight", (q_rows, h)),
                    (a + "k_proj.weight", (kv_rows, h)),
                    (a + "v_proj.weight", (kv_rows, h)),
                    split=lambda full: qkv(*full),
                ),
                qkv_bias=qkv_bias,
                o=matmul((a + "o_proj.weight", (h, q_rows)), split=lambda full: [o_cols(full[0])]),
                o_bias=o_bias,
                post_norm=place(get(p + "post_attention_layernorm.weight", (h,))),
                gate_up=matmul(
                    (m + "gate_proj.weight", (i_size, h)),
                    (m + "up_proj.weight", (i_size, h)),
                    split=lambda full: [mlp(t) for t in full],
                ),
                gate_up_bias=gate_up_bias,
                down=matmul((m + "down_proj.weight", (h, i_size)), split=lambda full: [down_cols(full[0])]),
                down_bias=down_bias,
                q_norm=place(get(a + "q_norm.weight", (d,))) if config.qk_norm else None,
                k_norm=place(get(a + "k_norm.weight", (d,))) if config.qk_norm else None,
            )
        )
    embed = place(vocab(get("model.embed_tokens.weight", (config.vocab_size, h))))
    head_scheme = quantization.lm_head_scheme(quantize)
    if config.tie_word_embeddings or "lm_head.weight" not in tensors:
        lm_head = embed
        if head_scheme is not None and not prequantized:  # its own 8-bit copy; lookups keep the table
            q = quantization.quantize(embed, head_scheme)
            lm_head = QuantizedWeight(q.data.to(device), q.scale.to(device))
    else:
        lm_head = matmul(
            ("lm_head.weight", (config.vocab_size, h)),
            split=lambda full: [vocab(full[0])],
            scheme=head_scheme,
        )
    return ModelWeights(
        embed=embed, layers=layers, norm=place(get("model.norm.weight", (h,))), lm_head=lm_head
    )


def load_model(
    path: str | Path,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    tp: TensorParallel | None = None,
    quantization_setting: str = "auto",
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Read config and weights from `path`; returns the model ready for `forward` and its config.
    With `tp`, the model holds that rank's shard and runs its collectives. `quantization_setting`:
    auto | none | int8 | fp8 (`quantization.resolve`)."""
    config = ModelConfig.from_pretrained(path)
    torch_dtype = resolve_dtype(dtype)
    device = torch.device(device)
    in_checkpoint = quantization.checkpoint_scheme(path)
    scheme = quantization.resolve(quantization_setting, in_checkpoint)
    if gguf_checkpoint.is_gguf(path):
        gguf = gguf_checkpoint.open_gguf(path)
        tensors = GGUFTensors(gguf, log_progress(f"loading {gguf.path.name}"))
    else:
        tensors = CheckpointTensors(checkpoint_files(path))
    weights = build_weights(
        config, tensors, torch_dtype, device, None if tp is None else tp.plan, quantize=scheme,
        prequantized=in_checkpoint is not None,
    )  # fmt: skip
    resolve_matmuls(weights)
    return LlamaForCausalLM(config, weights, torch_dtype, device, tp=tp), config


def resolve_matmuls(weights: ModelWeights) -> None:
    """Choose each matmul weight's kernels once, here (`quantized.resolve`), not on every call."""
    for layer in weights.layers:
        for w in (layer.qkv, layer.o, layer.gate_up, layer.down):
            quantized.resolve(w)
    quantized.resolve(weights.lm_head)
