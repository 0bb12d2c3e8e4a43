"""Conversions between the wire messages (disagg.worker.v1) and the engine's types."""

from __future__ import annotations

from disagg.proto import worker_pb2 as pb
from disagg.worker.engine.outputs import TokenLogprob
from disagg.worker.engine.resume import Resumption
from disagg.worker.engine.sampling_params import SamplingParams
from disagg.worker.engine.structured_output_params import StructuredOutputParams
from disagg.worker.serving.prefill_job import PrefillAnswer, PrefillError


def sampling_params(p: pb.SamplingParams, *, prefill_only: bool = False) -> SamplingParams:
    """Engine parameters from the wire; raises ValueError naming the field when invalid.

    For a prefill on P only the first token's distribution matters: stop strings and the stop
    checks are D's job, so P never ends a prompt early (it always finishes as "prefilled");
    min_tokens still masks EOS/stop ids when sampling that first token, so it is kept.
    """
    stop = list(p.stop) or None
    stop_ids = list(p.stop_token_ids)
    ignore_eos = p.ignore_eos
    max_tokens: int | None = p.max_tokens or None
    if prefill_only:
        stop = None
        max_tokens = None
        if p.min_tokens == 0:
            ignore_eos, stop_ids = True, []
    return SamplingParams(
        temperature=p.temperature,
        top_p=p.top_p if p.top_p > 0 else 1.0,
        top_k=p.top_k,
        min_p=p.min_p,
        seed=p.seed if p.HasField("seed") else None,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty if p.repetition_penalty > 0 else 1.0,
        max_tokens=max_tokens,
        min_tokens=p.min_tokens,
        stop=stop,
        stop_token_ids=stop_ids,
        ignore_eos=ignore_eos,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        skip_special_tokens=p.skip_special_tokens,
        include_stop_str_in_output=p.include_stop_str_in_output,
        # P constrains the first token with it too: it is the one token P samples
        structured_output=structured_output_from_proto(p.structured_output)
        if p.HasField("structured_output")
        else None,
    )


def sampling_params_to_proto(s: SamplingParams, max_tokens: int, seed: int | None) -> pb.SamplingParams:
    """The wire form of the router's parameters for one generation: `max_tokens` fitted to the
    context and `seed` this choice's (a request's n choices draw different streams)."""
    p = pb.SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty,
        max_tokens=max_tokens,
        min_tokens=s.min_tokens,
        stop=s.stop_strings,
        stop_token_ids=s.stop_token_ids,
        ignore_eos=s.ignore_eos,
        skip_special_tokens=s.skip_special_tokens,
        include_stop_str_in_output=s.include_stop_str_in_output,
    )
    if seed is not None:
        p.seed = seed
    if s.logprobs is not None:
        p.logprobs = s.logprobs
    if s.prompt_logprobs is not None:
        p.prompt_logprobs = s.prompt_logprobs
    if s.structured_output is not None:
        p.structured_output.CopyFrom(structured_output_to_proto(s.structured_output))
    return p


def resumption(request: pb.GenerateRequest) -> Resumption | None:
    """The outputs a moved stream resumes from, None for a new one."""
    if not request.HasField("resume"):
        return None
    return Resumption(tuple(request.resume.output_token_ids), request.resume.sent_chars)


def structured_output_to_proto(so: StructuredOutputParams) -> pb.StructuredOutput:
    if so.json is not None:
        return pb.StructuredOutput(json_schema=so.json)
    if so.json_object:
        return pb.StructuredOutput(json_object=True)
    if so.regex is not None:
        return pb.StructuredOutput(regex=so.regex)
    if so.choice is not None:
        return pb.StructuredOutput(choice=pb.StructuredOutput.Choices(values=so.choice))
    return pb.StructuredOutput(grammar=so.grammar)


def structured_output_from_proto(m: pb.StructuredOutput) -> StructuredOutputParams:
    kind = m.WhichOneof("kind")
    if kind is None:
        raise ValueError("structured_output names no grammar")
    if kind == "json_schema":
        return StructuredOutputParams(json=m.json_schema)
    if kind == "json_object":
        return StructuredOutputParams(json_object=True)
    if kind == "choice":
        return StructuredOutputParams(choice=tuple(m.choice.values))
    return StructuredOutputParams(**{kind: getattr(m, kind)})


def logprob_to_proto(lp: TokenLogprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top_logprobs.items()],
    )


def logprob_from_proto(lp: pb.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(lp.token_id, lp.logprob, {t.token_id: t.logprob for t in lp.top})


def prompt_logprobs_to_proto(lps: list[TokenLogprob | None]) -> list[pb.TokenLogprob]:
    """The wire form drops the first prompt token's entry, which is always None."""
    return [logprob_to_proto(lp) for lp in lps[1:]]


def prompt_logprobs_from_proto(lps) -> list[TokenLogprob | None]:
    return [None, *(logprob_from_proto(lp) for lp in lps)]


def error(code: str, message: str) -> pb.Error:
    return pb.Error(code=code, message=message)


def prefill_response(answer: PrefillAnswer, prompt_tokens: int) -> pb.PrefillResponse:
    """P's answer on the wire."""
    if isinstance(answer, PrefillError):
        return pb.PrefillResponse(error=error(answer.code, answer.message))
    first = pb.TokenLogprob(token_id=answer.token_id)
    if answer.logprob is not None:
        first = logprob_to_proto(answer.logprob)
    return pb.PrefillResponse(
        prompt_logprobs=prompt_logprobs_to_proto(answer.prompt_logprobs or []),
        first_token=first,
        prompt_tokens=prompt_tokens,
        cached_tokens=answer.cached_tokens,
        kv_bytes=answer.kv_bytes,
        transfer_seconds=answer.transfer_seconds,
        queue_seconds=answer.queue_seconds,
        compute_seconds=answer.compute_seconds,
    )
