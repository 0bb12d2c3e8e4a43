"""`disagg generate`: run the engine offline on prompts and stream the text to stdout.

    disagg generate MODEL_DIR "The sky is" "Once upon a time" --max-tokens 32
    disagg generate MODEL_DIR --chat "What is the capital of France?"

Prompts run as one batch; their texts are printed in order, the one in front streamed as
it is generated.
"""

from __future__ import annotations

import argparse
import sys

from disagg.worker.engine.args import EngineArgs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="model directory (Hugging Face layout) or GGUF file")
    EngineArgs.add_cli_args(parser, model=False)
    parser.add_argument(
        "prompts", nargs="*", help="prompts (read from stdin, one per line, when none are given)"
    )
    parser.add_argument(
        "--chat", action="store_true", help="wrap each prompt as a user message in the chat template"
    )
    parser.add_argument("--system", default=None, help="system message for --chat")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--min-tokens", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1, help="sample from the k likeliest tokens; -1: off")
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--presence-penalty", type=float, default=0.0)
    parser.add_argument("--frequency-penalty", type=float, default=0.0)
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--stats", action="store_true", help="print token counts and speed to stderr")


def run(args: argparse.Namespace) -> int:
    import time

    from disagg.worker.engine.llm_engine import LLMEngine
    from disagg.worker.engine.sampling_params import SamplingParams

    prompts = args.prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        print("error: no prompts given", file=sys.stderr)
        return 2
    try:
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty,
            max_tokens=args.max_tokens,
            min_tokens=args.min_tokens,
            stop=args.stop,
            ignore_eos=args.ignore_eos,
        )
        engine = LLMEngine(EngineArgs.from_cli_args(args))
        inputs: list[str | list[int]] = []
        for p in prompts:
            if args.chat:
                messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
                    {"role": "user", "content": p}
                ]
                text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
                inputs.append(engine.tokenizer.encode(text, add_special_tokens=False))
            else:
                inputs.append(p)
        for i, prompt in enumerate(inputs):
            engine.add_request(str(i), prompt, params)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    # stream the earliest unprinted prompt, buffer the others until their turn
    buffered = [""] * len(inputs)
    finished = [False] * len(inputs)
    front = 0
    tokens = 0
    start = time.monotonic()

    def show(i: int) -> None:
        if i < len(inputs):
            sys.stdout.write(buffered[i])
            buffered[i] = ""

    if len(inputs) > 1:
        sys.stdout.write(f"--- [0] {prompts[0]}\n")
    while engine.has_unfinished():
        for out in engine.step():
            i = int(out.request_id)
            tokens += len(out.new_token_ids)
            buffered[i] += out.new_text
            finished[i] = out.finished
        show(front)
        while front < len(inputs) and finished[front]:
            sys.stdout.write("\n")
            front += 1
            if front < len(inputs):
                sys.stdout.write(f"--- [{front}] {prompts[front]}\n")
                show(front)
        sys.stdout.flush()
    if args.stats:
        elapsed = time.monotonic() - start
        print(
            f"{len(inputs)} prompts, {tokens} tokens in {elapsed:.2f}s ({tokens / elapsed:.1f} tok/s)",
            file=sys.stderr,
        )
    return 0
