"""Speculation under a structured-output grammar: proposals are cut to the prefix the grammar
accepts, and the target's distribution at each verified position is masked by the grammar's state
after the proposals before it. The matcher is advanced through the proposals to compute those
masks and rolled back at once, so it only ever holds the tokens actually appended (the engine feeds
those to it as in plain decoding)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from disagg.worker.engine.structured_output import fill_bitmasks


def verified_masks(matcher, proposed: Sequence[int], vocab_size: int) -> tuple[list[int], torch.Tensor]:
    """The proposals the grammar allows (stopping before one that would end the grammar, which is
    left to the verify step to sample) and a bitmask per verified position [n + 1, words]."""
    n = matcher.validate_tokens(list(proposed))
    masks = [fill_bitmasks([matcher], vocab_size)[0]]
    consumed = 0
    for token in proposed[:n]:
        if not matcher.consume_token(token):
            break
        consumed += 1
        if matcher.is_stopped():  # nothing may follow: the position after it has no mask
            break
        masks.append(fill_bitmasks([matcher], vocab_size)[0])
    kept = len(masks) - 1
    if consumed:
        matcher.rollback(consumed)
    return list(proposed[:kept]), torch.stack(masks)
