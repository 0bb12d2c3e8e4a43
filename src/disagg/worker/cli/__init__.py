"""The `disagg` command: one entry point for every role.

Each sub-command lives in its own module exposing `add_arguments(parser)` and
`run(args) -> int`; modules are imported only when their command runs so that
`disagg operator` does not pay for torch and `disagg worker` not for kopf.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import importlib.util
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "make-model": ("disagg.worker.cli.make_model", "write a randomly initialised Llama-family checkpoint"),
    "generate": ("disagg.worker.cli.generate", "run the engine offline on prompts"),
    "worker": ("disagg.worker.cli.worker", "run a prefill, decode or colocated worker"),
    "tp-ranks": ("disagg.worker.cli.tp_ranks", "run tensor-parallel ranks of a worker on another host"),
    "router": ("disagg.worker.cli.router", "run the OpenAI-compatible router"),
    "drain": ("disagg.worker.cli.drain", "drain a worker (its pod's preStop hook)"),
    "cleanup": ("disagg.worker.cli.cleanup", "delete a deployment's keys from Redis (its deletion Job)"),
    "up": ("disagg.worker.cli.up", "run Redis, workers and the router on this machine"),
    "plan": ("disagg.worker.cli.plan", "advise prefill/decode replica counts for a workload and its SLOs"),
    "operator": ("disagg.operator.main", "run the Kubernetes operator"),
}


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """`--help` shows every option's default: those whose help does not say it already get
    "(default: X)"; options without one (unset, empty, a switch) say nothing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default is None or action.default is argparse.SUPPRESS or action.default in ("", [])
        switch = action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction)
        if "default" in text or unset or switch or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)".lstrip()

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and self._get_help_string(action):  # argparse prints no line for no help
            action = copy.copy(action)
            action.help = self._get_help_string(action)
        return super()._format_action(action)


def _available() -> dict[str, tuple[str, str]]:
    found = {}
    for name, (module, help_text) in COMMANDS.items():
        if importlib.util.find_spec(module) is not None:
            found[name] = (module, help_text)
    return found


def parse(argv: list[str]) -> tuple[object, argparse.Namespace]:
    """The sub-command module and its parsed arguments for `disagg ARGV...`, exactly as the
    command line does it (also used by tests that check what pods are told to run)."""
    name = argv[0]
    module = importlib.import_module(_available()[name][0])
    cmd_parser = argparse.ArgumentParser(
        prog=f"disagg {name}", description=COMMANDS[name][1], formatter_class=DefaultsHelpFormatter
    )
    module.add_arguments(cmd_parser)
    # intermixed: options may follow positionals (`disagg generate MODEL --chat "Hi"`)
    return module, cmd_parser.parse_intermixed_args(argv[1:])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = _available()
    parser = argparse.ArgumentParser(prog="disagg", description="Disaggregated LLM serving.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_module, help_text) in commands.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        args = parser.parse_args(argv)  # prints help or the error for an unknown command
        if args.command is None:
            parser.print_help()
            return 2
    module, args = parse(argv)
    return int(module.run(args) or 0)
