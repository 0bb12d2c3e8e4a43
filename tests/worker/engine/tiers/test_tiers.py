"""The engine with KV tiers: blocks evicted to host memory and disk come back bit for bit, a
damaged disk block is recomputed, and admission restores only what fits."""

from __future__ import annotations

import pytest
import torch

from disagg.worker import SamplingParams
from disagg.worker.engine.block_hash import block_hashes
from disagg.worker.engine.block_manager import BlockManager
from disagg.worker.engine.llm_engine import LLMEngine
from disagg.worker.engine.request import Request
from disagg.worker.engine.scheduler import Scheduler
from disagg.worker.engine.tiers import block_file

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BS = 8
PROMPT = 64  # 8 blocks; admission may take 7 from a cache (the last token is computed)


def _prompt(seed: int, n: int = PROMPT) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 500, (n,), generator=g).tolist()


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6, logprobs=5)


def _run(engine: LLMEngine, prompt: list[int], rid: str):
    engine.add_request(rid, prompt, _params())
    last = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                last = out
    return last


def _seen(out):
    c = out.outputs[0]
    return c.token_ids, [(lp.token_id, lp.logprob, lp.top_logprobs) for lp in c.logprobs]


def _engine(model, kv_cache_dtype: str, num_blocks: int, **tiers) -> LLMEngine:
    return LLMEngine(model, block_size=BS, num_gpu_blocks=num_blocks, max_num_batched_tokens=128,
                     kv_cache_dtype=kv_cache_dtype, load_tokenizer=False, **tiers)  # fmt: skip


def _tiered(model, kv_cache_dtype, tmp_path, host_blocks: int) -> LLMEngine:
    probe = _engine(model, kv_cache_dtype, 16)
    block_bytes = probe.model.kv_cache_block_bytes(BS)
    probe.close()
    # 12 cache blocks: one 64-token prompt and its outputs at a time; the rest lives below
    return _engine(model, kv_cache_dtype, 12, kv_host_cache_memory=host_blocks * block_bytes,
                   kv_disk_cache_dir=str(tmp_path / "kv"), kv_disk_cache_size=1 << 30)  # fmt: skip


def _evict_everything(engine: LLMEngine, seeds=(101, 102, 103)) -> None:
    for s in seeds:
        _run(engine, _prompt(s), f"filler-{s}")
    if engine.tiers.disk is not None:
        engine.tiers.disk.flush()


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("host_blocks", [64, 3], ids=["host", "disk"])
def test_blocks_come_back_from_host_and_disk_bit_for_bit(
    tiny_llama_dir, tmp_path, kv_cache_dtype, host_blocks
):
    """A prompt whose blocks were evicted to the host tier (64 slots) or through it to disk (3
    slots) gets exactly the tokens and logprobs of a warm prefix-cache hit, and the tokens of a
    cold run; a quantized cache's blocks travel as their bytes."""
    prompt = _prompt(1)
    warm = _engine(tiny_llama_dir, kv_cache_dtype, 64)
    cold = _run(warm, prompt, "cold")
    hit = _run(warm, prompt, "warm")
    assert hit.num_cached_tokens == 7 * BS

    engine = _tiered(tiny_llama_dir, kv_cache_dtype, tmp_path, host_blocks)
    try:
        assert _seen(_run(engine, prompt, "first")) == _seen(cold)
        _evict_everything(engine)
        assert not engine.block_manager.lookup(block_hashes(prompt, BS)[:1]), "the prompt was not evicted"
        assert engine.cached_prefix_tokens(prompt) == PROMPT  # every full block, somewhere below
        again = _run(engine, prompt, "again")
        assert again.num_cached_tokens == 7 * BS
        assert _seen(again) == _seen(hit)
        assert _seen(again)[0] == _seen(cold)[0]
        counters = engine.tiers.counters
        tier = "host" if host_blocks == 64 else "disk"
        assert counters[tier].hits == 7 and engine.scheduler.tier_hit_tokens == 7 * BS
        engine.block_manager.check()
        engine.tiers.host.check()
    finally:
        engine.close()
    assert not list((tmp_path / "kv").glob("*" + block_file.SUFFIX))


def test_a_flipped_byte_in_a_disk_block_is_recomputed_not_served(tiny_llama_dir, tmp_path):
    prompt = _prompt(2)
    engine = _tiered(tiny_llama_dir, "auto", tmp_path, host_blocks=3)
    try:
        cold = _run(engine, prompt, "cold")
        _evict_everything(engine)
        hashes = block_hashes(prompt, BS)
        assert all(engine.tiers.disk.holds(h) for h in hashes[:7])
        path = engine.tiers.disk.file_path(hashes[3])
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x10
        path.write_bytes(data)
        again = _run(engine, prompt, "again")
        assert _seen(again)[0] == _seen(cold)[0]
        assert again.num_cached_tokens == 3 * BS  # blocks 0-2 restored; 3 on are computed
        assert engine.tiers.disk.corrupt == 1 and not engine.tiers.disk.holds(hashes[3])
    finally:
        engine.close()


