"""A verify step's logits equal those of decoding its tokens one by one, in both of its shapes
(decode rows sharing a block table, packed like chunked prefill), on the native CPU path with one
and with two threads (rows of one sequence must see each other's freshly written K/V) and on the
plain-torch path."""

from __future__ import annotations

import pytest
import torch

from disagg.kernels import native_build
from disagg.worker.engine.llm_engine import LLMEngine
from disagg.worker.engine.speculative import batches

BS = 8
PROMPT = [11, 200, 37, 401, 5, 99, 123, 321, 77, 15, 260, 4, 88]
NEXT = [301, 42, 7, 150, 9]  # the tokens a verify step computes after the prompt


def logits_of(e: LLMEngine, shape: str, blocks: list[int]) -> torch.Tensor:
    e.runner.kv_cache.zero_()
    e.runner.forward(batches.packed([batches.Run(PROMPT, 0, blocks)], BS, all_logits=False))
    if shape == "one-by-one":
        rows = []
        for j, tok in enumerate(NEXT):
            rows.append(e.runner.forward(batches.rows([batches.Run([tok], len(PROMPT) + j, blocks)], BS,
                                                      all_logits=True)))  # fmt: skip
        return torch.cat(rows)
    build = batches.rows if shape == "rows" else batches.packed
    return e.runner.forward(build([batches.Run(NEXT, len(PROMPT), blocks)], BS, all_logits=True))


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("threads", [1, 2])
def test_verify_logits_match_sequential_decoding(tiny_llama_dir, monkeypatch, native, threads):
    if native and not native_build.available():
        pytest.skip("no C compiler for the native kernels")
    if not native:
        monkeypatch.setattr(native_build, "available", lambda: False)
    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        e = LLMEngine(tiny_llama_dir, block_size=BS, num_gpu_blocks=8, load_tokenizer=False)
        blocks = [5, 2, 7]  # not in order: the block table is read, not assumed
        want = logits_of(e, "one-by-one", blocks)
        for shape in ("rows", "packed"):
            got = logits_of(e, shape, blocks)
            torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4, msg=shape)
        # 4 rows take the one-call native step, 5 the per-layer path: both are covered
        assert len(NEXT) > 4
        four = e.runner.forward(
            batches.rows([batches.Run(NEXT[:4], len(PROMPT), blocks)], BS, all_logits=True)
        )
        torch.testing.assert_close(four, want[:4], atol=2e-4, rtol=1e-4)
    finally:
        torch.set_num_threads(n)
