"""Fixtures of the serving tests: the tiny model, the in-process reference engine."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from disagg.worker.tools.make_model import make_model

    return make_model(tmp_path_factory.mktemp("models") / "tiny", preset="tiny")


@pytest.fixture(scope="session")
def reference_llm(tiny_model):
    """The colocated engine in this process: what every served output must equal."""
    import torch

    from disagg.worker import LLM

    torch.set_num_threads(1)
    return LLM(model=str(tiny_model), num_gpu_blocks=512)
