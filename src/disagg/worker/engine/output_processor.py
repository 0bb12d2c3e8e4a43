"""Sampled tokens into request state and `RequestOutput`s.

Each token is appended to its request (grammar advanced, logprob kept, text detokenized), the stop
conditions are applied to it (eos, stop ids, stop strings, max_tokens, the context), and a request
it ends leaves the scheduler and the engine's table. `output` then says what is new since the
request's last output. A plain step appends one token per request (`process`); a speculative one
appends several (`add_token` each, `output` once), stopping where a plain decode would.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from disagg.worker.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from disagg.worker.engine.request import Request, RequestStatus
from disagg.worker.engine.scheduler import Scheduler

log = logging.getLogger(__name__)


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, requests: dict[str, Request], max_model_len: int):
        self.scheduler = scheduler
        # the engine's requests by id: a finished one leaves (a prefilled one stays, pinned,
        # until the engine releases it)
        self.requests = requests
        self.max_model_len = max_model_len
        # told the id of every request that finishes here (the speculator drops its state)
        self.on_finish: Callable[[str], None] | None = None

    def process(
        self,
        reqs: Sequence[Request],
        token_ids: Sequence[int],
        logprobs: Sequence[TokenLogprob | None],
    ) -> list[RequestOutput]:
        """One sampled token per request: append each, and each request's output."""
        outputs = []
        for req, token, logprob in zip(reqs, token_ids, logprobs, strict=True):
            self.add_token(req, token, logprob)
            outputs.append(self.output(req))
        return outputs

    def add_token(self, req: Request, token: int, logprob: TokenLogprob | None) -> bool:
        """Append one sampled token and apply the stop conditions; True when it ends the request
        (its blocks are then released, or pinned for a prefill-only one)."""
        req.output_token_ids.append(token)
        if req.grammar is not None and not req.grammar.consume_token(token):
            log.warning("request %s: token %d is outside its grammar: %s", req.request_id, token,
                        req.grammar.get_error())  # fmt: skip
        if logprob is not None:
            req.logprobs.append(logprob)
        text_before = len(req.text)
        if req.detokenizer is not None:
            req.text += req.detokenizer.add(token)
        # a prefill-only request always ends here with its blocks pinned: the decode side
        # applies the stop conditions to the first token when it commits it
        status = (
            RequestStatus.FINISHED_PREFILLED
            if req.prefill_only
            else stop_status(req, token, text_before, self.max_model_len)
        )
        if status is None:
            return False
        if status != RequestStatus.FINISHED_PREFILLED:
            if req.detokenizer is not None and not isinstance(req.stop_reason, str):
                # the end: emit a held-back incomplete character as a full decode would show it
                req.text += req.detokenizer.flush()
        self.scheduler.finish(req, status)
        if status != RequestStatus.FINISHED_PREFILLED:
            del self.requests[req.request_id]
        if self.on_finish is not None:
            self.on_finish(req.request_id)
        return True

    def output(self, req: Request) -> RequestOutput:
        """The request as it stands, and what is new since its last output."""
        done = req.is_finished
        # while running, hold back a tail that could still grow into a stop string
        hold = 0 if done or req.params.include_stop_str_in_output else max(req.params.max_stop_len - 1, 0)
        upto = max(len(req.text) - hold, req.num_sent_chars)
        new_text = req.text[req.num_sent_chars : upto]
        req.num_sent_chars = upto
        new_ids = req.output_token_ids[req.num_sent_tokens :]
        want_lp = req.params.logprobs is not None
        new_lp = req.logprobs[req.num_sent_tokens :] if want_lp else None
        req.num_sent_tokens = req.num_output_tokens
        completion = CompletionOutput(
            index=0,
            text=req.text[:upto],
            token_ids=list(req.output_token_ids),
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            logprobs=list(req.logprobs) if want_lp else None,
        )
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[completion],
            finished=done,
            new_token_ids=new_ids,
            new_text=new_text,
            new_logprobs=new_lp,
            num_cached_tokens=req.num_cached_tokens,
            prompt_logprobs=req.prompt_logprobs if req.params.prompt_logprobs is not None else None,
        )


def stop_status(req: Request, token: int, text_before: int, max_model_len: int) -> RequestStatus | None:
    """How `token`, just appended, ends the request (None: it goes on). A stop string cuts the
    text (`text_before`: its length before the token)."""
    p = req.params
    n = req.num_output_tokens
    if n >= p.min_tokens:
        if not p.ignore_eos and token in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in p.stop_token_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if p.stop_strings and _cut_at_stop_string(req, text_before):
            return RequestStatus.FINISHED_STOPPED
    if p.max_tokens is not None and n >= p.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    if req.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def _cut_at_stop_string(req: Request, text_before: int) -> bool:
    """Cut the text at the earliest stop string that the new text completes."""
    p = req.params
    # a match must end inside the new text, so it starts at most max_stop_len - 1 before it
    search_from = max(0, text_before - p.max_stop_len + 1)
    best = None
    for s in p.stop_strings:
        i = req.text.find(s, search_from)
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    if best is None:
        return False
    i, s = best
    req.text = req.text[: i + len(s)] if p.include_stop_str_in_output else req.text[:i]
    req.stop_reason = s
    return True
