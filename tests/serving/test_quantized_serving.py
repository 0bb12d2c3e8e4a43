"""A deployment served with int8 weights: disaggregated output equals the colocated int8 engine's,
and the router and the workers say which quantization they serve."""

from __future__ import annotations

import random

import httpx
import pytest

from disagg.worker.engine.sampling_params import SamplingParams
from disagg.worker.router.policy import WorkerView, served_quantization

from .cluster import Cluster

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory, redis_server):
    c = Cluster(
        tiny_model,
        tmp_path_factory.mktemp("int8"),
        redis_url=redis_server.url,
        worker_args=("--prefill-placement", "threshold", "--disagg-threshold", "8", "--quantization", "int8"),
        deployment="int8",
    )
    try:
        yield c.start()
    finally:
        c.stop()


def test_int8_disaggregated_output_equals_colocated_int8(cluster, tiny_model, redis_server):
    import torch

    from disagg.worker import LLM

    torch.set_num_threads(1)
    reference = LLM(model=str(tiny_model), num_gpu_blocks=256, quantization="int8")
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


def test_models_and_metrics_report_the_quantization(cluster, tiny_model):
    from disagg.worker.model.loader import load_model
    from disagg.worker.model.quantization import decode_weight_bytes

    (card,) = httpx.get(f"{cluster.url}/v1/models", timeout=10).json()["data"]
    assert card["quantization"] == "int8"
    int8_bytes = decode_weight_bytes(load_model(tiny_model, quantization_setting="int8")[0].weights)
    float_bytes = decode_weight_bytes(load_model(tiny_model)[0].weights)
    assert float_bytes / 4 < int8_bytes < float_bytes / 3.5  # a quarter, plus scales and norms
    model = load_model(tiny_model)[0]
    for worker in ("prefill-0", "decode-0"):
        assert cluster.metric(worker, "disagg_weight_bytes_per_token") == int8_bytes
        # float32 K and V of every layer: 2 * layers * kv heads * head dim * 4 bytes
        kv = 2 * model.num_layers * model.num_kv_heads * model.head_dim * 4
        assert cluster.metric(worker, "disagg_kv_bytes_per_token") == kv


def test_served_quantization_names_every_kind_the_workers_serve():
    def view(name: str, q: str) -> WorkerView:
        return WorkerView(worker_id=name, role="decode", address=f"{name}:1", quantization=q)

    assert served_quantization([]) is None
    assert served_quantization([view("a", "int8"), view("b", "int8")]) == "int8"
    assert served_quantization([view("a", "none"), view("b", "int8")]) == "int8,none"
