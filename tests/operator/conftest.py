"""The `cluster` fixture: the real kopf runtime running our handlers against kmock (see kube_emulator)."""

from __future__ import annotations

import pytest
from kube_emulator import running_operator


@pytest.fixture
async def cluster():
    async with running_operator() as cluster:
        yield cluster
