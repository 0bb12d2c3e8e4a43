"""Deployments served in 8 bits, int8 weights or an int8 KV cache: disaggregated output equals the
colocated engine's in the same setting, and the router and the workers say what they serve. With
the int8 KV cache the prompt's regions (8-bit values and their scales) move from prefill to decode
through NIXL."""

from __future__ import annotations

import random
import urllib.request
from dataclasses import dataclass

import httpx
import pytest

from disagg.kernels.kv_quant import region_bytes
from disagg.worker.engine.args import EngineArgs
from disagg.worker.engine.sampling_params import SamplingParams
from disagg.worker.router.policy import WorkerView, served_quantization

from ..cluster import Cluster, greedy_body, threshold_placement

pytestmark = pytest.mark.timeout(300)


def _weights_reported(cluster, tiny_model) -> None:
    """int8 weights: a quarter of the float bytes per token, in /v1/models and every worker's metrics."""
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


def _kv_regions_reported(cluster, tiny_model) -> None:
    """An int8 KV cache: the KV bytes per token count the quantized regions, labelled int8."""
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


@dataclass(frozen=True)
class Setup:
    name: str  # the deployment's
    worker_args: tuple[str, ...]  # besides the threshold placement
    engine: dict  # the colocated reference engine's settings
    reported: object  # (cluster, tiny_model) -> None: what the router and the workers say


SETUPS = [
    Setup("int8", EngineArgs.cli_args(quantization="int8"), {"quantization": "int8"}, _weights_reported),
    Setup(
        "kv-int8",
        EngineArgs.cli_args(kv_cache_dtype="int8"),
        {"kv_cache_dtype": "int8"},
        _kv_regions_reported,
    ),
]


@pytest.fixture(scope="module", params=SETUPS, ids=lambda s: s.name)
def setup(request) -> Setup:
    return request.param


@pytest.fixture(scope="module")
def cluster(setup, tiny_model, tmp_path_factory, redis_server):
    c = Cluster(
        tiny_model,
        tmp_path_factory.mktemp(setup.name),
        redis_url=redis_server.url,
        worker_args=(*threshold_placement(8), *setup.worker_args),
        deployment=setup.name,
    )
    try:
        yield c.start()
    finally:
        c.stop()


def test_disaggregated_output_equals_colocated_in_the_same_setting(setup, cluster, tiny_model, redis_server):
    import torch

    from disagg.worker import LLM

    torch.set_num_threads(1)
    reference = LLM(model=str(tiny_model), num_gpu_blocks=256, **setup.engine)
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 1000) for _ in range(n)] for n in (12, 40)]
    want = reference.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for prompt, w in zip(prompts, want, strict=True):
        body = greedy_body(cluster.model_name, prompt, 8)
        r = httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        cluster.assert_prefilled_on(r, "prefill-0")
        assert r.json()["choices"][0]["text"] == w.outputs[0].text
    cluster.assert_released(redis_server.url)


def test_models_and_metrics_report_what_is_served(setup, cluster, tiny_model):
    setup.reported(cluster, tiny_model)


def test_served_quantization_names_every_kind_the_workers_serve():
    def view(name: str, q: str) -> WorkerView:
        return WorkerView(worker_id=name, role="decode", address=f"{name}:1", quantization=q)

    assert served_quantization([]) is None
    assert served_quantization([view("a", "int8"), view("b", "int8")]) == "int8"
    assert served_quantization([view("a", "none"), view("b", "int8")]) == "int8,none"
