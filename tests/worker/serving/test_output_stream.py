"""A Generate stream's messages: the tokens a worker gathers per message (`stream_interval`), the
first token and the end sent at once, and nothing gathered lost before a hand-off, an abort or an
engine failure."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from disagg.proto import worker_pb2 as pb
from disagg.worker.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from disagg.worker.serving.metrics import ServingMetrics
from disagg.worker.serving.output_stream import OutputStream

PROMPT = [1, 2, 3]


def _outputs(n: int, finish_at: int | None = None) -> list[RequestOutput]:
    """One output per step, token t (text f"<t>", logprob -t); the last finishes when asked."""
    outs, ids = [], []
    for t in range(1, n + 1):
        ids.append(t)
        done = t == finish_at
        outs.append(
            RequestOutput(
                request_id="r", prompt=None, prompt_token_ids=PROMPT, finished=done,
                outputs=[CompletionOutput(0, "", list(ids), finish_reason="length" if done else None)],
                new_token_ids=[t], new_text=f"<{t}>", new_logprobs=[TokenLogprob(t, -float(t))],
            )
        )  # fmt: skip
    return outs


def _messages(interval: int, feed: list) -> list[pb.GenerateResponse]:
    """The messages a stream of `interval` yields for `feed` (outputs, or an end: None, an
    exception, or "hand_off")."""

    async def run():
        metrics = ServingMetrics("decode", "m", CollectorRegistry())
        stream = OutputStream(len(PROMPT), metrics, 16, interval)
        for item in feed:
            stream.hand_off() if item == "hand_off" else stream.sink(item)
        got = []
        async for msg in stream.messages(pb.ServedBy(decode_worker="decode-0")):
            got.append(msg)
        return got, stream.finished

    got, _finished = asyncio.run(run())
    return got


def _tokens(msgs: list[pb.GenerateResponse]) -> list[list[int]]:
    return [list(m.token_ids) for m in msgs]


def test_each_step_goes_out_alone_at_interval_one():
    msgs = _messages(1, _outputs(5, finish_at=5))
    assert _tokens(msgs) == [[1], [2], [3], [4], [5]]
    assert msgs[0].served_by.decode_worker == "decode-0" and msgs[-1].finish_reason == "length"
    assert msgs[-1].usage.completion_tokens == 5


def test_a_larger_interval_gathers_tokens_text_and_logprobs_keeping_the_first_and_the_end_at_once():
    msgs = _messages(4, _outputs(11, finish_at=11))
    # the first token at once (time to first token), then 4 at a time, the end with what is left
    assert _tokens(msgs) == [[1], [2, 3, 4, 5], [6, 7, 8, 9], [10, 11]]
    assert [m.text for m in msgs] == ["<1>", "<2><3><4><5>", "<6><7><8><9>", "<10><11>"]
    assert [lp.token_id for m in msgs for lp in m.logprobs] == list(range(1, 12))
    assert msgs[0].HasField("served_by") and not msgs[1].HasField("served_by")
    assert msgs[-1].finish_reason == "length" and msgs[-1].usage.completion_tokens == 11
    assert [m.finish_reason for m in msgs[:-1]] == ["", "", ""]


def test_what_is_gathered_goes_out_before_a_hand_off_an_abort_or_a_failure():
    for end, last in (("hand_off", "migrate"), (RuntimeError("boom"), "engine_failed"), (None, None)):
        msgs = _messages(8, [*_outputs(6), end])
        assert _tokens(msgs) == [[1], [2, 3, 4, 5, 6], []], end
        if last is None:  # an abort ends the stream with its reason
            assert msgs[-1].finish_reason == "abort" and not msgs[-1].HasField("error")
        else:
            assert msgs[-1].error.code == last
