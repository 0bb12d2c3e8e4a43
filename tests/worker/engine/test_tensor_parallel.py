"""`LLMEngine(..., tensor_parallel_size=2)`: rank processes over gloo give the same greedy outputs and
logits as one rank, through ragged batches and chunked prefill, and a killed rank fails the next step
instead of hanging it."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
import torch

from disagg.worker.engine.llm_engine import LLMEngine
from disagg.worker.engine.sampling_params import SamplingParams
from disagg.worker.model.tp_executor import RankFailedError

from ..conftest import qwen2_config, save_hf_model

pytestmark = pytest.mark.slow  # each engine starts a second process (torch import, model load)

SETTINGS = dict(
    device="cpu", dtype="float32", block_size=8, num_gpu_blocks=64, max_num_batched_tokens=16, threads=1
)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)


def _run(engine: LLMEngine, prompts: list[list[int]]) -> dict[str, tuple[list[int], list]]:
    """Generate for every prompt at once (a ragged batch; prompts longer than the token budget are
    chunked); token ids and top logprobs per request."""
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, GREEDY)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].logprobs)
    assert engine.num_free_blocks == engine.num_total_blocks  # every block back
    return done


def _prompts(n_lens=(3, 13, 29)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(2, 500, (n,), generator=gen).tolist() for n in n_lens]


def _assert_same(got, want):
    assert got.keys() == want.keys()
    for rid, (ids, lps) in want.items():
        assert got[rid][0] == ids, rid
        for a, b in zip(got[rid][1], lps, strict=True):
            assert a.top_logprobs.keys() == b.top_logprobs.keys()
            for tok, lp in b.top_logprobs.items():
                assert a.top_logprobs[tok] == pytest.approx(lp, abs=1e-4)


@pytest.fixture(scope="module")
def tiny_qwen2_one_kv_head_dir(tmp_path_factory):
    return save_hf_model(qwen2_config(num_key_value_heads=1), tmp_path_factory.mktemp("qwen2-1kv"), seed=4)


@pytest.mark.parametrize(
    "model_fixture", ["tiny_llama_dir", "tiny_qwen2_one_kv_head_dir", "tiny_mistral_dir"]
)
def test_two_ranks_generate_what_one_does(request, model_fixture, one_torch_thread):
    model_dir = request.getfixturevalue(model_fixture)
    prompts = _prompts()
    want = _run(LLMEngine(model_dir, load_tokenizer=False, **SETTINGS), prompts)
    engine = LLMEngine(model_dir, load_tokenizer=False, tensor_parallel_size=2, **SETTINGS)
    try:
        assert engine.kv_cache.shape[4] == 1  # rank 0 holds one KV head (split, or replicated)
        _assert_same(_run(engine, prompts), want)
    finally:
        engine.close()
    assert [p.returncode for p in engine.ranks.procs] == [0]  # stopped cleanly


def test_a_killed_rank_fails_the_next_step(tiny_llama_dir, one_torch_thread):
    engine = LLMEngine(tiny_llama_dir, load_tokenizer=False, tensor_parallel_size=2, **SETTINGS)
    try:
        engine.add_request("a", _prompts((20,))[0], GREEDY)
        engine.step()
        os.kill(engine.ranks.procs[0].pid, signal.SIGKILL)
        engine.ranks.procs[0].wait(10)
        # found by the rank's exit, not by a collective's timeout ("... within <timeout>")
        with pytest.raises(RankFailedError, match="rank 1") as failed:
            while engine.has_unfinished():
                engine.step()
        assert "exited" in str(failed.value) and "within" not in str(failed.value)
    finally:
        engine.close()


def test_a_rank_killed_inside_a_collective_fails_the_step(tiny_llama_dir, one_torch_thread):
    """Rank 1 dies after it has the batch but before it joins the step's collectives: rank 0's
    collective fails (the peer's connection closes) instead of waiting forever."""
    engine = LLMEngine(tiny_llama_dir, load_tokenizer=False, tensor_parallel_size=2, **SETTINGS)
    try:
        engine.add_request("a", _prompts((20,))[0], GREEDY)
        ranks = engine.ranks
        send = ranks.send

        def send_then_kill(batch):
            send(batch)
            os.kill(ranks.procs[0].pid, signal.SIGKILL)

        ranks.send = send_then_kill
        with pytest.raises(RankFailedError) as failed:  # the closed connection, not a timeout
            engine.step()
        assert not re.search(r"within|timed? ?out", str(failed.value), re.IGNORECASE), failed.value
    finally:
        engine.close()


def test_a_model_the_ranks_cannot_split_is_refused_before_any_rank_starts(tiny_llama_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide num_attention_heads 4"):
        LLMEngine(tiny_llama_dir, load_tokenizer=False, tensor_parallel_size=3, **SETTINGS)


def test_ranks_exit_when_rank_0_is_killed(tiny_llama_dir, tmp_path):
    """No orphans: a child rank whose rank 0 died (SIGKILL, no cleanup) exits on its own."""
    import subprocess
    import sys

    script = (
        "import sys, time\n"
        "from disagg.worker.engine.llm_engine import LLMEngine\n"
        f"e = LLMEngine({str(tiny_llama_dir)!r}, load_tokenizer=False, tensor_parallel_size=2, device='cpu',"
        " dtype='float32', num_gpu_blocks=16, block_size=8, threads=1)\n"
        "print(e.ranks.procs[0].pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 20
        while os.path.exists(f"/proc/{child}") and "zombie" not in _state(child):
            assert time.monotonic() < deadline, "the rank outlived its rank 0"
            time.sleep(0.1)
    finally:
        parent.kill()


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(line for line in f if line.startswith("State:")).lower()
    except (OSError, StopIteration):
        return "zombie"


def test_after_a_failed_step_every_step_fails_at_once(tiny_llama_dir, one_torch_thread):
    """A step that failed on rank 0 leaves the ranks out of step: the group is not used again."""
    engine = LLMEngine(tiny_llama_dir, load_tokenizer=False, tensor_parallel_size=2, **SETTINGS)
    try:
        engine.add_request("a", _prompts((20,))[0], GREEDY)
        real = engine.runner.runner.forward

        def broken(batch, hook=None):
            raise RuntimeError("device error")

        engine.runner.runner.forward = broken
        with pytest.raises(RankFailedError, match="device error"):
            engine.step()
        engine.runner.runner.forward = real
        with pytest.raises(RankFailedError, match="failed earlier: RuntimeError: device error"):
            engine.step()
    finally:
        engine.close()


def _listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp writes them) of sockets listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


def test_the_rendezvous_store_of_ranks_on_one_host_listens_on_loopback_only(tiny_llama_dir, one_torch_thread):
    # torch's store has no credential: with every rank on this host, nothing else may reach it
    engine = LLMEngine(tiny_llama_dir, load_tokenizer=False, tensor_parallel_size=2, **SETTINGS)
    try:
        assert _listening_addresses(engine.ranks._store.port) == {"0100007F"}
    finally:
        engine.close()
