"""vLLM's `POST /tokenize` (a prompt, or chat messages rendered by the chat template) and
`POST /detokenize` (token ids back to text); their bodies are `tokenize_api.py`'s."""

from __future__ import annotations

import functools

from aiohttp import web

from disagg.worker.engine.sampling_params import SamplingParams
from disagg.worker.router.args import RouterArgs
from disagg.worker.router.body import read_body
from disagg.worker.router.client_checks import check_api_key, check_model
from disagg.worker.router.errors import invalid
from disagg.worker.router.prompt_tokens import PromptTokenizer
from disagg.worker.router.tokenize_api import (
    TokenizeChat,
    chat_messages,
    parse_detokenize,
    parse_tokenize,
    tokenize_body,
)
from disagg.worker.router.validation import GenerationSpec, check_prompt_size


class TokenizeEndpoints:
    def __init__(self, args: RouterArgs, model_name: str, api_keys: frozenset[str], prompts: PromptTokenizer):
        self.args = args
        self.model_name = model_name
        self.api_keys = api_keys
        self.prompts = prompts

    async def tokenize(self, request: web.Request) -> web.Response:
        check_api_key(request, self.api_keys)
        req = parse_tokenize(await read_body(request, self.args.max_body_bytes))
        check_model(req.model, self.model_name)
        tokenizer = self.prompts.tokenizer
        # the same bound on the text to tokenize as a generation request's
        if isinstance(req, TokenizeChat):
            messages = chat_messages(req)
            tools = [t.model_dump(exclude_none=True, by_alias=True) for t in req.tools or []] or None
            spec = GenerationSpec("chat", "", SamplingParams(max_tokens=None), messages=messages)
            check_prompt_size(spec, self.args.max_prompt_bytes, self.args.max_model_len)
            render = functools.partial(self.prompts.render_chat, messages, tools, req.add_generation_prompt,
                                       req.add_special_tokens)  # fmt: skip
        else:
            spec = GenerationSpec("completion", "", SamplingParams(max_tokens=None), prompts=[req.prompt])
            check_prompt_size(spec, self.args.max_prompt_bytes, self.args.max_model_len)
            render = functools.partial(
                tokenizer.encode, req.prompt, add_special_tokens=req.add_special_tokens
            )
        ids = await self.prompts.in_thread(render)
        strs = [tokenizer.id_to_token(t) or "" for t in ids] if req.return_token_strs else None
        return web.json_response(tokenize_body(ids, self.args.max_model_len, strs))

    async def detokenize(self, request: web.Request) -> web.Response:
        check_api_key(request, self.api_keys)
        req = parse_detokenize(await read_body(request, self.args.max_body_bytes))
        check_model(req.model, self.model_name)
        tokenizer = self.prompts.tokenizer
        vocab = tokenizer.vocab_size
        bad = next((i for i, t in enumerate(req.tokens) if t >= vocab), None)
        if bad is not None:
            raise invalid(
                f"tokens[{bad}]", f"token id {req.tokens[bad]} is out of the vocabulary (size {vocab})"
            )
        return web.json_response({"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)})
