"""`disagg router`: the OpenAI-compatible HTTP front door of a deployment."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from pathlib import Path

from disagg.worker.router.args import RouterArgs, RouterProcessArgs
from disagg.worker.serving import auth


def router_args(args) -> RouterArgs:
    try:
        return RouterArgs.from_cli_args(args)
    except ValueError as exc:
        raise SystemExit(f"disagg router: {exc}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    RouterProcessArgs.add_cli_args(p, env=True)
    # repeatable, so not a setting (DISAGG_API_KEY adds one more)
    p.add_argument("--api-key", action="append", default=[], help="accepted API key (repeatable)")
    auth.add_cli_args(p)
    RouterArgs.add_cli_args(p, env=True)


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
    from disagg.worker.router.app import Router
    from disagg.worker.router.workers import WorkerPool

    if not args.model:
        raise SystemExit("disagg router: --model (or DISAGG_MODEL) is required: it holds the tokenizer")
    model_dir = Path(args.model)
    if not model_dir.exists():  # a checkpoint directory or a GGUF file
        raise SystemExit(f"disagg router: --model {args.model}: no such file or directory")
    model_name = args.model_name or served_name(model_dir)
    settings = router_args(args)
    if settings.max_model_len is None:  # the flag's default: the model's own context
        settings = dataclasses.replace(settings, max_model_len=context_length(model_dir))
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
    return Router(
        settings,
        tokenizer,
        pool,
        model_name=model_name,
        api_keys=api_keys(args),
        prefix_lookup=lookup,
        internal_auth=internal,
    )


def run(args) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from aiohttp import web

    router = build_router(args)
    print(f"router serving {router.model_name} on http://{args.host}:{args.port}/v1", flush=True)
    web.run_app(
        router.app(), host=args.host, port=args.port, access_log=None, print=None, handler_cancellation=True
    )
    return 0
