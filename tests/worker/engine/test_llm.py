"""The public `LLM` API and the `disagg generate` command on a tiny model."""

from __future__ import annotations

import subprocess
import sys

import pytest

from disagg.worker import LLM, SamplingParams
from disagg.worker.cli import main as cli_main

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, num_gpu_blocks=64, max_num_batched_tokens=64, seed=0)


def test_importing_the_package_does_not_import_torch():
    code = (
        "import sys, disagg.worker; from disagg.worker import SamplingParams; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_generate_text_prompts_in_input_order(llm):
    prompts = ["The sky is", "Once upon a time there was a long letter", "Hi"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert [o.prompt for o in outs] == prompts
    tok = llm.get_tokenizer()
    for o, p in zip(outs, prompts, strict=True):
        assert o.prompt_token_ids == tok.encode(p)
        comp = o.outputs[0]
        assert len(comp.token_ids) == 6 and comp.finish_reason == "length" and o.finished
        assert comp.text == tok.decode(comp.token_ids)
    # each alone gives the same tokens as in the batch
    assert llm.generate(prompts[1], params)[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_token_id_prompts_and_per_prompt_params(llm):
    single = llm.generate([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(single) == 1 and single[0].prompt_token_ids == [5, 6, 7, 8]
    outs = llm.generate(
        [[5, 6, 7, 8], [9, 10]],
        [
            SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
            SamplingParams(max_tokens=4, ignore_eos=True),
        ],
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 4]
    assert outs[0].outputs[0].token_ids == single[0].outputs[0].token_ids[:2]
    with pytest.raises(ValueError, match="sampling_params has 1 entries but there are 2 prompts"):
        llm.generate([[1], [2]], [SamplingParams()])
    with pytest.raises(ValueError, match="prompt must not be empty"):
        llm.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[10**6]], SamplingParams())
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


def test_chat_applies_the_template(llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert out.prompt == text and out.prompt_token_ids == tok.encode(text, add_special_tokens=False)
    assert len(out.outputs[0].token_ids) == 4
    two = llm.chat([messages, messages], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in two] == [out.outputs[0].token_ids] * 2


def test_generate_command_streams_in_order(tiny_llama_dir, llm, capsys):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].text for o in llm.generate(["The sky is", "Hello"], params)]
    rc = cli_main(
        ["generate", str(tiny_llama_dir), "The sky is", "--max-tokens", "8", "--ignore-eos", "Hello",
         "--num-gpu-blocks", "32"]
    )  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    assert out == f"--- [0] The sky is\n{expected[0]}\n--- [1] Hello\n{expected[1]}\n"
    assert cli_main(["generate", str(tiny_llama_dir), "x", "--top-p", "2"]) == 2
    assert "top_p must be in (0, 1]" in capsys.readouterr().err
