"""A deployment with an int8 KV cache: the prompt's regions (8-bit values and their scales) move
from prefill to decode through NIXL, and the output equals the colocated int8-KV engine's."""

from __future__ import annotations

import random
import urllib.request

import httpx
import pytest

from disagg.kernels.kv_quant import region_bytes
from disagg.worker.engine.sampling_params import SamplingParams

from .cluster import Cluster

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory, redis_server):
    c = Cluster(
        tiny_model,
        tmp_path_factory.mktemp("kv-int8"),
        redis_url=redis_server.url,
        worker_args=(
            "--prefill-placement",
            "threshold",
            "--disagg-threshold",
            "8",
            "--kv-cache-dtype",
            "int8",
        ),
        deployment="kv-int8",
    )
    try:
        yield c.start()
    finally:
        c.stop()


def test_int8_kv_disaggregated_output_equals_colocated_int8_kv(cluster, tiny_model, redis_server):
    import torch

    from disagg.worker import LLM

    torch.set_num_threads(1)
    reference = LLM(model=str(tiny_model), num_gpu_blocks=256, kv_cache_dtype="int8")
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 1000) for _ in range(n)] for n in (12, 40)]
    want = reference.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for prompt, w in zip(prompts, want, strict=True):
        body = {
            "model": cluster.model_name,
            "prompt": prompt,
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        }
        r = httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.headers["X-Disagg-Prefill-Worker"] == "prefill-0"
        assert r.json()["choices"][0]["text"] == w.outputs[0].text
    cluster.assert_released(redis_server.url)


def test_kv_bytes_per_token_count_the_quantized_regions(cluster, tiny_model):
    from disagg.worker.model.loader import load_model

    model = load_model(tiny_model)[0]
    block_size = 16  # the engine's default
    region = region_bytes(block_size, model.num_kv_heads, model.head_dim)
    for worker in ("prefill-0", "decode-0"):
        # 8-bit K and V, a float32 scale per token and KV head, the region's padding: every layer
        assert cluster.metric(worker, "disagg_kv_bytes_per_token") == model.num_layers * region // block_size
        url = cluster.workers[worker].health.replace("/health", "/metrics")
        with urllib.request.urlopen(url, timeout=5) as r:
            lines = [x for x in r.read().decode().splitlines() if x.startswith("disagg_kv_bytes_per_token{")]
        assert len(lines) == 1 and 'dtype="int8"' in lines[0], lines
