"""`RouterProcessArgs`: what a router process binds, serves and reads (its address, the model's
tokenizer, the worker registry, the API keys); `RouterArgs`: the router's serving settings (admission bounds, prompt hashing, tool calls,
prefill overflow, the worker call's attempts, timeout and moves), each declared once with its
default, help and check, like `EngineArgs`.

`disagg router` generates its flags from the fields of both (`DISAGG_<FLAG>` gives a pod's default) and
hands them to the router (`Router(args, ...)`), `disagg up` passes them on with `to_cli_args`, and
the operator names the flags it writes into the router's pod through `cli_flag`.
Standard library only: the operator imports it without torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from disagg.worker.engine.args import EngineArgs
from disagg.worker.engine.settings import Settings, setting
from disagg.worker.serving.process_args import DeploymentArgs

# how `tool_choice: auto` finds calls in the output (router/tool_parsers.py, as vLLM names them)
TOOL_CALL_PARSERS = ("llama3_json", "hermes")
DEFAULT_MAX_CHOICES = 64
# an origin as a browser sends it in `Origin`: scheme://host[:port], nothing after
_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/?#\s]+")


def parse_origins(setting: str) -> frozenset[str]:
    """The origins of --allowed-origins (comma-separated; `*`: any), lowercased; ValueError names
    one that is not an origin (a path or a trailing slash would never match a browser's)."""
    origins = set()
    for item in setting.split(","):
        origin = item.strip().lower()
        if not origin:
            continue
        if origin != "*" and not _ORIGIN.fullmatch(origin):
            raise ValueError(f"--allowed-origins: {item.strip()!r} is not scheme://host[:port] or *")
        origins.add(origin)
    return frozenset(origins)


@dataclass
class RouterArgs(Settings):
    GROUP = "router"

    block_size: int = setting(
        EngineArgs.block_size,
        "the workers' KV block size: prompts are hashed per block for prefix-aware routing",
        minimum=1,
    )
    max_model_len: int | None = setting(
        None,
        "longest sequence (prompt + output) a request may ask for; default: the model's limit",
        minimum=2,
    )
    max_queue: int = setting(
        256, "generations in flight before answering 429 (a request with n=4 counts 4)", minimum=0
    )
    max_choices: int | None = setting(
        None,
        "most generations one request may ask for (n x number of prompts; more is a 400); "
        f"default: {DEFAULT_MAX_CHOICES}, at most --max-queue",
        minimum=1,
    )
    max_body_bytes: int = setting(
        32 << 20,
        "most bytes of a request body once decoded (a gzip or deflate body stops inflating one byte "
        "past it); more is a 413",
        minimum=1,
    )
    max_prompt_bytes: int = setting(
        1 << 20,
        "most bytes of prompt one request may send: its prompts' text summed, or for chat the prompt "
        "its template renders (estimated before rendering, measured before tokenizing); more is a 400",
        minimum=1,
    )
    max_messages: int = setting(
        4096,
        "most chat messages (or Responses input items) one request may send; more is a 400 before "
        "the chat template renders them",
        minimum=1,
    )
    max_grammar_bytes: int = setting(
        256 << 10,
        "most bytes of a request's structured output (guided_regex, guided_grammar, guided_choice, "
        "guided_json, response_format's schema, a forced tool call's schemas); more is a 400",
        minimum=1,
    )
    max_schema_depth: int = setting(
        512,
        "most levels a JSON schema (guided_json, response_format, tools' parameters) may nest, "
        "counting the levels each local $ref leads to; more is a 400 naming the field",
        minimum=1,
    )
    grammar_timeout: float = setting(
        2.0,
        "seconds a request's grammar may take to compile in the router's check; longer is a 400",
        minimum=0.0,
        exclusive_min=True,
    )
    grammar_threads: int = setting(
        1, "threads that compile requests' grammars (llguidance releases the GIL)", minimum=1
    )
    tokenize_threads: int = setting(
        2,
        "threads that render chat templates and tokenize prompts over 16 KiB (tokenizing releases "
        "the GIL); shorter prompts have one thread of their own, so they never queue behind long ones",
        minimum=1,
    )
    parse_processes: int = setting(
        1,
        "processes that parse request bodies over --parse-inline-bytes (JSON validation holds the "
        "GIL, so in a thread it would still stall the event loop); 0: every body is parsed on the loop",
        minimum=0,
    )
    parse_inline_bytes: int = setting(
        64 << 10,
        "bodies up to this size are parsed on the event loop (a few milliseconds at most); larger "
        "ones in the parse processes",
        minimum=0,
    )
    tool_call_parser: str | None = setting(
        None,
        "the model family's tool-call format, parsed for tool_choice 'auto' (as vLLM's flag); "
        "default: none, tool_choice 'auto' is refused",
        choices=TOOL_CALL_PARSERS,
    )
    prefill_overflow: float | None = setting(
        None,
        "let a prefill worker with no prompt queued serve a whole request (prefill and decode) when "
        "every decode worker is busier than it by more than this many requests; default: off",
        minimum=0.0,
    )

    max_migrations: int = setting(
        3,
        "times a stream may move to another decode worker when its worker dies, stops answering or "
        "drains mid-stream (it resumes there from the tokens already sent); 0: never, the client "
        "gets an error event",
        minimum=0,
    )

    decode_attempts: int = setting(
        3,
        "decode workers tried for a generation before its first token: one found unreachable or "
        "draining is replaced by another, since nothing was sent to the client yet",
        minimum=1,
    )
    request_timeout: float = setting(
        600.0,
        "seconds a generation may run on its decode worker; past it the client gets a 504",
        minimum=0.0,
        exclusive_min=True,
    )
    client_write_timeout: float = setting(
        30.0,
        "seconds a write to a client may wait for it to read (its connection's buffers full); past "
        "it the client is disconnected and its generations still running are aborted on their "
        "workers, so that a client that stops reading holds no queue slot or KV blocks",
        minimum=0.0,
        exclusive_min=True,
    )
    allowed_origins: str = setting(
        "",
        "comma-separated origins (https://app.example.com, or *) whose web pages may call this API "
        "from a browser (CORS); default: none, a browser's cross-origin call is refused",
    )

    stream_interval: int = setting(
        1,
        "tokens a decode worker gathers before it sends them on to a streaming client (as vLLM's and "
        "SGLang's flag): 1 sends each as it comes; more sends fewer, larger chunks",
        minimum=1,
    )
    nonstreaming_interval: int = setting(
        16,
        "the same for a request that does not stream, whose client sees the tokens only at the end: "
        "fewer messages leave more CPU to the engine; a stream moved to another worker resumes from "
        "the last tokens sent",
        minimum=1,
    )

    def check(self) -> None:
        super().check()
        parse_origins(self.allowed_origins)
        if self.max_choices is not None and self.max_choices > self.max_queue:
            # a request larger than the queue would get 429 forever
            raise ValueError(f"max_choices ({self.max_choices}) must not exceed max_queue ({self.max_queue})")

    def resolved_max_choices(self) -> int:
        """max_choices, or by default DEFAULT_MAX_CHOICES shrunk to the queue."""
        if self.max_choices is not None:
            return self.max_choices
        return max(1, min(DEFAULT_MAX_CHOICES, self.max_queue))


@dataclass
class RouterProcessArgs(DeploymentArgs):
    GROUP = "router process"

    host: str = setting(
        "127.0.0.1", "bind address (0.0.0.0 or the pod IP to serve clients beyond this machine)"
    )
    port: int = setting(8000, "HTTP port of the OpenAI API, /health and /metrics")
    model: str | None = setting(None, "model directory or GGUF file (tokenizer, chat template, context)")
    model_name: str | None = setting(None, "served model name (default: the directory or file name)")
    workers: str = setting("", "comma-separated worker gRPC addresses, in addition to the registry")
    api_key_file: str | None = setting(None, "file with one accepted API key per line")
