"""A checkpoint's tokenizer: `tokenizer.json` (or a GGUF file's tokenizer metadata,
`gguf_tokenizer`) through `tokenizers`, chat template through jinja2.

The chat template is rendered the way Hugging Face renders it (sandboxed environment,
`trim_blocks`/`lstrip_blocks`, `raise_exception`, a non-ASCII-escaping `tojson`, the special
tokens as variables), so prompts match what the model was trained on.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from disagg.worker.model import gguf_checkpoint

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def _token_text(value) -> str | None:
    """tokenizer_config stores special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


class ChatTemplateError(ValueError):
    """The chat template rejected the conversation (its `raise_exception` was called)."""


class Tokenizer:
    def __init__(
        self, backend: HFTokenizer, config: dict | None = None, generation_config: dict | None = None
    ):
        self.backend = backend
        self.config = config or {}
        self.chat_template = self._pick_chat_template(self.config.get("chat_template"))
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.pad_token = _token_text(self.config.get("pad_token"))
        self.unk_token = _token_text(self.config.get("unk_token"))
        self.bos_token_id = self._id_of(self.bos_token)
        self.eos_token_id = self._id_of(self.eos_token)
        self.pad_token_id = self._id_of(self.pad_token)
        eos = _ids((generation_config or {}).get("eos_token_id"))
        if self.eos_token_id is not None and self.eos_token_id not in eos:
            eos.append(self.eos_token_id)
        self.eos_token_ids: list[int] = eos
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        )
        self._add_bos = self.config.get("add_bos_token")

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        if gguf_checkpoint.is_gguf(path):
            from disagg.worker.engine import gguf_tokenizer

            return cls(*gguf_tokenizer.build(gguf_checkpoint.open_gguf(path)))
        if not path.is_dir():
            raise FileNotFoundError(f"model directory not found: {path}")
        tok_file = path / TOKENIZER_FILE
        if not tok_file.is_file():
            raise FileNotFoundError(f"{TOKENIZER_FILE} not found in model directory {path}")
        config_file = path / TOKENIZER_CONFIG_FILE
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        gen_file = path / "generation_config.json"
        generation = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
        template_file = path / "chat_template.jinja"
        if "chat_template" not in config and template_file.is_file():
            config["chat_template"] = template_file.read_text()
        return cls(HFTokenizer.from_file(str(tok_file)), config, generation)

    @staticmethod
    def _pick_chat_template(value) -> str | None:
        # Some configs hold a list of named templates; the "default" one is the chat template.
        if isinstance(value, list):
            named = {t.get("name"): t.get("template") for t in value}
            return named.get("default")
        return value

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. With add_special_tokens, BOS comes from tokenizer.json's
        post-processor; when that has none but tokenizer_config.json sets `add_bos_token`
        (older Llama conversions), BOS is prepended here."""
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._add_bos and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **kwargs,
    ) -> str:
        """Render `messages` (OpenAI-style dicts) into the prompt text the model expects.

        The text already holds the template's special tokens (usually BOS): encode it with
        `add_special_tokens=False`.
        """
        if not self.chat_template:
            raise ValueError(
                "this tokenizer has no chat template (no chat_template in tokenizer_config.json)"
            )
        variables = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "pad_token": self.pad_token or "",
            "unk_token": self.unk_token or "",
            **kwargs,
        }
        return self._compiled_template.render(
            messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **variables
        )

    @cached_property
    def _compiled_template(self):
        return compile_chat_template(self.chat_template)


def _raise_exception(message: str):
    raise ChatTemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str):
    """A jinja2 template in an immutable sandbox, with the globals chat templates rely on."""
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        # `{% generation %}...{% endgeneration %}` marks assistant text for training masks;
        # for inference it renders its body unchanged.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)
