"""The request that resumes a moved stream (pure; the moves themselves: tests/worker/serving/test_migration.py)."""

from __future__ import annotations

from disagg.proto import worker_pb2 as pb
from disagg.worker.router.migration import (
    MIGRATION_SUFFIX,
    MOVABLE_ERRORS,
    finished_message,
    resumed_request,
    worth_pulling,
)


def _original() -> pb.GenerateRequest:
    req = pb.GenerateRequest(
        request_id="abc-1",
        prompt_token_ids=[5, 6, 7],
        params=pb.SamplingParams(temperature=0.5, max_tokens=40, seed=9, prompt_logprobs=2, logprobs=1),
        prefill_targets=[pb.PrefillTarget(worker_id="p0", address="p0:1")],
    )
    return req


def test_the_resumed_request_carries_what_was_sent_and_nothing_to_redo():
    original = _original()
    req = resumed_request(original, "abc-1", 2, [11, 12, 13], 7)
    assert req.request_id == f"abc-1{MIGRATION_SUFFIX}2"
    assert list(req.prompt_token_ids) == [5, 6, 7]  # the prompt, not prompt + outputs
    assert list(req.resume.output_token_ids) == [11, 12, 13] and req.resume.sent_chars == 7
    assert not req.prefill_targets  # the router adds the new worker's own
    assert not req.resume.handoff_of
    assert not req.params.HasField("prompt_logprobs")  # sent with the first worker's first message
    assert (req.params.seed, req.params.max_tokens, req.params.logprobs) == (9, 40, 1)
    # the original is left as it was
    assert original.prefill_targets and original.params.HasField("prompt_logprobs")
    assert not original.HasField("resume")


def test_a_handed_off_stream_names_its_holder_and_its_request_id_there():
    original = _original()
    original.request_id = f"abc-1{MIGRATION_SUFFIX}1"  # moved once already
    holder = pb.PrefillTarget(worker_id="d0", address="d0:1")
    req = resumed_request(original, "abc-1", 2, [11, 12], 4, holder)
    assert [(t.worker_id, t.address) for t in req.prefill_targets] == [("d0", "d0:1")]  # only the holder
    assert req.resume.handoff_of == f"abc-1{MIGRATION_SUFFIX}1"  # the id the holder knows it by
    assert req.request_id == f"abc-1{MIGRATION_SUFFIX}2"


def test_a_pull_needs_a_full_block_besides_the_last_tokens_one():
    assert not worth_pulling(16, 16)  # one block, holding the last token: nothing to pull
    assert worth_pulling(17, 16)
    assert not worth_pulling(1, 16)


def test_an_empty_resume_still_marks_a_moved_stream():
    assert resumed_request(_original(), "abc-1", 1, [], 0).HasField("resume")


def test_which_worker_errors_move_a_stream():
    assert MOVABLE_ERRORS["migrate"] == "draining" and MOVABLE_ERRORS["engine_failed"] == "unavailable"
    assert "invalid_request" not in MOVABLE_ERRORS  # it would fail the same anywhere


def test_a_stream_cut_after_its_last_token_ends_with_its_counts():
    msg = finished_message(3, 40)
    assert msg.finish_reason == "length" and (msg.usage.prompt_tokens, msg.usage.completion_tokens) == (3, 40)
