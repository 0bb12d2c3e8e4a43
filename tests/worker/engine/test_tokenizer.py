"""Tokenizer round trips, chat template parity with transformers, streaming detokenization."""

from __future__ import annotations

import json

import pytest

from disagg.worker.engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from disagg.worker.engine.tokenizer import ChatTemplateError, Tokenizer

TEXTS = [
    "Hello, world!",
    "  leading spaces, trailing\ttab\n",
    "Emoji 🙂🚀👩‍👩‍👧 and CJK 東京タワー 你好世界, Ünïcödé ß, Ελληνικά, עברית, हिन्दी.",
    "def f(x):\n    return {'a': [1, 2.5e-3]}  # code",
    "\x00\x01 control \u200b zero-width",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [
        {"role": "system", "content": "  Be brief.  "},
        {"role": "user", "content": "What is 2+2? 🤔"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 東京?"},
    ],
]
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"city": "Zürich"}}}]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_and_bos(tokenizer, text):
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.encode(text, add_special_tokens=False) == ids[1:]
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|begin_of_text|>" + text


def test_ids_match_transformers(tokenizer, hf_tokenizer):
    for text in TEXTS:
        assert tokenizer.encode(text) == hf_tokenizer(text)["input_ids"]


def test_add_bos_token_without_post_processor(tiny_llama_dir, tmp_path):
    tokenizer_json = json.loads((tiny_llama_dir / "tokenizer.json").read_text())
    tokenizer_json["post_processor"] = None
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    config = json.loads((tiny_llama_dir / "tokenizer_config.json").read_text())
    for add_bos in (True, False):
        config["add_bos_token"] = add_bos
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
        tok = Tokenizer.from_pretrained(tmp_path)
        assert tok.bos_token_id == 0
        ids = tok.encode("hello")
        assert (ids[0] == tok.bos_token_id) == add_bos
        assert tok.decode(ids) == "hello"


def test_special_ids_and_sizes(tokenizer, tiny_llama_dir):
    assert tokenizer.vocab_size == 512
    assert tokenizer.bos_token == "<|begin_of_text|>"
    # tokenizer_config's eos (<|eot_id|>) plus generation_config's list, without duplicates.
    gen = json.loads((tiny_llama_dir / "generation_config.json").read_text())
    assert sorted(tokenizer.eos_token_ids) == sorted(set(gen["eos_token_id"]))
    assert tokenizer.eos_token_id == tokenizer.backend.token_to_id("<|eot_id|>")
    assert tokenizer.bos_token_id in tokenizer.special_token_ids


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tokenizer, hf_tokenizer, messages, add_generation_prompt):
    ours = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert ours == theirs
    assert ours.startswith("<|begin_of_text|><|start_header_id|>")


def test_chat_template_with_tools_matches_transformers(tokenizer, hf_tokenizer):
    messages = CONVERSATIONS[0]
    ours = tokenizer.apply_chat_template(messages, tools=TOOLS)
    assert ours == hf_tokenizer.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert '"Zürich"' in ours  # tojson keeps non-ASCII as is


def test_chat_template_errors(tokenizer, tiny_llama_dir, tmp_path):
    with pytest.raises(ChatTemplateError, match="unknown role: robot"):
        tokenizer.apply_chat_template([{"role": "robot", "content": "beep"}])
    for name in ("tokenizer.json", "generation_config.json"):
        (tmp_path / name).write_bytes((tiny_llama_dir / name).read_bytes())
    plain = Tokenizer.from_pretrained(tmp_path)  # no tokenizer_config.json, so no template
    with pytest.raises(ValueError, match="no chat template"):
        plain.apply_chat_template(CONVERSATIONS[0])


def test_sandbox_blocks_attribute_escape(tokenizer):
    from jinja2.exceptions import SecurityError

    evil = Tokenizer(tokenizer.backend, {"chat_template": "{{ messages.__class__.__mro__ }}"})
    with pytest.raises(SecurityError):
        evil.apply_chat_template(CONVERSATIONS[0])


def test_missing_tokenizer_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        Tokenizer.from_pretrained(tmp_path / "nope")


def _stream(tokenizer, prompt_ids, ids):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = [detok.add(i) for i in ids]
    return deltas, detok.flush(), detok


@pytest.mark.parametrize("text", TEXTS[:4])
def test_incremental_detokenizer_never_breaks_characters(tokenizer, text):
    prompt = tokenizer.encode("Prompt: ")
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, tail, detok = _stream(tokenizer, prompt, ids)
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert tail == ""
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert detok.text == text and detok.generated_ids == ids


def test_incremental_detokenizer_holds_back_a_split_emoji(tokenizer):
    ids = tokenizer.encode("🚀", add_special_tokens=False)
    assert len(ids) > 1  # the emoji's four bytes span several tokens
    deltas, _, _ = _stream(tokenizer, [], ids)
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "🚀"


def test_incremental_detokenizer_flushes_an_unfinished_character(tokenizer):
    ids = tokenizer.encode("ok 🚀", add_special_tokens=False)[:-1]  # cut inside the emoji
    deltas, tail, _ = _stream(tokenizer, [], ids)
    assert "".join(deltas) == "ok "
    assert "".join(deltas) + tail == tokenizer.decode(ids)
    assert tail.endswith(REPLACEMENT_CHAR)


def test_incremental_detokenizer_skips_special_tokens(tokenizer):
    eot = tokenizer.eos_token_id
    ids = tokenizer.encode("done", add_special_tokens=False) + [eot]
    deltas, tail, _ = _stream(tokenizer, [], ids)
    assert "".join(deltas) + tail == "done"
