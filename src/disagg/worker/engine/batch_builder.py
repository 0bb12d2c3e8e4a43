"""Scheduler decision -> `ForwardBatch`: token ids, positions, KV slots and block tables (on CPU;
the model runner moves the batch to its device)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from disagg.worker.engine.prompt_logprobs import PromptSpan
from disagg.worker.engine.scheduler import SchedulerOutput
from disagg.worker.model.forward_batch import ForwardBatch


def build_batch(
    out: SchedulerOutput, block_size: int, prompt_spans: Sequence[PromptSpan] = ()
) -> ForwardBatch:
    """The step's batch; its logits rows are the sampling chunks' last tokens, in chunk order, then
    the rows of `prompt_spans` (prefill steps only), in span order."""
    one_each = not out.is_prefill and all(c.num_tokens == 1 for c in out.chunks)
    if one_each:
        assert not prompt_spans, "prompt logprobs are computed in prefill steps"
        return build_decode(out, block_size)
    return build_packed(out, block_size, prompt_spans)


def build_decode(out: SchedulerOutput, block_size: int) -> ForwardBatch:
    """One token per sequence: positions, slots and lengths come straight from the chunk
    starts in Python, each tensor made by one call (a decode step is latency-bound)."""
    bs = block_size
    chunks = out.chunks
    starts = [c.start for c in chunks]
    tables = [c.request.block_ids for c in chunks]
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) if len(t) < width else t for t in tables]
    return ForwardBatch(
        input_ids=torch.tensor([c.request.token_at(c.start) for c in chunks], dtype=torch.int64),
        positions=torch.tensor(starts, dtype=torch.int64),
        slot_mapping=torch.tensor(
            [t[s // bs] * bs + s % bs for t, s in zip(tables, starts, strict=True)], dtype=torch.int64
        ),
        seq_lens=torch.tensor([s + 1 for s in starts], dtype=torch.int32),
        block_tables=torch.tensor(padded, dtype=torch.int32),
        logits_indices=torch.tensor([b for b, c in enumerate(chunks) if c.samples], dtype=torch.int64),
        is_prefill=False,
    )


def build_packed(
    out: SchedulerOutput, block_size: int, prompt_spans: Sequence[PromptSpan] = ()
) -> ForwardBatch:
    bs = block_size
    chunks = out.chunks
    ids: list[int] = []
    starts: list[int] = []
    lens: list[int] = []
    cu = [0]
    logits_rows: list[int] = []
    for c in chunks:
        req = c.request
        if out.is_prefill and not c.decode:
            prompt_len = req.num_prompt_tokens
            if c.end <= prompt_len:
                ids.extend(req.prompt_token_ids[c.start : c.end])
            else:
                ids.extend(req.all_token_ids[c.start : c.end])
        else:
            ids.append(req.token_at(c.start))
        starts.append(c.start)
        lens.append(c.num_tokens)
        cu.append(cu[-1] + c.num_tokens)
        if c.samples:
            logits_rows.append(cu[-1] - 1)
    for span in prompt_spans:
        row0 = cu[span.chunk_index] - chunks[span.chunk_index].start
        logits_rows.extend(range(row0 + span.first, row0 + span.end))
    width = max(len(c.request.block_ids) for c in chunks)
    table = torch.zeros(len(chunks), width, dtype=torch.int32)
    for b, c in enumerate(chunks):
        table[b, : len(c.request.block_ids)] = torch.tensor(c.request.block_ids, dtype=torch.int32)
    lens_t = torch.tensor(lens, dtype=torch.int64)
    starts_t = torch.tensor(starts, dtype=torch.int64)
    seq_index = torch.repeat_interleave(torch.arange(len(chunks)), lens_t)
    cu_t = torch.tensor(cu, dtype=torch.int64)
    positions = torch.arange(cu[-1], dtype=torch.int64) - cu_t[:-1][seq_index] + starts_t[seq_index]
    blocks = table[seq_index, positions // bs].to(torch.int64)
    slots = blocks * bs + positions % bs
    num_decodes = 0
    if out.is_prefill:
        while num_decodes < len(chunks) and chunks[num_decodes].decode:
            num_decodes += 1
        assert not any(c.decode for c in chunks[num_decodes:]), "decode chunks lead a mixed step"
    return ForwardBatch(
        num_decodes=num_decodes,
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=positions,
        slot_mapping=slots,
        seq_lens=(starts_t + lens_t).to(torch.int32),
        block_tables=table,
        logits_indices=torch.tensor(logits_rows, dtype=torch.int64),
        is_prefill=out.is_prefill,
        cu_seqlens_q=cu_t.to(torch.int32) if out.is_prefill else None,
    )
