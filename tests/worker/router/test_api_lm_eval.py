"""lm-eval's `local-completions` against the router: a multiple-choice task defined here over a
few local lines. Its loglikelihoods must equal the engine's own prompt logprobs summed over each
continuation, tokenized exactly as lm-eval tokenizes a (context, continuation) pair."""

from __future__ import annotations

import json

import pytest

from disagg.worker.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(300)

DOCS = [
    {"question": "The old lighthouse keeper reads", "choices": ["the morning news", "a bowl of soup"], "answer": 0},
    {"question": "Every worker schedules", "choices": ["the cache blocks", "three bright lanterns", "time"],
     "answer": 1},
    {"question": "A hungry fox follows the river", "choices": ["before dawn", "under a grey sky"], "answer": 1},
]  # fmt: skip


@pytest.fixture(autouse=True)
def released(api_cluster, redis_server):
    yield
    api_cluster.assert_released(redis_server.url)


def _task_dir(tmp_path) -> str:
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "tiny_mc.yaml").write_text(
        "task: disagg_tiny_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n"
    )
    return str(tmp_path)


def test_local_completions_loglikelihoods_equal_the_engine(api_cluster, tiny_model, reference_llm, tmp_path):
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "model": api_cluster.model_name,
            "base_url": f"{api_cluster.url}/v1/completions",
            "tokenizer_backend": "huggingface",
            "tokenizer": str(tiny_model),
            "num_concurrent": 1,
            "max_retries": 1,
        },
        tasks=["disagg_tiny_mc"],
        task_manager=TaskManager(include_path=_task_dir(tmp_path)),
        log_samples=True,
    )
    samples = sorted(results["samples"]["disagg_tiny_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(DOCS)

    tok = reference_llm.get_tokenizer()
    for sample, doc in zip(samples, DOCS, strict=True):
        got = [resp[0] for resp in sample["resps"]]  # (loglikelihood, is_greedy) per choice
        assert len(got) == len(doc["choices"])
        for (ll, greedy), choice in zip(got, doc["choices"], strict=True):
            # lm-eval's pair encoding: context and whole sequence without special tokens
            context, whole = doc["question"], doc["question"] + " " + choice
            ctx_ids = tok.encode(context, add_special_tokens=False)
            ids = tok.encode(whole, add_special_tokens=False)
            ref = reference_llm.generate(
                [ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
            )
            cont = ref[0].prompt_logprobs[len(ctx_ids) :]
            assert ll == pytest.approx(sum(lp.logprob for lp in cont), abs=1e-4)
            assert greedy == all(lp.logprob >= max(lp.top_logprobs.values()) - 1e-6 for lp in cont)
    assert 0.0 <= results["results"]["disagg_tiny_mc"]["acc,none"] <= 1.0
