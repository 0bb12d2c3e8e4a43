"""`LLM`: offline batch generation in the vLLM style.

from disagg.worker import LLM, SamplingParams
llm = LLM(model="path/to/model")
outs = llm.generate(["Hello", "The sky is"], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from disagg.worker.engine.args import EngineArgs
from disagg.worker.engine.llm_engine import LLMEngine
from disagg.worker.engine.outputs import RequestOutput
from disagg.worker.engine.sampling_params import SamplingParams

Prompt = str | Sequence[int]


def _as_prompt_list(prompts) -> list[Prompt]:
    """One prompt (text or token ids) or a list of them -> a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]
    for i, p in enumerate(prompts):
        if not isinstance(p, str | list | tuple):
            raise TypeError(f"prompts[{i}] must be a string or a list of token ids, got {type(p).__name__}")
    return prompts


class LLM:
    def __init__(self, model: str | Path | EngineArgs, **settings):
        """`LLM(path, dtype="float32", block_size=16, ...)`: every keyword is an `EngineArgs` setting."""
        self.engine = LLMEngine(model, **settings)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of `prompts`."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"sampling_params has {len(params_list)} entries but there are {len(prompt_list)} prompts"
                )
        return self._run(prompt_list, params_list, progress)

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: bool = False,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (a list of {role, content}
        messages) or a list of them, then generate."""
        tok = self.engine.tokenizer
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        texts = [
            tok.apply_chat_template(list(c), add_generation_prompt=add_generation_prompt)
            for c in conversations
        ]
        ids = [tok.encode(t, add_special_tokens=False) for t in texts]
        outs = self.generate(ids, sampling_params, progress)
        for out, text in zip(outs, texts, strict=True):
            out.prompt = text
        return outs

    def _run(
        self, prompts: list[Prompt], params: list[SamplingParams], progress: bool
    ) -> list[RequestOutput]:
        engine = self.engine
        order: dict[str, int] = {}
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
                rid = f"llm-{next(self._ids)}"
                engine.add_request(rid, prompt, p)
                order[rid] = i
            results: list[RequestOutput | None] = [None] * len(prompts)
            done, generated, start, last_print = 0, 0, time.monotonic(), 0.0
            while done < len(prompts):
                for out in engine.step():
                    generated += len(out.new_token_ids)
                    if out.finished:
                        results[order[out.request_id]] = out
                        done += 1
                now = time.monotonic()
                if progress and (now - last_print > 1.0 or done == len(prompts)):
                    last_print = now
                    rate = generated / max(now - start, 1e-9)
                    print(
                        f"\r{done}/{len(prompts)} done, {generated} tokens, {rate:.1f} tok/s",
                        end="",
                        file=sys.stderr,
                    )
            if progress:
                print(file=sys.stderr)
            return results  # type: ignore[return-value]
        finally:
            for rid in order:
                engine.abort(rid)  # no-op for finished ones; frees blocks after an error
