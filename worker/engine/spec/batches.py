"""`ForwardBatch`es for speculation, built like a chunked-prefill step: each sequence contributes a
run of tokens at its next positions, attending causally to each other and to its cached context
through the block table, so the prefill attention path (native CPU, Triton, torch) runs them."""

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
    rows = list(range(cu[-1])) if all_logits else [c - 1 for c in cu[1:]]
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        seq_lens=torch.tensor([r.start + len(r.token_ids) for r in runs], dtype=torch.int32),
        block_tables=_table(runs),
        logits_indices=torch.tensor(rows, dtype=torch.int64),
        is_prefill=True,
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
    )


def decode(runs: Sequence[Run], block_size: int) -> ForwardBatch:
    """A decode step: exactly one token per run (the decode kernels' fast path)."""
    bs = block_size
    assert all(len(r.token_ids) == 1 for r in runs)
    return ForwardBatch(
        input_ids=torch.tensor([r.token_ids[0] for r in runs], dtype=torch.int64),
        positions=torch.tensor([r.start for r in runs], dtype=torch.int64),
        slot_mapping=torch.tensor(
            [r.block_ids[r.start // bs] * bs + r.start % bs for r in runs], dtype=torch.int64
        ),
        seq_lens=torch.tensor([r.start + 1 for r in runs], dtype=torch.int32),
        block_tables=_table(runs),
        logits_indices=torch.arange(len(runs), dtype=torch.int64),
        is_prefill=False,
    )


def _table(runs: Sequence[Run]) -> torch.Tensor:
    width = max(len(r.block_ids) for r in runs)
    return torch.tensor([r.block_ids + [0] * (width - len(r.block_ids)) for r in runs], dtype=torch.int32)
