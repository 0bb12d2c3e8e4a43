"""Fixtures of the serving tests: the tiny model, the in-process reference engine."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from disagg.worker.tools.make_model import make_model

    return make_model(tmp_path_factory.mktemp("models") / "tiny", preset="tiny")


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    """The tiny model's tokenizer, for the router's in-process tests."""
    from disagg.worker.engine.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="session")
def reference_llm(tiny_model):
    """The colocated engine in this process: what every served output must equal."""
    import torch

    from disagg.worker import LLM

    torch.set_num_threads(1)
    return LLM(model=str(tiny_model), num_gpu_blocks=512)


API_THRESHOLD = 4  # prompts of 4+ uncached tokens are prefilled on the prefill worker


@pytest.fixture(scope="package")
def api_cluster(tiny_model, tmp_path_factory, redis_server):
    """Router, one prefill and one decode worker, real Redis: the OpenAI API tests' disaggregated
    path (shared by their modules, so it starts once)."""
    from .cluster import Cluster

    c = Cluster(
        tiny_model,
        tmp_path_factory.mktemp("api"),
        redis_url=redis_server.url,
        prefill=1,
        decode=1,
        worker_args=("--prefill-placement", "threshold", "--disagg-threshold", str(API_THRESHOLD)),
        router_args=("--tool-call-parser", "llama3_json"),
        deployment="api",
    )
    try:
        yield c.start()
    finally:
        c.stop()


@pytest.fixture
def client(api_cluster):
    import openai

    with openai.OpenAI(base_url=f"{api_cluster.url}/v1", api_key="unused", timeout=120, max_retries=0) as c:
        yield c
