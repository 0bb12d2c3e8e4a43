"""`ForwardBatch`es for speculation: each sequence contributes a run of tokens at its next
positions, attending causally to each other and to its cached context through the block table.

Two shapes of the same computation:
  * `packed`: a chunked-prefill step (the prefill attention of every backend reads the earlier
    context through the block table); one attention per sequence, for long runs;
  * `rows`: a decode step with one row per token, the rows of a sequence sharing its block table
    with lengths growing by one. Every backend writes all rows' K/V before any row attends, so row
    j sees the keys of rows before it: causal attention on the decode kernels' fast path (the
    native one-call step on CPU, decode CUDA graphs), at the price of reading the context once
    per row; for the short runs of verification and of a draft's steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from disagg.worker.model.forward_batch import ForwardBatch


@dataclass
class Run:
    token_ids: list[int]  # the tokens computed this step, at positions start, start+1, ...
    start: int
    block_ids: list[int]  # covering every position up to start + len(token_ids) - 1


def packed(runs: Sequence[Run], block_size: int, *, all_logits: bool) -> ForwardBatch:
    """A packed step over `runs`; logits rows: every position of every run (all_logits: a verify
    step), else each run's last position (a draft catching up)."""
    bs = block_size
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    cu = [0]
    for run in runs:
        n = len(run.token_ids)
        ids.extend(run.token_ids)
        for pos in range(run.start, run.start + n):
            positions.append(pos)
            slots.append(run.block_ids[pos // bs] * bs + pos % bs)
        cu.append(cu[-1] + n)
    wanted = list(range(cu[-1])) if all_logits else [c - 1 for c in cu[1:]]
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        seq_lens=torch.tensor([r.start + len(r.token_ids) for r in runs], dtype=torch.int32),
        block_tables=_table(runs),
        logits_indices=torch.tensor(wanted, dtype=torch.int64),
        is_prefill=True,
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
    )


def rows(runs: Sequence[Run], block_size: int, *, all_logits: bool) -> ForwardBatch:
    """A decode-shaped step: one row per token of every run; logits rows as in `packed`."""
    bs = block_size
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    tables: list[list[int]] = []
    last: list[int] = []
    width = max(len(r.block_ids) for r in runs)
    for run in runs:
        table = run.block_ids + [0] * (width - len(run.block_ids))
        for j, tok in enumerate(run.token_ids):
            pos = run.start + j
            ids.append(tok)
            positions.append(pos)
            slots.append(run.block_ids[pos // bs] * bs + pos % bs)
            tables.append(table)
        last.append(len(ids) - 1)
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        seq_lens=torch.tensor(positions, dtype=torch.int32) + 1,
        block_tables=torch.tensor(tables, dtype=torch.int32),
        logits_indices=torch.arange(len(ids), dtype=torch.int64) if all_logits else torch.tensor(last),
        is_prefill=False,
    )


def _table(runs: Sequence[Run]) -> torch.Tensor:
    width = max(len(r.block_ids) for r in runs)
    return torch.tensor([r.block_ids + [0] * (width - len(r.block_ids)) for r in runs], dtype=torch.int32)


# Runs longer than this (a draft catching up on a prompt) or steps of more tokens go packed: the
# decode shape reads each sequence's context once per row.
MAX_ROW_RUN = 8
MAX_ROWS = 32


def build(runs: Sequence[Run], block_size: int, *, all_logits: bool) -> ForwardBatch:
    """The cheaper shape for these runs: `rows` for short runs in a small step, else `packed`."""
    lengths = [len(r.token_ids) for r in runs]
    if max(lengths) <= MAX_ROW_RUN and sum(lengths) <= MAX_ROWS:
        return rows(runs, block_size, all_logits=all_logits)
    return packed(runs, block_size, all_logits=all_logits)
