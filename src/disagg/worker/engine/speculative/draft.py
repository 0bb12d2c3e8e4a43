"""A draft model proposes: a smaller model with the target's tokenizer runs the same sequences in
its own paged KV cache (own blocks, own `BlockManager`, no prefix cache), k steps per proposal.

Each proposal first catches the draft up on every token it has not computed, in one packed pass
(the whole prompt the first time: on a decode worker whose prompt K/V came from a prefill worker,
the draft's prompt K/V is computed here, which for a small draft costs little), then runs k - 1
one-token steps. After verification the draft's computed length is cut back to the tokens the
target kept, so the K/V of rejected proposals is overwritten on the next catch-up.

Greedy requests take the draft's argmax (a point mass); sampled ones draw from the draft's
distribution after their temperature, top-k, top-p and min-p, which the acceptance rule needs as q.
Under a structured-output grammar the draft samples within the grammar: the request's matcher
follows the draft tokens and is rolled back once the proposal is made.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from disagg.worker.engine.block_manager import BlockManager
from disagg.worker.engine.request import Request
from disagg.worker.engine.sampler import filter_logits
from disagg.worker.engine.seeds import DRAFT
from disagg.worker.engine.speculative import batches
from disagg.worker.engine.speculative.cost import measure_costs
from disagg.worker.engine.speculative.proposer import Proposal, Proposer
from disagg.worker.engine.structured_output import apply_bitmask, fill_bitmasks
from disagg.worker.model.runner import ModelRunner


@dataclass
class _DraftSeq:
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # leading tokens of the request's sequence with K/V in the draft cache


@dataclass
class _Drafting:
    index: int
    request: Request
    seq: _DraftSeq
    budget: int
    tokens: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)
    consumed: int = 0  # draft tokens fed to the request's grammar matcher (rolled back at the end)


def draft_distribution(
    logits: torch.Tensor, reqs: Sequence[Request], positions: Sequence[int]
) -> tuple[list[int], list[torch.Tensor | None]]:
    """One proposed token per row: the argmax for greedy requests (no distribution), else a draw
    from the row's filtered, temperature-scaled softmax, keyed by the output position it proposes."""
    tokens: list[int] = [0] * len(reqs)
    probs: list[torch.Tensor | None] = [None] * len(reqs)
    logits = logits.float()
    greedy = logits.argmax(dim=-1).tolist()
    for i, req in enumerate(reqs):
        p = req.params
        if p.greedy:
            tokens[i] = greedy[i]
            continue
        row = logits[i : i + 1] / p.temperature
        dev = row.device
        q = filter_logits(
            row, torch.tensor([p.top_k], device=dev), torch.tensor([p.top_p], device=dev),
            torch.tensor([p.min_p], device=dev),
        ).softmax(dim=-1)[0]  # fmt: skip
        tokens[i] = int(torch.multinomial(q, 1, generator=req.rng.at(positions[i], DRAFT)))
        probs[i] = q
    return tokens, probs


class DraftModelProposer(Proposer):
    name = "draft"

    def __init__(self, model, block_size: int, num_blocks: int, *, max_batch: int, cuda_graphs: bool | None):
        self.model = model
        self.block_size = block_size
        self.max_model_len = model.max_model_len
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(
            model, block_size, num_blocks, max_num_seqs=max_batch, max_model_len=self.max_model_len,
            cuda_graphs=cuda_graphs,
        )  # fmt: skip
        self.seqs: dict[str, _DraftSeq] = {}

    def step_costs(self, max_batch: int):
        return measure_costs(self.runner, self.block_size, self.bm.num_blocks, max_batch)

    def num_held_blocks(self) -> int:
        return self.bm.num_used_blocks

    def forget(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None and seq.block_ids:
            self.bm.free(seq.block_ids)

    def verified(self, request: Request) -> None:
        seq = self.seqs.get(request.request_id)
        if seq is not None:
            seq.num_computed = min(seq.num_computed, request.num_computed_tokens)

    def _fit(self, seq: _DraftSeq, num_tokens: int, keep: set[str]) -> bool:
        """Blocks for `num_tokens` positions of `seq`; when the cache is short, sequences outside
        this step (`keep` are its request ids) give theirs back first."""
        need = self.bm.blocks_for(num_tokens) - len(seq.block_ids)
        if need <= 0:
            return True
        if need > self.bm.num_free_blocks:
            for rid in [r for r in self.seqs if r not in keep]:
                self.forget(rid)
        if need > self.bm.num_free_blocks:
            return False
        seq.block_ids += self.bm.allocate(need)
        return True

    def propose(self, requests: Sequence[Request], budgets: Sequence[int]) -> list[Proposal]:
        out = [Proposal([]) for _ in requests]
        keep = {r.request_id for r in requests}
        work: list[_Drafting] = []
        for i, (req, k) in enumerate(zip(requests, budgets, strict=True)):
            k = min(k, self.max_model_len - req.num_tokens)  # positions up to N + k - 2 are written
            if k <= 0:
                continue
            seq = self.seqs.setdefault(req.request_id, _DraftSeq())
            if not self._fit(seq, req.num_tokens + k - 1, keep):
                continue
            work.append(_Drafting(i, req, seq, k))
        if not work:
            return out
        bs = self.block_size
        # catch up on every token not yet in the draft's cache; the last one's logits give token 1
        runs = []
        for w in work:
            n = w.request.num_tokens
            runs.append(
                batches.Run(
                    w.request.all_token_ids[w.seq.num_computed : n], w.seq.num_computed, w.seq.block_ids
                )
            )
            w.seq.num_computed = n
        logits = self.runner.forward(batches.build(runs, bs, all_logits=False))
        self._take(work, logits)
        for step in range(1, max(w.budget for w in work)):
            live = [w for w in work if w.budget > step]
            runs = [batches.Run([w.tokens[-1]], w.seq.num_computed, w.seq.block_ids) for w in live]
            logits = self.runner.forward(batches.rows(runs, bs, all_logits=True))
            for w in live:
                w.seq.num_computed += 1
            self._take(live, logits)
        for w in work:
            if w.consumed:
                w.request.grammar.rollback(w.consumed)
            probs = None if w.request.params.greedy else torch.stack(w.probs)
            out[w.index] = Proposal(w.tokens, probs)
        return out

    @staticmethod
    def _take(work: list[_Drafting], logits: torch.Tensor) -> None:
        """One more token per drafting request; under a grammar the draft samples within it (the
        matcher follows the draft and is rolled back afterwards) and stops where it would end."""
        constrained = [i for i, w in enumerate(work) if w.request.grammar is not None]
        if constrained:
            logits = logits.float().clone()
            masks = fill_bitmasks([work[i].request.grammar for i in constrained], logits.shape[-1])
            apply_bitmask(logits, constrained, masks)
        tokens, probs = draft_distribution(
            logits, [w.request for w in work], [w.request.num_output_tokens + len(w.tokens) for w in work]
        )
        for w, t, q in zip(work, tokens, probs, strict=True):
            grammar = w.request.grammar
            if grammar is not None and w.budget > len(w.tokens):
                if grammar.validate_tokens([t]) != 1 or not grammar.consume_token(t):
                    w.budget = len(w.tokens)  # nothing the grammar allows: stop drafting here
                    continue
                w.consumed += 1
                if grammar.is_stopped():
                    w.budget = len(w.tokens) + 1
            w.tokens.append(t)
            if q is not None:
                w.probs.append(q)
