"""Which KV heads move between which ranks when the prefill and decode workers shard the model
over different tensor-parallel degrees (pure functions; `NixlTransport.add_peer` turns them into
per-rank peers and descriptors).

Each rank's cache holds only its KV heads: [layers, blocks, 2, block_size, heads_of_rank, head_dim].
A decode rank needs exactly the heads it owns; they come from whichever prefill ranks hold them —
several prefill ranks into one decode rank (fan-in, prefill TP > decode TP), one prefill rank into
several (fan-out), and with replicated heads (TP above the KV head count) one holder is picked per
receiving rank, spread over the replicas. With equal degrees each rank sends its whole cache to the
rank of the same index, which is the single-rank transfer of today, rank by rank.

Inside one (layer, block) region a head range is contiguous only per (K or V, token) row, so a copy
of some heads of a rank is 2 * block_size byte segments per region (`block_segments`); a copy of
all of a rank's heads into a rank that holds the same heads is the whole region.
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.worker.model.parallel import kv_head_range


@dataclass(frozen=True)
class TPLayout:
    """How one worker splits the model's KV heads over its ranks (the handshake's part of it)."""

    tp_size: int
    num_kv_heads: int  # the model's, not one rank's

    def __post_init__(self):
        if self.tp_size < 1 or self.num_kv_heads < 1:
            raise ValueError(
                f"tp_size and num_kv_heads must be >= 1, got {self.tp_size}, {self.num_kv_heads}"
            )
        kv_head_range(0, self.tp_size, self.num_kv_heads)  # raises for a split the model refuses

    def heads(self, rank: int) -> range:
        """The model KV heads rank `rank` holds, in the order of its cache."""
        if not 0 <= rank < self.tp_size:
            raise ValueError(f"rank must be in [0, {self.tp_size}), got {rank}")
        return kv_head_range(rank, self.tp_size, self.num_kv_heads)

    @property
    def heads_per_rank(self) -> int:
        return len(self.heads(0))

    def holders(self, head: int) -> list[int]:
        """The ranks holding model KV head `head` (more than one when heads are replicated)."""
        return [r for r in range(self.tp_size) if head in self.heads(r)]


@dataclass(frozen=True)
class HeadCopy:
    """Model KV heads `heads` go from `src_rank`'s cache (starting at its head index
    `src_offset`) into `dst_rank`'s cache (starting at `dst_offset`)."""

    src_rank: int
    dst_rank: int
    heads: range
    src_offset: int
    dst_offset: int


def head_copies(src: TPLayout, dst: TPLayout) -> list[HeadCopy]:
    """Every copy a transfer from a `src`-sharded worker into a `dst`-sharded one needs: each
    decode rank receives each head it owns exactly once, from a prefill rank holding it; runs of
    consecutive heads between the same two ranks are one copy. Sorted by (dst_rank, head)."""
    if src.num_kv_heads != dst.num_kv_heads:
        raise ValueError(f"num_kv_heads differ: prefill {src.num_kv_heads}, decode {dst.num_kv_heads}")
    copies: list[HeadCopy] = []
    for d in range(dst.tp_size):
        for head in dst.heads(d):
            holders = src.holders(head)
            s = holders[d % len(holders)]  # replicas share the sending
            last = copies[-1] if copies else None
            if last is not None and (last.src_rank, last.dst_rank, last.heads.stop) == (s, d, head):
                copies[-1] = HeadCopy(
                    s, d, range(last.heads.start, head + 1), last.src_offset, last.dst_offset
                )
            else:
                copies.append(HeadCopy(s, d, range(head, head + 1), head - src.heads(s).start,
                                       head - dst.heads(d).start))  # fmt: skip
    return copies


def block_segments(
    copy: HeadCopy, src: TPLayout, dst: TPLayout, block_size: int, head_bytes: int
) -> list[tuple[int, int, int]]:
    """(src byte offset, dst byte offset, length) inside one (layer, block) region for `copy`;
    `head_bytes` is head_dim * itemsize. One segment when the copy is both ranks' whole region."""
    hs, hd, n = src.heads_per_rank, dst.heads_per_rank, len(copy.heads)
    if n == hs == hd:
        return [(0, 0, 2 * block_size * hs * head_bytes)]
    out = []
    for row in range(2 * block_size):  # (K or V, token) rows, heads contiguous within each
        out.append(((row * hs + copy.src_offset) * head_bytes, (row * hd + copy.dst_offset) * head_bytes,
                    n * head_bytes))  # fmt: skip
    return out
