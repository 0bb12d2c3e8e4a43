"""KV tiers in a served deployment, with real processes: a decode worker whose cache holds a few
prompts keeps the rest in host memory and on disk, serves a returning prompt from there (the
remote prefill sends only what is missing), keeps those blocks in the Redis prefix index, and
when it is killed with blocks in every tier leaves nothing in Redis after its lease and nothing
on disk once it starts again."""

from __future__ import annotations

import random
import time

import pytest
import redis

from disagg.worker.engine.args import EngineArgs
from disagg.worker.engine.block_hash import block_hashes
from disagg.worker.engine.tiers import block_file
from disagg.worker.kv_state.keys import Keys, hash_key
from disagg.worker.router.args import RouterArgs

from ..cluster import Cluster, complete, threshold_placement

pytestmark = pytest.mark.timeout(300)

BS = 16
PROMPTS = 6
PROMPT_LEN = 120  # 7 full blocks and a partial one
CACHE_BLOCKS = 24  # about three prompts at a time


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 500) for _ in range(PROMPT_LEN)]


@pytest.fixture(scope="module")
def tiers_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kv-tiers") / "decode-0"


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory, redis_server, tiers_dir, reference_llm):
    decode_args = EngineArgs.cli_args(
        num_gpu_blocks=CACHE_BLOCKS, block_size=BS,
        kv_host_cache_memory=4 * reference_llm.engine.model.kv_cache_block_bytes(BS),
        kv_disk_cache_dir=str(tiers_dir), kv_disk_cache_size=64 << 20,
    )  # fmt: skip
    c = Cluster(
        tiny_model,
        tmp_path_factory.mktemp("kv-tiers-serving"),
        redis_url=redis_server.url,
        prefill=1,
        decode=1,
        worker_args=threshold_placement(8),
        role_args={"decode": decode_args},
        router_args=RouterArgs.cli_args(block_size=BS),
        deployment="kvtiers",
    )
    try:
        yield c.start()
    finally:
        c.stop()


def _ask(cluster: Cluster, prompt: list[int]) -> dict:
    r = complete(
        cluster.url, {"model": cluster.model_name, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    )
    assert r.status_code == 200, r.text
    return r.json()


def _indexed_by(client: redis.Redis, keys: Keys, worker: str) -> set[str]:
    return {k for k in client.scan_iter(match=keys.block_prefix + "*") if client.sismember(k, worker)} | set(
        client.smembers(keys.worker_blocks(worker))
    )


def test_a_returning_prompt_is_served_from_the_tiers_and_a_killed_worker_leaves_nothing(
    cluster, redis_server, tiers_dir
):
    first = [_ask(cluster, _prompt(i)) for i in range(PROMPTS)]
    assert cluster.metric("decode-0", "disagg_kv_tier_blocks", tier="host") > 0
    disk_blocks = cluster.metric("decode-0", "disagg_kv_tier_blocks", tier="disk")
    assert disk_blocks > 0, "nothing reached the disk tier"

    again = _ask(cluster, _prompt(0))  # evicted from the cache long ago: back from below
    assert again["choices"][0]["text"] == first[0]["choices"][0]["text"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 7 * BS
    hits = cluster.metric("decode-0", "disagg_kv_tier_hits_total")
    assert hits >= 7

    # the blocks below the cache stay in the prefix index (the worker still holds them)
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    keys = Keys("kvtiers")
    time.sleep(3)  # past a reap round, which unpublishes what the worker no longer holds
    published = set(client.smembers(keys.worker_blocks("decode-0")))
    for i in range(PROMPTS):
        first_block = hash_key(block_hashes(_prompt(i), BS)[0])
        assert first_block in published, f"prompt {i}'s first block left the index"

    cluster.workers["decode-0"].kill()
    left = {p.name for p in tiers_dir.glob("*" + block_file.SUFFIX)}
    assert left, "the killed worker had nothing on disk"
    # the lease: its registry entry expires (Redis's TTL), then the surviving worker's reaper drops
    # its index entries; each wait ends on that event (the module's timeout bounds a reaper that
    # never comes), not on a time this process reads
    assert _indexed_by(client, keys, "decode-0")
    while client.exists(keys.worker("decode-0")):
        time.sleep(0.5)
    while _indexed_by(client, keys, "decode-0"):
        time.sleep(0.5)

    cluster.workers["decode-0"].start()
    cluster.wait_ready(["decode-0"])
    # (its warm-up prompts may have written blocks of their own since)
    kept = left & {p.name for p in tiers_dir.glob("*" + block_file.SUFFIX)}
    assert not kept, f"the restarted worker kept {len(kept)} blocks of its predecessor"
    again = _ask(cluster, _prompt(1))
    assert again["choices"][0]["text"] == first[1]["choices"][0]["text"]
    client.close()
