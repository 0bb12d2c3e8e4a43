"""Prompts into token ids, off the event loop: chat templates and tokenizing run on a small thread
pool, so that a long prompt does not hold up /health or other requests; and the text of single
tokens (for logprobs), cached."""

from __future__ import annotations

import asyncio
import concurrent.futures

from disagg.worker.router.errors import invalid
from disagg.worker.router.fanout import Echo
from disagg.worker.router.validation import GenerationSpec


class PromptTokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._threads = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="tokenize")
        self._token_text: dict[int, str] = {}

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)

    async def in_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._threads, fn, *args)

    async def tokenize_all(self, spec: GenerationSpec) -> list[list[int]]:
        """The token ids of each of the request's prompts (the chat template applied for chat)."""
        loop = asyncio.get_running_loop()
        return list(
            await asyncio.gather(
                *(
                    loop.run_in_executor(self._threads, self._tokenize, spec, i)
                    for i in range(spec.num_prompts)
                )
            )
        )

    def _tokenize(self, spec: GenerationSpec, prompt_index: int) -> list[int]:
        if spec.kind == "chat":
            tools = spec.tools.tools if spec.tools is not None else None
            return self.render_chat(spec.messages, tools, True, False)
        prompt = spec.prompts[prompt_index]
        if isinstance(prompt, list):
            vocab = self.tokenizer.vocab_size
            bad = next((t for t in prompt if t >= vocab), None)
            if bad is not None:
                raise invalid("prompt", f"token id {bad} is out of the vocabulary (size {vocab})")
            return list(prompt)
        return self.tokenizer.encode(prompt)

    def render_chat(
        self, messages, tools, add_generation_prompt: bool, add_special_tokens: bool
    ) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tools=tools
            )
        except Exception as e:  # template errors (raise_exception in the template) are the caller's
            raise invalid("messages", f"the chat template rejected the messages: {e}") from e
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def token_text(self, token_id: int) -> str:
        t = self._token_text.get(token_id)
        if t is None:
            t = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = t
        return t

    def echo(self, spec: GenerationSpec, prompt_index: int, ids: list[int]) -> Echo | None:
        """A completion's prompt as `echo` repeats it: the text as sent, or token ids decoded."""
        if not spec.echo:
            return None
        prompt = spec.prompts[prompt_index]
        text = prompt if isinstance(prompt, str) else self.tokenizer.decode(ids, skip_special_tokens=False)
        return Echo(text, ids[0])
