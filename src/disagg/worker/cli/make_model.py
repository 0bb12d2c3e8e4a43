"""`disagg make-model`: write a randomly initialised Llama-family checkpoint and its tokenizer."""

from __future__ import annotations

import argparse
import sys

from disagg.worker.cli.flags import MakeModel
from disagg.worker.model.precisions import DTYPES
from disagg.worker.tools.make_model import PRESETS, make_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="directory to write the checkpoint into")
    parser.add_argument(
        MakeModel.PRESET,
        choices=sorted(PRESETS),
        default="tiny",
        help="tiny: ~1M parameters, for tests; tiny-trained(-draft): trained on a generated corpus, the "
        "demo and its draft; wide-trained: 25M trained, a memory-bound speculative-decoding target; "
        "small: ~100M random, for benchmarks",
    )
    parser.add_argument(MakeModel.SEED, type=int, default=0, help="seed of the random weights")
    parser.add_argument(
        MakeModel.DTYPE, choices=DTYPES, default="float32", help="dtype of the written weights"
    )
    parser.add_argument(
        MakeModel.SHARD_SIZE,
        type=_size,
        default=None,
        help="split the weights into files of at most this size (e.g. 50MB; default 200MB)",
    )
    parser.add_argument(
        MakeModel.FORCE, action="store_true", help="overwrite the checkpoint in a non-empty directory"
    )


def _size(text: str) -> int:
    units = {"KB": 1024, "MB": 1024**2, "GB": 1024**3, "B": 1}
    upper = text.strip().upper()
    for unit, scale in units.items():
        if upper.endswith(unit):
            try:
                return int(float(upper[: -len(unit)]) * scale)
            except ValueError:
                break
    try:
        return int(upper)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 200MB, 64KB or a byte count)") from None


def run(args: argparse.Namespace) -> int:
    def progress(message: str) -> None:
        print(message, flush=True)

    try:
        path = make_model(
            args.dir,
            args.preset,
            args.seed,
            args.dtype,
            args.shard_size,
            args.force,
            progress if args.preset != "tiny" else None,
        )
    except (FileExistsError, ValueError) as exc:
        print(f"disagg make-model: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.preset} model to {path}")
    return 0
