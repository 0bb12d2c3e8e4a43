"""The rig's command line: `up`, `down`, `images`, `status`, `tag SRC DST`, `test`."""

from __future__ import annotations

import argparse
import sys

from . import settings
from .settings import SETTINGS

USAGE = """A real Kubernetes node on this machine for the project's end-to-end tests: containerd, runc,
the kubelet, kube-proxy and DNS inside a network namespace, a control plane on the loopback, and
the product's images built from its own Dockerfiles without a registry. Runs as root."""


SETTINGS_NOTE = """Each setting is read from its environment variable unless its option is given; make
passes the environment through (`make node-up K8S_BIN=/opt/k8s` or `K8S_BIN=... make node-up`)."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rig.py", description=USAGE, epilog=SETTINGS_NOTE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    for s in SETTINGS:
        p.add_argument(f"--{s.name.replace('_', '-')}", dest=s.name, metavar="VALUE",
                       help=f"{s.help} [{s.env}; default: {s.default or 'empty'}]")  # fmt: skip
    sub = p.add_subparsers(dest="command", required=True, metavar="{up,down,images,status,tag,test}")
    sub.add_parser("up", help="build what is missing, start everything, wait for the node and DNS")
    sub.add_parser("down", help="stop and remove everything the rig put on the host (images stay cached)")
    img = sub.add_parser("images", help="build the images only (imported too when the node is up)")
    img.add_argument("names", nargs="*", help="worker-cpu, operator, redis, pause (default: all)")
    sub.add_parser("status", help="what runs; exit 0 when the node is Ready")
    tag = sub.add_parser(
        "tag", help="the imported image SRC also under the name DST (an image change, no rebuild)"
    )
    tag.add_argument("source")
    tag.add_argument("target")
    sub.add_parser("test", help="pytest tests/cluster/node against the rig (other arguments go to pytest)")
    sub.add_parser("dns-sync")  # the rig's own DNS updater, started by `up`
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args, extra = p.parse_known_args(argv)
    if extra and args.command != "test":
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    overrides = {s.name: getattr(args, s.name) for s in SETTINGS if getattr(args, s.name) is not None}
    try:
        cfg = settings.load(overrides=overrides)
    except ValueError as err:
        print(f"rig.py: {err}", file=sys.stderr)
        return 2
    from . import lifecycle  # after the settings are known to be good

    try:
        if args.command == "up":
            lifecycle.up(cfg)
        elif args.command == "down":
            lifecycle.down(cfg)
        elif args.command == "images":
            lifecycle.images_only(cfg, args.names)
        elif args.command == "status":
            return lifecycle.status(cfg)
        elif args.command == "tag":
            lifecycle.tag(cfg, args.source, args.target)
        elif args.command == "test":
            lifecycle.test(cfg, extra)
        elif args.command == "dns-sync":
            from . import dnssync
            from .layout import Layout

            layout = Layout(cfg.state)
            dnssync.run_forever(cfg, layout, lifecycle.admin_api(cfg, layout))
    except lifecycle.RigError as err:
        print(f"rig.py {args.command}: {err}", file=sys.stderr)
        return 1
    except Exception as err:  # a stage failed: say which, and where the logs are
        print(f"rig.py {args.command}: {type(err).__name__}: {err}", file=sys.stderr)
        print(f"logs: {cfg.state / 'logs'}; `make node-down` removes a partial rig", file=sys.stderr)
        return 1
    return 0
