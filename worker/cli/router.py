"""`disagg router`: the OpenAI-compatible HTTP front door of a deployment."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from disagg.worker.engine import args as engine_args
from disagg.worker.serving import auth


def _env(name: str, default=None):
    return os.environ.get(f"DISAGG_{name}", default)


DEFAULT_MAX_CHOICES = 64


def max_choices(args) -> int:
    """--max-choices, checked against --max-queue: a request larger than the queue would get 429
    forever, so the default shrinks to the queue and an explicit larger value is refused."""
    if args.max_choices is None:
        return max(1, min(DEFAULT_MAX_CHOICES, args.max_queue))
    if args.max_choices < 1:
        raise SystemExit(f"disagg router: --max-choices must be >= 1, got {args.max_choices}")
    if args.max_choices > args.max_queue:
        raise SystemExit(
            f"disagg router: --max-choices ({args.max_choices}) must not exceed --max-queue ({args.max_queue})"
        )
    return args.max_choices


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=_env("HOST", "127.0.0.1"),
                   help="bind address (0.0.0.0 or the pod IP to serve clients beyond this machine)")  # fmt: skip
    p.add_argument("--port", type=int, default=int(_env("PORT", 8000)))
    p.add_argument(
        "--model", default=_env("MODEL"), help="model directory (tokenizer, chat template, context)"
    )
    p.add_argument(
        "--model-name", default=_env("MODEL_NAME"), help="served model name (default: directory name)"
    )
    p.add_argument(
        "--redis-url", default=_env("REDIS_URL"), help="Redis with the worker registry and prefix index"
    )
    p.add_argument("--deployment", default=_env("DEPLOYMENT", "default"))
    p.add_argument("--workers", default=_env("WORKERS", ""),
                   help="comma-separated worker gRPC addresses, in addition to the registry")  # fmt: skip
    p.add_argument("--api-key", action="append", default=[], help="accepted API key (repeatable)")
    p.add_argument("--api-key-file", default=_env("API_KEY_FILE"), help="file with one API key per line")
    p.add_argument("--max-queue", type=int, default=int(_env("MAX_QUEUE", 256)),
                   help="generations in flight before answering 429 (a request with n=4 counts 4)")  # fmt: skip
    p.add_argument("--max-choices", type=int, default=_env("MAX_CHOICES") and int(_env("MAX_CHOICES")),
                   help="most generations one request may ask for (n x number of prompts; more is a 400); "
                        f"default {DEFAULT_MAX_CHOICES}, at most --max-queue")  # fmt: skip
    p.add_argument("--max-prompt-bytes", type=int, default=int(_env("MAX_PROMPT_BYTES", 1 << 20)),
                   help="most bytes of prompt text (or chat message text) one request may send, summed over "
                        "its prompts; more is a 400 before any tokenizing")  # fmt: skip
    p.add_argument("--max-model-len", type=int, default=_env("MAX_MODEL_LEN") and int(_env("MAX_MODEL_LEN")))
    p.add_argument("--block-size", type=int, default=int(_env("BLOCK_SIZE", engine_args.default("block_size"))),
                   help="the workers' KV block size: prompts are hashed per block for prefix-aware routing")  # fmt: skip
    p.add_argument("--tool-call-parser", default=_env("TOOL_CALL_PARSER"), choices=["llama3_json", "hermes"],
                   help="the model family's tool-call format, parsed for tool_choice 'auto' (as vLLM's flag)")  # fmt: skip
    p.add_argument("--prefill-overflow", type=float, metavar="MARGIN",
                   default=_env("PREFILL_OVERFLOW") and float(_env("PREFILL_OVERFLOW")),
                   help="let a prefill worker with no prompt queued serve a whole request (prefill and "
                        "decode) when every decode worker is busier than it by more than MARGIN requests; "
                        "off when not given")  # fmt: skip
    p.add_argument("--redis-password-file", default=None,
                   help="file with the Redis password (or DISAGG_REDIS_PASSWORD / DISAGG_REDIS_PASSWORD_FILE)")  # fmt: skip
    p.add_argument("--log-level", default=_env("LOG_LEVEL", "INFO"))
    auth.add_cli_args(p)


def prefill_overflow(args) -> float | None:
    if args.prefill_overflow is not None and args.prefill_overflow < 0:
        raise SystemExit(f"disagg router: --prefill-overflow must be >= 0, got {args.prefill_overflow}")
    return args.prefill_overflow


def api_keys(args) -> frozenset[str]:
    keys = set(args.api_key)
    if os.environ.get("DISAGG_API_KEY"):
        keys.add(os.environ["DISAGG_API_KEY"])
    if args.api_key_file:
        path = Path(args.api_key_file)
        if not path.is_file():
            raise SystemExit(f"disagg router: --api-key-file {path}: no such file")
        keys |= {
            line.strip()
            for line in path.read_text().splitlines()
            if line.strip() and not line.startswith("#")
        }
    return frozenset(keys)


def context_length(model_dir: Path) -> int:
    """The model's context (the engine's own rule: `ModelConfig.max_model_len`)."""
    from disagg.worker.model.config import ModelConfig

    try:
        return ModelConfig.from_pretrained(model_dir).max_model_len
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"disagg router: {model_dir}: {exc}") from None


def build_router(args):
    from disagg.worker.engine.tokenizer import Tokenizer
    from disagg.worker.model.gguf_checkpoint import served_name
    from disagg.worker.router.app import Router, RouterConfig
    from disagg.worker.router.workers import WorkerPool

    if not args.model:
        raise SystemExit("disagg router: --model (or DISAGG_MODEL) is required: it holds the tokenizer")
    model_dir = Path(args.model)
    if not model_dir.exists():  # a checkpoint directory or a GGUF file
        raise SystemExit(f"disagg router: --model {args.model}: no such file or directory")
    model_name = args.model_name or served_name(model_dir)
    choices = max_choices(args)
    max_len = args.max_model_len or context_length(model_dir)
    tokenizer = Tokenizer.from_pretrained(model_dir)
    source = lookup = None
    if args.redis_url:
        from disagg.worker.cli.worker import _password
        from disagg.worker.kv_state import KVState

        state = KVState(args.redis_url, args.deployment, f"router-{os.getpid()}", password=_password(args))

        def source():
            return [(w.id, w.role, w.address) for w in state.workers()]

        lookup = state.match_prefix
    static = [a.strip() for a in args.workers.split(",") if a.strip()]
    if source is None and not static:
        raise SystemExit("disagg router: give --redis-url (worker registry) and/or --workers host:port,...")
    internal = auth.from_cli_args(args, "disagg router")
    pool = WorkerPool(source, static, model=model_name, auth=internal)
    config = RouterConfig(
        model_name=model_name,
        max_model_len=max_len,
        block_size=args.block_size,
        api_keys=api_keys(args),
        max_queue=args.max_queue,
        max_choices=choices,
        tool_call_parser=args.tool_call_parser,
        max_prompt_bytes=args.max_prompt_bytes,
        prefill_overflow=prefill_overflow(args),
    )
    return Router(config, tokenizer, pool, lookup, internal_auth=internal)


def run(args) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from aiohttp import web

    router = build_router(args)
    print(f"router serving {router.config.model_name} on http://{args.host}:{args.port}/v1", flush=True)
    web.run_app(
        router.app(), host=args.host, port=args.port, access_log=None, print=None, handler_cancellation=True
    )
    return 0
