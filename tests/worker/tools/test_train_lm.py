"""The trained presets: the training forward is Llama's arithmetic, training learns the corpus, and
the engine serves the result (its text is made of the corpus's words)."""

from __future__ import annotations

import dataclasses
import json
import re
import signal

import pytest
import torch
from safetensors.torch import load_file

from disagg.worker import LLM, SamplingParams
from disagg.worker.tools import make_model as mm
from disagg.worker.tools.train_lm import forward, train


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return mm.make_model(tmp_path_factory.mktemp("train") / "tiny", preset="tiny", seed=3)


def test_training_forward_equals_transformers(tiny_dir, hf_model):
    config = json.loads((tiny_dir / "config.json").read_text())
    params = load_file(str(tiny_dir / "model.safetensors"))
    ids = torch.randint(0, config["vocab_size"], (2, 37), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf_model(tiny_dir)(ids).logits
        got = forward(params, ids, config)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bf16", [False, True])
def test_training_lowers_the_loss_and_is_repeatable(tiny_dir, bf16):
    config = json.loads((tiny_dir / "config.json").read_text())
    docs = [[(7 * i + j) % 50 + 10 for j in range(40)] for i in range(30)]  # a learnable pattern

    def run():
        params = {k: v.clone() for k, v in load_file(str(tiny_dir / "model.safetensors")).items()}
        return train(params, config, docs, steps=25, seed=1, batch=4, bf16=bf16), params

    losses, params = run()
    again, params_again = run()
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5, losses
    # the same run again: equal up to the order of parallel float additions (which bfloat16's
    # 8-bit mantissa rounds further apart)
    rel, atol = (1e-2, 1e-3) if bf16 else (1e-4, 1e-4)
    assert losses == pytest.approx(again, rel=rel)
    assert all(torch.allclose(params[k], params_again[k], atol=atol) for k in params)
    assert not any(t.requires_grad for t in params.values())


def test_trained_preset_recipe_is_a_distinct_checkpoint(tmp_path, monkeypatch):
    """A trained preset writes trained weights (not the random ones) under the same tokenizer."""
    monkeypatch.setitem(
        mm.PRESETS, "probe", dataclasses.replace(mm.PRESETS["tiny-trained-draft"], train_steps=3)
    )
    trained = mm.make_model(tmp_path / "probe", preset="probe")
    random_twin = mm.random_weights(mm.PRESETS["probe"], 0, torch.float32)
    weights = load_file(str(trained / "model.safetensors"))
    assert not torch.equal(weights["lm_head.weight"], random_twin["lm_head.weight"])
    assert (trained / "tokenizer.json").read_text() == (
        mm.make_model(tmp_path / "t", preset="tiny") / "tokenizer.json"
    ).read_text()


class StallGuard:
    """Fails the test when `seconds` pass without a progress report: a hang, not a slow machine,
    since every report (a tenth of the training steps) grants the next one the same time. Stands in
    for pytest-timeout's limit on the whole test, which a loaded machine exceeded while training."""

    def __init__(self, seconds: float):
        self.seconds, self.reports = seconds, []

    def _stalled(self, _signum, _frame):
        pytest.fail(f"no progress for {self.seconds} s after {self.reports[-1:] or 'the start'}")

    def __enter__(self):
        self.previous = signal.signal(signal.SIGALRM, self._stalled)
        signal.setitimer(signal.ITIMER_REAL, self.seconds)
        return self

    def __call__(self, message: str) -> None:
        self.reports.append(message)
        signal.setitimer(signal.ITIMER_REAL, self.seconds)

    def __exit__(self, *exc):
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self.previous)


@pytest.mark.slow
@pytest.mark.timeout(0)  # the stall guard instead
def test_the_demo_model_writes_the_corpus_words(tmp_path, one_torch_thread):
    # the draft-sized preset: the same recipe at a quarter of the training cost; one torch thread,
    # as the engine tests run (spinning intra-op threads made a loaded machine many times slower)
    with StallGuard(300) as progress:
        path = mm.make_model(tmp_path / "draft", preset="tiny-trained-draft", progress=progress)
    assert sum("training step" in m for m in progress.reports) == 10
    llm = LLM(path, dtype="float32")
    words = {w.lower() for line in mm.training_corpus(0) for w in re.findall(r"[A-Za-z]+", line)}
    for prompt in ("The engineer", "A small robot"):
        text = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0))[0].outputs[0].text
        found = re.findall(r"[A-Za-z]+", text)
        assert len(found) >= 10, text
        known = sum(w.lower() in words for w in found) / len(found)
        assert known >= 0.9, (known, text)
