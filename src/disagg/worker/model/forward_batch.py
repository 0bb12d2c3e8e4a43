"""What one model forward pass needs to know about its packed batch.

The scheduler/model runner builds it; the model and the attention ops read it. A step is
either a prefill step (packed prompt chunks, any length each; in a mixed step the first
`num_decodes` sequences are single decode tokens, whose attention takes the decode kernel) or a
decode step (exactly one new token per sequence). Shapes follow `disagg.kernels.torch_ops`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64 token ids of this step
    positions: torch.Tensor  # [T] int64 absolute position of each token
    slot_mapping: torch.Tensor  # [T] int64 cache slot each token's K/V is written to
    seq_lens: torch.Tensor  # [B] int32 KV length of each sequence after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32
    logits_indices: torch.Tensor  # [N] int64 rows of the packed batch whose logits are wanted
    is_prefill: bool
    cu_seqlens_q: torch.Tensor | None = None  # [B+1] int32, prefill only
    num_decodes: int = 0  # prefill steps: leading sequences that are one decode token each

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    def to(self, device: torch.device | str) -> ForwardBatch:
        def move(t):
            return None if t is None else t.to(device, non_blocking=True)

        return ForwardBatch(
            input_ids=move(self.input_ids),
            positions=move(self.positions),
            slot_mapping=move(self.slot_mapping),
            seq_lens=move(self.seq_lens),
            block_tables=move(self.block_tables),
            logits_indices=move(self.logits_indices),
            is_prefill=self.is_prefill,
            cu_seqlens_q=move(self.cu_seqlens_q),
            num_decodes=self.num_decodes,
        )
