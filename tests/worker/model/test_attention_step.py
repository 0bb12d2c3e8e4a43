"""The attention path is chosen once per step, from the model, the batch and the cache."""

from __future__ import annotations

import pytest
import torch

from disagg.kernels import native_build
from disagg.worker.model import attention_step as steps
from disagg.worker.model.loader import load_model

BLOCK = 4


def _step(model, seqs, cache, prefill: bool):
    batch = seqs.prefill([(0, [5, 6, 7])]) if prefill else seqs.decode([(0, 9)])
    return steps.attention_step(model, batch, cache)


@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "torch"])
def test_each_setting_takes_its_path(tiny_llama_dir, paged, native, monkeypatch):
    if native == "1" and not native_build.available():
        pytest.skip("needs a C compiler (cc)")
    monkeypatch.setenv("DISAGG_CPU_NATIVE", native)
    model, _ = load_model(tiny_llama_dir)
    seqs = paged(BLOCK)
    cache = model.allocate_kv_cache(8, BLOCK)
    shape = model.kv_cache_shape(8, BLOCK)
    strided = torch.zeros(*shape[:-1], shape[-1] + 3)[..., : shape[-1]]
    prefill = _step(model, seqs, cache, prefill=True)
    decode = _step(model, seqs, cache, prefill=False)
    want = steps.NativeStep if native == "1" else steps.Float32TorchStep
    assert type(prefill) is want and type(decode) is want
    assert prefill.attend == prefill.prefill_attention
    if native == "0":  # one sequence: one unpadded decode group
        assert decode.attend == decode.decode_attention_one_group
    assert type(_step(model, seqs, strided, prefill=False)) is steps.OpTableStep
    bf16, _ = load_model(tiny_llama_dir, dtype="bfloat16")
    want = steps.NativeStep if native == "1" else steps.PlannedTorchStep
    assert type(_step(bf16, paged(BLOCK), bf16.allocate_kv_cache(8, BLOCK), prefill=True)) is want
    model.use_kv_cache_dtype("int8")
    quantized_cache = model.allocate_kv_cache(8, BLOCK)
    want = steps.NativeQuantizedCacheStep if native == "1" else steps.QuantizedCacheStep
    assert type(_step(model, paged(BLOCK), quantized_cache, prefill=True)) is want


def test_a_byte_cache_needs_the_models_kv_cache_dtype(tiny_llama_dir, paged, monkeypatch):
    monkeypatch.setenv("DISAGG_CPU_NATIVE", "0")
    model, _ = load_model(tiny_llama_dir)
    cache = torch.zeros(model.num_layers, 8, 1024, dtype=torch.uint8)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        _step(model, paged(BLOCK), cache, prefill=True)
