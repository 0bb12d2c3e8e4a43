"""One decode step done speculatively: propose, verify in one target pass, accept, roll back.

Each running sequence of the step contributes its last sampled token and its k proposals (k may be
0, and differs per sequence) as one run of a packed batch; the logits of every position give the
target's distribution after each prefix of the proposals (`target.py`), and `rejection.py` decides
how many are kept plus one token of the target's own. Tokens go through the engine's output
processor one by one, so stop ids, stop strings, max_tokens and logprobs apply at every length
and end the request where a plain decode would. Afterwards the request's computed length is its
kept tokens; blocks only rejected tokens used go back to the pool, and only full blocks of kept
tokens reach the prefix cache.

Requests under a structured-output grammar speculate too: their proposals are cut to what the
grammar allows and each verified position is masked by the grammar's state there (`grammar.py`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

import torch

from disagg.worker.engine.block_manager import BlockManager
from disagg.worker.engine.output_processor import OutputProcessor
from disagg.worker.engine.outputs import RequestOutput, TokenLogprob
from disagg.worker.engine.request import Request
from disagg.worker.engine.sampler import Sampler, _top_logprobs
from disagg.worker.engine.scheduler import Scheduler, SchedulerOutput
from disagg.worker.engine.speculative import batches
from disagg.worker.engine.speculative.acceptance import AcceptanceEstimate
from disagg.worker.engine.speculative.config import SpeculativeConfig
from disagg.worker.engine.speculative.cost import StepCosts, choose_k, measure_costs
from disagg.worker.engine.speculative.grammar import verified_masks
from disagg.worker.engine.speculative.proposer import Proposal, Proposer
from disagg.worker.engine.speculative.rejection import accept_greedy, accept_sampled
from disagg.worker.engine.speculative.stats import SpecStats
from disagg.worker.engine.speculative.target import final_logits, needs_processing
from disagg.worker.engine.speculative.throughput import ThroughputCheck
from disagg.worker.model.forward_batch import ForwardBatch


class Runner(Protocol):
    """What the speculator runs the target's verify passes on (`ModelRunner`, or its
    tensor-parallel twin)."""

    def forward(self, batch: ForwardBatch) -> torch.Tensor: ...


def make_proposer(config: SpeculativeConfig, *, dtype: str, device: str, block_size: int, vocab_size: int,
                  max_model_len: int, cuda_graphs: bool | None) -> Proposer:  # fmt: skip
    """The configured proposer; a draft model is loaded here, with a cache for `max_batch`
    sequences of the target's longest length plus as many again (sequences outside the current
    step give theirs back when it runs short)."""
    if config.method == "ngram":
        from disagg.worker.engine.speculative.ngram import NgramProposer

        return NgramProposer(config.ngram_min, config.ngram_max)
    from disagg.worker.engine.speculative.draft import DraftModelProposer
    from disagg.worker.model.loader import load_model

    model, draft_config = load_model(config.draft_model, dtype=dtype, device=device)
    if draft_config.vocab_size != vocab_size:
        raise ValueError(
            f"speculative_draft_model has a vocabulary of {draft_config.vocab_size} tokens, the target "
            f"{vocab_size}: a draft must share the target's tokenizer"
        )
    per_seq = -(-(min(max_model_len, model.max_model_len) + config.num_tokens) // block_size)
    return DraftModelProposer(
        model, block_size, 2 * config.max_batch * per_seq, max_batch=config.max_batch, cuda_graphs=cuda_graphs
    )


class Speculator:
    def __init__(
        self,
        config: SpeculativeConfig,
        proposer: Proposer,
        *,
        runner: Runner,
        scheduler: Scheduler,
        sampler: Sampler,
        outputs: OutputProcessor,
        max_model_len: int,
        vocab_size: int,
    ):
        """The engine's parts one speculative step uses: `runner` verifies, `scheduler`'s block
        manager holds the proposals' K/V, `sampler` samples sequences without proposals,
        `outputs` appends the accepted tokens (and tells `forget` of a request it finishes)."""
        self.config = config
        self.proposer = proposer
        self.runner = runner
        self.scheduler = scheduler
        self.block_manager: BlockManager = scheduler.bm
        self.sampler = sampler
        self.outputs = outputs
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.estimate = AcceptanceEstimate(config.min_acceptance)
        self.stats = SpecStats(proposer.name, config.num_tokens)
        # measured step times that decide whether (and how far) to speculate; None: always propose
        # what the budgets allow
        self.throughput = ThroughputCheck() if config.adaptive else None
        self._choices: dict[tuple, int] = {}
        self.costs: StepCosts | None = None
        self.draft_costs: StepCosts | None = None
        if config.adaptive:
            bm = self.block_manager
            self.costs = measure_costs(
                runner, bm.block_size, bm.num_blocks, config.max_batch * (config.num_tokens + 1)
            )
            self.draft_costs = proposer.step_costs(config.max_batch)

    def forget(self, request_id: str) -> None:
        """The request left the running set (finished, aborted): release its proposer state."""
        self.proposer.forget(request_id)
        self.estimate.forget(request_id)

    def step(self, out: SchedulerOutput) -> list[RequestOutput] | None:
        """Run the decode step `out` speculatively; None when nothing is proposed (or the batch is
        too large to gain): the caller runs it as a plain decode step."""
        for req in out.preempted:
            self.proposer.forget(req.request_id)
        started = time.perf_counter()
        reqs = [c.request for c in out.chunks]
        budgets = self._budgets(reqs)
        if not any(budgets):
            for req in reqs:
                self.estimate.idle(req.request_id)
            return None
        proposals = self.proposer.propose(reqs, budgets)
        masks = self._grammar_masks(reqs, proposals)
        proposals = [self._fit(r, p) for r, p in zip(reqs, proposals, strict=True)]
        if not any(p.token_ids for p in proposals):
            for req in reqs:  # a draft ran ahead on tokens no one verifies: cut it back
                self.proposer.verified(req)
            return None
        runs = [
            batches.Run([r.token_at(r.num_tokens - 1), *p.token_ids], r.num_tokens - 1, r.block_ids)
            for r, p in zip(reqs, proposals, strict=True)
        ]
        logits = self.runner.forward(batches.build(runs, self.block_manager.block_size, all_logits=True))
        self.stats.num_verify_steps += 1
        emitted = self._accept(logits, reqs, proposals, masks)
        outputs = []
        for req, p, (tokens, logprobs) in zip(reqs, proposals, emitted, strict=True):
            outputs.append(self._apply(req, p, tokens, logprobs))
        if self.throughput is not None:
            tokens = sum(len(t) for t, _ in emitted)
            self.throughput.speculative_step(len(reqs), time.perf_counter() - started, tokens)
        return outputs

    def plain_step(self, batch: int, seconds: float) -> None:
        """A decode step of `batch` sequences ran without speculation and took `seconds`."""
        if self.throughput is not None:
            self.throughput.plain_step(batch, seconds)

    def _budgets(self, reqs: Sequence[Request]) -> list[int]:
        """Tokens each request proposes this step: none in a batch over `max_batch`, or where the
        measured costs say a plain step is faster; else the most expected tokens per second."""
        if len(reqs) > self.config.max_batch:
            return [0] * len(reqs)
        if self.throughput is not None and not self.throughput.allows(len(reqs)):
            return [0] * len(reqs)
        alphas = [self.estimate.rate(r.request_id) for r in reqs]
        budgets = [self._budget(r) if a > 0 else 0 for r, a in zip(reqs, alphas, strict=True)]
        if self.costs is None or not any(budgets):
            return budgets
        # steps repeat the same question (same budgets, rates that barely move): answer it once
        key = (tuple(budgets), tuple(round(a, 2) for a in alphas))
        k = self._choices.get(key)
        if k is None:
            if len(self._choices) > 4096:
                self._choices.clear()
            k = self._choices[key] = choose_k(alphas, budgets, self.costs, self.draft_costs)
        return [min(b, k) for b in budgets]

    def _budget(self, req: Request) -> int:
        """How many tokens `req` may propose: never more than its output or the context can still
        take beyond the token the step samples anyway."""
        k = min(self.config.num_tokens, self.max_model_len - req.num_tokens - 1)
        if req.params.max_tokens is not None:
            k = min(k, req.params.max_tokens - req.num_output_tokens - 1)
        return max(k, 0)

    def _fit(self, req: Request, proposal: Proposal) -> Proposal:
        """Give `req` blocks for its proposals' K/V, cutting them to what the free blocks hold
        (speculation never preempts)."""
        bm = self.block_manager
        n = req.num_tokens  # positions n - 1 .. n - 1 + k are computed
        k = len(proposal.token_ids)
        capacity = (len(req.block_ids) + bm.num_free_blocks) * bm.block_size
        k = max(min(k, capacity - n), 0)
        need = bm.blocks_for(n + k) - len(req.block_ids)
        if need > 0:
            req.block_ids += bm.allocate(need)
        if k == len(proposal.token_ids):
            return proposal
        probs = None if proposal.draft_probs is None else proposal.draft_probs[:k]
        return Proposal(proposal.token_ids[:k], probs)

    def _grammar_masks(self, reqs: Sequence[Request], proposals: list[Proposal]) -> dict[int, torch.Tensor]:
        """For requests under a grammar: proposals cut to what the grammar allows (in place) and
        the mask of every verified position, by index in the step."""
        masks = {}
        vocab = self.vocab_size
        for i, (req, p) in enumerate(zip(reqs, proposals, strict=True)):
            if req.grammar is None or not p.token_ids:
                continue
            kept, masks[i] = verified_masks(req.grammar, p.token_ids, vocab)
            if len(kept) < len(p.token_ids):
                probs = None if p.draft_probs is None else p.draft_probs[: len(kept)]
                proposals[i] = Proposal(kept, probs)
        return masks

    def _accept(
        self,
        logits: torch.Tensor,
        reqs: Sequence[Request],
        proposals: Sequence[Proposal],
        grammar_masks: dict[int, torch.Tensor],
    ) -> list[tuple[list[int], list[TokenLogprob | None]]]:
        """Per request: the tokens it emits this step and their logprobs (None when not asked)."""
        plain_greedy = all(
            r.params.greedy
            and r.params.logprobs is None
            and r.grammar is None
            and not needs_processing(r, len(p.token_ids))
            for r, p in zip(reqs, proposals, strict=True)
        )
        argmax = logits.argmax(dim=-1).tolist() if plain_greedy else None
        # sequences without proposals sample as in a plain decode step (grammars included)
        starts, row = [], 0
        for p in proposals:
            starts.append(row)
            row += len(p.token_ids) + 1
        plain = [i for i, p in enumerate(proposals) if not p.token_ids]
        sampled = {}
        if plain and argmax is None:
            rows = logits.index_select(0, torch.tensor([starts[i] for i in plain], device=logits.device))
            s = self.sampler(rows, [reqs[i] for i in plain])
            sampled = {i: ([t], [lp]) for i, t, lp in zip(plain, s.token_ids, s.logprobs, strict=True)}
        out = []
        for i, (req, p) in enumerate(zip(reqs, proposals, strict=True)):
            row = starts[i]
            if i in sampled:
                out.append(sampled[i])
                continue
            k = len(p.token_ids)
            if argmax is not None:
                tokens = accept_greedy(argmax[row : row + k + 1], p.token_ids)
                out.append((tokens, [None] * len(tokens)))
                continue
            masks = grammar_masks.get(i)
            if masks is not None:
                masks = masks[: k + 1]  # proposals may have been cut to the free blocks since
            final = final_logits(logits[row : row + k + 1], req, p.token_ids, masks)
            if req.params.greedy:
                tokens = accept_greedy(final.argmax(dim=-1).tolist(), p.token_ids)
            else:
                tokens = accept_sampled(
                    final.softmax(dim=-1), p.token_ids, p.draft_probs, req.rng, req.num_output_tokens
                )
            lps: list[TokenLogprob | None] = [None] * len(tokens)
            if req.params.logprobs is not None:
                lp = final[: len(tokens)].log_softmax(dim=-1)
                lps = [_top_logprobs(lp[j], t, req.params.logprobs) for j, t in enumerate(tokens)]
            out.append((tokens, lps))
        return out

    def _apply(
        self, req: Request, proposal: Proposal, tokens: list[int], logprobs: list[TokenLogprob | None]
    ) -> RequestOutput:
        """Append the emitted tokens until one ends the request, then roll the cache back to them."""
        k = len(proposal.token_ids)
        if k:
            self.stats.record(k, len(tokens) - 1)
            self.estimate.record(req.request_id, k, len(tokens) - 1)
        else:
            self.estimate.idle(req.request_id)
        for token, lp in zip(tokens, logprobs, strict=True):
            self.stats.num_emitted += 1
            if self.outputs.add_token(req, token, lp):
                return self.outputs.output(req)  # finished: its blocks were released
        # K/V is valid for every token but the last emitted one (never computed): drop the blocks
        # past it, which only rejected proposals wrote
        req.num_computed_tokens = req.num_tokens - 1
        bm = self.block_manager
        keep = bm.blocks_for(req.num_computed_tokens)
        if len(req.block_ids) > keep:
            bm.free(req.block_ids[keep:])
            del req.block_ids[keep:]
        self.scheduler._register_computed_blocks(req)
        self.proposer.verified(req)
        return self.outputs.output(req)
