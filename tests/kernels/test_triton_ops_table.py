"""The Triton op table mirrors the torch twins: same names, same signatures, one dispatch point."""

from __future__ import annotations

import inspect

import pytest

from disagg.kernels import (
    KV_QUANT_OP_NAMES,
    OP_NAMES,
    get_ops,
    kv_quant,
    torch_ops,
    triton_kv_quant,
    triton_ops,
)


@pytest.mark.parametrize("name", OP_NAMES)
def test_same_signature_as_twin(name):
    ours, twin = inspect.signature(getattr(triton_ops, name)), inspect.signature(getattr(torch_ops, name))
    assert list(ours.parameters) == list(twin.parameters)
    assert [p.default for p in ours.parameters.values()] == [p.default for p in twin.parameters.values()]


@pytest.mark.parametrize("name", KV_QUANT_OP_NAMES)
def test_same_signature_as_twin_over_a_quantized_cache(name):
    ours, twin = inspect.signature(getattr(triton_kv_quant, name)), inspect.signature(getattr(kv_quant, name))
    assert list(ours.parameters) == list(twin.parameters)


def test_dispatch_forced_to_triton(monkeypatch):
    monkeypatch.setenv("DISAGG_KERNELS", "triton")
    ops = get_ops("cpu")
    assert ops.backend == "triton"
    assert all(getattr(ops, name) is getattr(triton_ops, name) for name in OP_NAMES)
    assert all(getattr(ops, name) is getattr(triton_kv_quant, name) for name in KV_QUANT_OP_NAMES)
    monkeypatch.delenv("DISAGG_KERNELS")
    assert get_ops("cpu").backend == "torch"