def test_a_queued_prompts_disk_blocks_are_prefetched(tiny_llama_dir, tmp_path):
    prompt = _prompt(3)
    engine = _tiered(tiny_llama_dir, "auto", tmp_path, host_blocks=3)
    try:
        _run(engine, prompt, "cold")
        _evict_everything(engine)
        engine.add_request("again", prompt, _params())  # queued: its disk blocks start loading
        engine.tiers.disk.wait_prefetched()
        for h in block_hashes(prompt, BS)[:7]:
            path = engine.tiers.disk.file_path(h)
            if path.exists():
                path.unlink()  # whatever was staged is served from memory
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
        assert outs[-1].num_cached_tokens == 7 * BS
    finally:
        engine.close()


# ---- admission against the tiers, without a model ----------------------------------------------


class _Tiers:
    """Holds every block of `held`; `readable` of them restore, then a read fails."""

    def __init__(self, held: int, readable: int):
        self.held, self.readable = held, readable
        self.restored: list[list[int]] = []
        self.open_hits = 0

    def find(self, hashes, token_ids, first, last):
        self.open_hits += 1
        return list(range(first, min(last, self.held)))

    def restore(self, hit, block_ids):
        self.open_hits -= 1
        n = min(len(hit), max(self.readable - hit[0], 0) if hit else 0)
        self.restored.append(list(block_ids[:n]))
        return n

    def release(self, hit):
        self.open_hits -= 1


def _admit(num_blocks: int, tiers: _Tiers, prompt_len: int = 80, budget: int = 128):
    bm = BlockManager(num_blocks, BS)
    sched = Scheduler(bm, max_num_batched_tokens=budget)
    sched.tiers = tiers
    req = Request("r", list(range(100, 100 + prompt_len)), SamplingParams(max_tokens=2))
    sched.add(req)
    out = sched.schedule()
    return sched, req, out


def test_admission_restores_then_computes_the_rest():
    tiers = _Tiers(held=10, readable=10)
    sched, req, out = _admit(32, tiers)
    assert req.num_computed_tokens == 9 * BS  # at most (80 - 1) // 8 blocks; the 10th is computed
    assert out.chunks[0].start == 9 * BS and out.chunks[0].num_tokens == 8
    assert tiers.restored == [req.block_ids[:9]] and tiers.open_hits == 0
    hashes = block_hashes(req.all_token_ids, BS)
    assert sched.bm.lookup(hashes) == req.block_ids[:9]  # restored blocks are cached again


def test_a_block_that_cannot_be_read_is_computed_instead():
    tiers = _Tiers(held=10, readable=4)
    sched, req, out = _admit(32, tiers)
    assert req.num_computed_tokens == 4 * BS
    assert out.chunks[0].start == 4 * BS and out.chunks[0].end == 80
    assert sched.tier_hit_tokens == 4 * BS and tiers.open_hits == 0
    sched.bm.check()


def test_restoring_takes_no_more_blocks_than_are_free():
    """4 free blocks: 3 restored, one left to compute into; the rest of the prompt waits for more
    blocks like any chunked prefill."""
    tiers = _Tiers(held=10, readable=10)
    sched, req, out = _admit(4, tiers)
    assert req.num_computed_tokens == 3 * BS and len(req.block_ids) == 4
    assert out.chunks[0].num_tokens == 8 and tiers.open_hits == 0


def test_random_traffic_gives_the_tokens_of_a_big_cache_and_keeps_every_tier_consistent(
    tiny_llama_dir, tmp_path
):
    """Prompts sharing prefixes of random lengths, in random batches, through a 12-block cache with a
    3-slot host tier and a disk tier of 10 blocks (so every tier evicts): every output equals an
    engine whose cache never evicts, and afterwards the host slots, the disk index, its byte count
    and the files on disk all agree (each block freed exactly once)."""
    import random

    rng = random.Random(5)
    stems = [_prompt(200 + i, n=5 * BS) for i in range(4)]
    prompts = [
        rng.choice(stems)[: rng.randrange(1, 5 * BS)] + _prompt(300 + i, n=rng.randrange(1, 20))
        for i in range(30)
    ]
    big = _engine(tiny_llama_dir, "auto", 256)
    engine = _tiered(tiny_llama_dir, "auto", tmp_path, host_blocks=3)
    disk = engine.tiers.disk
    disk.capacity_bytes = 10 * block_file.file_size(BS, engine.tiers.block_bytes)
    try:
        i = 0
        while i < len(prompts):
            batch = prompts[i : i + rng.randrange(1, 4)]
            for j, p in enumerate(batch):
                engine.add_request(f"t{i + j}", p, _params())
            got = {}
            while engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        got[out.request_id] = _seen(out)[0]
            for j, p in enumerate(batch):
                assert got[f"t{i + j}"] == _seen(_run(big, p, f"r{i + j}"))[0], f"prompt {i + j}"
            i += len(batch)
        disk.flush()
        engine.block_manager.check()
        engine.tiers.host.check()
        on_disk = {p.name: p.stat().st_size for p in disk.dir.glob("*" + block_file.SUFFIX)}
        assert set(on_disk) == {block_file.file_name(h) for h in disk._index}
        assert disk.used_bytes == sum(on_disk.values()) <= disk.capacity_bytes
        assert disk.evictions > 0 and engine.tiers.host.evictions > 0
        assert sum(c.hits for c in engine.tiers.counters.values()) > 0
    finally:
        engine.close()
