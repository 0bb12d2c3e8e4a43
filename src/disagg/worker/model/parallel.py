"""Tensor parallelism of the Llama family: which slice of each weight a rank holds, and the
collectives that put the partial results back together.

Megatron's split: q/k/v and gate/up are column-parallel (each rank computes its own heads and its
own share of the MLP's intermediate features), o and down are row-parallel (each rank's partial
product is summed by an all-reduce), the embedding and the LM head are vocabulary-parallel. When
there are more ranks than KV heads (GQA), each rank holds the one KV head its query heads read,
so KV heads are replicated instead of split.

`ShardPlan` is pure arithmetic; `TensorParallel` binds it to a process group. With one rank no
plan is made and the model touches none of this.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShardPlan:
    """The slices rank `rank` of `world_size` holds, in heads, features and vocabulary rows."""

    rank: int
    world_size: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank (1 each when replicated)
    q_head_start: int
    kv_head_start: int
    intermediate: int  # MLP features on this rank
    vocab_shard: int  # vocabulary rows per rank (the last rank's are padded with zero rows)
    vocab_size: int
    total_kv_heads: int  # KV heads of the whole model

    @property
    def intermediate_start(self) -> int:
        return self.rank * self.intermediate

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_shard

    @property
    def vocab_end(self) -> int:
        """End of the real rows this rank holds (the padding past it is not vocabulary)."""
        return min(self.vocab_start + self.vocab_shard, self.vocab_size)

    @property
    def kv_replicated(self) -> bool:
        """Several ranks hold the same KV head (more ranks than KV heads)."""
        return self.num_kv_heads * self.world_size > self.total_kv_heads


def shard_plan(
    rank: int,
    world_size: int,
    *,
    num_attention_heads: int,
    num_key_value_heads: int,
    intermediate_size: int,
    vocab_size: int,
) -> ShardPlan:
    """The plan of one rank; ValueError naming `tensor_parallel_size` when the model cannot be split
    that way (heads or MLP features not divisible, KV heads neither divisible nor replicable)."""
    if world_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    w, hq, hkv = world_size, num_attention_heads, num_key_value_heads
    if hq % w:
        raise ValueError(f"tensor_parallel_size {w} must divide num_attention_heads {hq}")
    if intermediate_size % w:
        raise ValueError(f"tensor_parallel_size {w} must divide intermediate_size {intermediate_size}")
    kv = kv_head_range(rank, w, hkv)
    return ShardPlan(
        rank=rank,
        world_size=w,
        num_heads=hq // w,
        num_kv_heads=len(kv),
        q_head_start=rank * (hq // w),
        kv_head_start=kv.start,
        intermediate=intermediate_size // w,
        vocab_shard=-(-vocab_size // w),
        vocab_size=vocab_size,
        total_kv_heads=hkv,
    )


def kv_head_range(rank: int, world_size: int, num_kv_heads: int) -> range:
    """The KV heads rank `rank` of `world_size` holds: an equal split while there are at least as
    many heads as ranks, else the one head its query heads read (each head on world_size //
    num_kv_heads consecutive ranks)."""
    w, hkv = world_size, num_kv_heads
    if w <= hkv:
        if hkv % w:
            raise ValueError(f"tensor_parallel_size {w} must divide num_key_value_heads {hkv}")
        return range(rank * (hkv // w), (rank + 1) * (hkv // w))
    if w % hkv:
        raise ValueError(
            f"tensor_parallel_size {w} exceeds num_key_value_heads {hkv} and must be a multiple "
            f"of it (each KV head is then replicated on {w} // {hkv} ranks)"
        )
    head = rank // (w // hkv)
    return range(head, head + 1)


def plan_for(rank: int, world_size: int, config) -> ShardPlan:
    """`shard_plan` of a `ModelConfig`."""
    return shard_plan(
        rank,
        world_size,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
    )


# ---- slicing full checkpoint tensors (rows = output features, columns = input features) -----
def qkv_rows(plan: ShardPlan, full: tuple[torch.Tensor, torch.Tensor, torch.Tensor], head_dim: int) -> list:
    """This rank's rows of the q, k and v projections (weights or biases): its query heads and
    the KV heads they read."""
    q, k, v = full
    qs, ks = plan.q_head_start * head_dim, plan.kv_head_start * head_dim
    nq, nkv = plan.num_heads * head_dim, plan.num_kv_heads * head_dim
    return [q[qs : qs + nq], k[ks : ks + nkv], v[ks : ks + nkv]]


def o_columns(plan: ShardPlan, o: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The o projection's input columns that this rank's attention heads produce."""
    qs, nq = plan.q_head_start * head_dim, plan.num_heads * head_dim
    return o[:, qs : qs + nq]


def mlp_rows(plan: ShardPlan, t: torch.Tensor) -> torch.Tensor:
    """This rank's rows of gate_proj or up_proj (weight or bias): the same features of both, so
    silu(gate) * up pairs them locally."""
    return t[plan.intermediate_start : plan.intermediate_start + plan.intermediate]


def down_columns(plan: ShardPlan, down: torch.Tensor) -> torch.Tensor:
    return down[:, plan.intermediate_start : plan.intermediate_start + plan.intermediate]


def vocab_rows(plan: ShardPlan, t: torch.Tensor) -> torch.Tensor:
    """This rank's rows of the embedding or LM head, zero-padded to `vocab_shard` rows."""
    rows = t[plan.vocab_start : plan.vocab_end]
    pad = plan.vocab_shard - rows.shape[0]
    if pad:
        rows = torch.cat([rows, rows.new_zeros((pad, *rows.shape[1:]))])
    return rows


# ---- the collectives ----------------------------------------------------------------------
class TensorParallel:
    """One rank's view of its group: the plan and the collectives the model calls.

    `group` is a torch.distributed process group object (gloo on CPU, NCCL on CUDA) used
    directly, without the global default group, so an engine can own one without taking over
    its process.
    """

    def __init__(self, plan: ShardPlan, group):
        self.plan = plan
        self.group = group
        self.rank = plan.rank
        self.world_size = plan.world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place."""
        self.group.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` [N, C], side by side: [N, world_size * C] in rank order."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self.group.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def embed(self, input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel lookup: rows this rank holds, zeros for the others, summed."""
        local = input_ids - self.plan.vocab_start
        mine = (local >= 0) & (local < self.plan.vocab_end - self.plan.vocab_start)
        out = torch.nn.functional.embedding(torch.where(mine, local, 0), weight)
        out.mul_(mine.unsqueeze(-1).to(out.dtype))
        return self.all_reduce(out)

    def row_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Row-parallel projection: the partial products summed, the bias added once after."""
        out = self.all_reduce(torch.nn.functional.linear(x, weight))
        return out if bias is None else out.add_(bias)

    def lm_head(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel logits gathered to the full vocabulary [N, V] on every rank."""
        return self.all_gather(torch.nn.functional.linear(x, weight))[:, : self.plan.vocab_size]
