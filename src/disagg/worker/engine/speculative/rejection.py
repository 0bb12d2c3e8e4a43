"""Acceptance of proposed tokens (Leviathan et al. 2023, Chen et al. 2023): the tokens that come
out are distributed exactly as if each were sampled from the target.

Proposal x_j drawn from q_j is accepted with probability min(1, p_j(x_j) / q_j(x_j)); at the first
rejection the token is drawn from norm(max(0, p_j - q_j)) instead and the rest are dropped; when
all k are accepted a bonus token is drawn from p_k. A deterministic proposer (n-gram lookup, a
greedy draft) is a point mass q = 1 at x: x is accepted with probability p(x) and a rejection
draws from p with x removed. Greedy requests accept while the proposal is the argmax.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from disagg.worker.engine.seeds import ACCEPT, RESIDUAL, SAMPLE, PositionRng


def accept_greedy(target_argmax: Sequence[int], proposed: Sequence[int]) -> list[int]:
    """The tokens greedy decoding emits: the proposals while they equal the target's argmax, then
    the target's own token (a correction, or the bonus after all k)."""
    out: list[int] = []
    for j, x in enumerate(proposed):
        out.append(int(target_argmax[j]))
        if target_argmax[j] != x:
            return out
    out.append(int(target_argmax[len(proposed)]))
    return out


def accept_sampled(
    target_probs: torch.Tensor,
    proposed: Sequence[int],
    draft_probs: torch.Tensor | None,
    rng: PositionRng,
    first_position: int,
) -> list[int]:
    """The tokens emitted for one request: target_probs [k+1, V] (p at each position), draft_probs
    [k, V] (q) or None for point masses; the draws of proposal j keyed by output position
    `first_position + j` (`seeds.py`)."""
    dev = target_probs.device
    out: list[int] = []
    for j, x in enumerate(proposed):
        p = target_probs[j]
        px = float(p[x])
        qx = 1.0 if draft_probs is None else float(draft_probs[j, x])
        u = float(torch.rand((), generator=rng.at(first_position + j, ACCEPT), device=dev))
        if u * qx < px:  # u < p/q, i.e. probability min(1, p/q)
            out.append(int(x))
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[x] = 0.0
        else:
            residual = (p - draft_probs[j]).clamp_min_(0.0)
        if not float(residual.sum()) > 0.0:  # p == q up to rounding: p itself is the residual
            residual = p
        out.append(int(torch.multinomial(residual, 1, generator=rng.at(first_position + j, RESIDUAL))))
        return out
    bonus = rng.at(first_position + len(proposed), SAMPLE)
    out.append(int(torch.multinomial(target_probs[len(proposed)], 1, generator=bonus)))
    return out
