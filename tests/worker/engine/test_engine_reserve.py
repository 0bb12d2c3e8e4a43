"""The decode side of a remote prefill reuses its own prefix cache: `reserve` shares the cached
leading blocks, the prefill side writes only the rest, and every block is freed exactly once."""

from __future__ import annotations

import pytest
import torch

from disagg.worker import SamplingParams
from disagg.worker.engine.block_hash import block_hashes
from disagg.worker.engine.block_manager import NoFreeBlocksError
from disagg.worker.engine.llm_engine import LLMEngine, Reservation

BS = 8


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tokens(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 500, (n,), generator=g).tolist()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)


def engine(model_dir, **kw) -> LLMEngine:
    return LLMEngine(model_dir, block_size=BS, num_gpu_blocks=kw.pop("num_gpu_blocks", 48), **kw)


def run_to_end(e: LLMEngine) -> dict[str, list[int]]:
    done = {}
    while e.has_unfinished():
        done.update({o.request_id: o.outputs[0].token_ids for o in e.step() if o.finished})
    return done


def assert_all_free(e: LLMEngine) -> None:
    bm = e.block_manager
    bm.check()
    assert bm.num_free_blocks == bm.num_blocks and bm.num_pinned == 0
    assert all(bm.ref_count(b) == 0 for b in range(bm.num_blocks))


PREFIX = tokens(1, 3 * BS)  # three full blocks


def test_reserve_shares_cached_leading_blocks_with_a_running_request(tiny_llama_dir):
    d = engine(tiny_llama_dir)
    bm = d.block_manager
    d.add_request("first", PREFIX + tokens(2, 5), greedy(20))
    d.step()  # the whole prompt is computed: its three full blocks are cached
    first_blocks = d.block_ids("first")
    used = bm.num_used_blocks

    second = PREFIX + tokens(3, 10)  # 34 tokens: 5 blocks, the first 3 cached
    dst = d.reserve("second", second, greedy(4))
    assert isinstance(dst, Reservation) and len(dst) == 5
    assert dst.num_cached_blocks == 3
    assert dst[:3] == first_blocks[:3] and dst.fresh_block_ids == dst[3:]
    assert not set(dst.fresh_block_ids) & set(first_blocks)
    assert bm.num_used_blocks == used + 2  # only the uncached blocks were allocated
    assert [bm.ref_count(b) for b in dst] == [2, 2, 2, 1, 1]
    assert d.block_ids("second") == list(dst)

    assert d.abort("second") and not d.abort("second")
    assert bm.num_used_blocks == used
    assert [bm.ref_count(b) for b in first_blocks[:3]] == [1, 1, 1]
    bm.check()
    run_to_end(d)
    assert_all_free(d)


def test_the_block_of_the_last_prompt_token_is_never_shared(tiny_llama_dir):
    d = engine(tiny_llama_dir)
    d.add_request("warm", PREFIX + [7], greedy(1))
    run_to_end(d)
    assert len(d.block_manager.lookup(block_hashes(PREFIX, BS))) == 3
    dst = d.reserve("exact", PREFIX, greedy(2))  # all three blocks cached, the last one holds the last token
    assert len(dst) == 3 and dst.num_cached_blocks == 2
    assert d.block_manager.ref_count(dst[2]) == 1 and dst[2] not in d.block_manager.lookup(
        block_hashes(PREFIX, BS)
    )
    assert d.abort("exact")
    assert_all_free(d)


def test_commit_registers_only_the_written_blocks(tiny_llama_dir):
    d = engine(tiny_llama_dir)
    bm = d.block_manager
    d.add_request("warm", PREFIX + [7], greedy(1))
    run_to_end(d)
    cached_before = bm.num_cached_blocks
    second = PREFIX + tokens(4, 10)  # 34 tokens: full blocks 0..3, block 3 new
    hashes = block_hashes(second, BS)
    dst = d.reserve("second", second, greedy(3))
    assert dst.num_cached_blocks == 3 and bm.lookup(hashes) == dst[:3]
    first = d.commit_remote_prefill("second", 42)
    assert first.num_cached_tokens == 3 * BS
    assert bm.lookup(hashes) == dst[:4]  # the new full block joined the cache
    assert bm.num_cached_blocks == cached_before + 1  # and nothing else: the partial tail is not full
    run_to_end(d)
    assert_all_free(d)
    assert d.prefix_cache_hit_rate > 0


def test_a_full_cache_refuses_the_reservation_and_keeps_no_reference(tiny_llama_dir):
    d = engine(tiny_llama_dir, num_gpu_blocks=12)
    bm = d.block_manager
    d.add_request("warm", PREFIX + [7], greedy(1))
    run_to_end(d)
    d.add_request("hog", tokens(5, 30), greedy(20))  # 4 blocks, growing
    d.step()
    free = bm.num_free_blocks
    with pytest.raises(NoFreeBlocksError):
        d.reserve("big", PREFIX + tokens(6, 50), greedy(2))  # 3 cached + 7 fresh > 8 free
    assert bm.num_free_blocks == free and "big" not in d.requests
    assert len(bm.lookup(block_hashes(PREFIX, BS))) == 3  # the shared blocks stay cached, unreferenced
    bm.check()
    run_to_end(d)
    assert_all_free(d)


def remote_turn(p: LLMEngine, d: LLMEngine, rid: str, prompt: list[int], params) -> int:
    """Prefill `prompt` on `p`, move only the blocks `d` does not hold, commit on `d`;
    returns how many blocks `d` took from its own cache."""
    p.add_request(rid, prompt, params, prefill_only=True)
    outs = []
    while p.has_unfinished():
        outs += p.step()
    (out,) = outs
    src = p.block_ids(rid)
    dst = d.reserve(rid, prompt, params)
    k = dst.num_cached_blocks
    d.kv_cache[:, dst.fresh_block_ids] = p.kv_cache[:, src[k:]]
    assert p.release(rid)
    d.commit_remote_prefill(rid, out.new_token_ids[0])
    return k


def test_second_chat_turn_reuses_the_decode_cache_and_matches_colocated(tiny_llama_dir):
    p, d, colocated = engine(tiny_llama_dir), engine(tiny_llama_dir), engine(tiny_llama_dir)
    params = greedy(12)
    turn1 = tokens(7, 21)
    assert remote_turn(p, d, "t1", turn1, params) == 0
    got1 = run_to_end(d)["t1"]
    colocated.add_request("t1", turn1, params)
    assert run_to_end(colocated)["t1"] == got1

    # the next turn extends the conversation D just decoded: its leading blocks are in D's cache
    turn2 = turn1 + got1 + tokens(8, 9)  # 42 tokens: 6 blocks, 4 full ones from turn 1
    skipped = remote_turn(p, d, "t2", turn2, params)
    assert skipped == (len(turn1) + len(got1)) // BS == 4
    colocated.add_request("t2", turn2, params)
    assert run_to_end(d)["t2"] == run_to_end(colocated)["t2"]
    for e in (p, d, colocated):
        assert_all_free(e)
