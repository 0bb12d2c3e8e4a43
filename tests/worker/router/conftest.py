"""The OpenAI API tests' cluster: the router in front of a prefill and a decode worker."""

from __future__ import annotations

import pytest

API_THRESHOLD = 4  # prompts of 4+ uncached tokens are prefilled on the prefill worker


@pytest.fixture(scope="package")
def api_cluster(tiny_model, tmp_path_factory, redis_server):
    """Router, one prefill and one decode worker, real Redis: the OpenAI API tests' disaggregated
    path (shared by their modules, so it starts once)."""
    from ..cluster import Cluster

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
