"""`disagg operator`: run the InferenceDeployment operator (kopf, embedded, in this process)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
import time

import kopf

from disagg.operator import handlers
from disagg.operator.autoscaling import handlers as autoscaler
from disagg.operator.kube import Kube
from disagg.operator.reconcile import Reconciler
from disagg.operator.settings import Settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        metavar="NS",
        help="watch this namespace (repeatable; globs like 'team-*' work)",
    )
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace (default)")
    parser.add_argument(
        "--liveness",
        metavar="URL",
        default=None,
        help="serve a liveness endpoint, e.g. http://0.0.0.0:8080/healthz",
    )
    parser.add_argument("--log-format", choices=("plain", "full", "json"), default="full")
    parser.add_argument(
        "--standalone", action="store_true", help="do not take part in peering (run exactly one replica)"
    )
    parser.add_argument(
        "--peering",
        default=None,
        metavar="NAME",
        help="name of the kopf peering object that elects one active replica (needs kopf's peering "
        "CRDs, kopfpeerings/clusterkopfpeerings.kopf.dev, installed; refused otherwise)",
    )
    parser.add_argument(
        "--resync-seconds",
        type=float,
        default=Settings.resync_seconds,
        help=f"how often every resource is re-checked for drift (default {Settings.resync_seconds:g})",
    )
    parser.add_argument(
        "--allow-host-path",
        action="append",
        default=[],
        metavar="PREFIX",
        help="let model.source.hostPath mount node directories under PREFIX (repeatable; none by default)",
    )
    parser.add_argument(
        "--operator-namespace",
        default=os.environ.get("POD_NAMESPACE"),
        metavar="NS",
        help="the namespace this operator runs in: NetworkPolicies let its autoscaler scrape /metrics "
        "from there (default: $POD_NAMESPACE)",
    )
    parser.add_argument(
        "--gpus-per-node",
        type=int,
        default=Settings.gpus_per_node,
        metavar="N",
        help="most GPUs a node offers one pod: a GPU role with a larger tensorParallelSize runs as a "
        "LeaderWorkerSet spanning nodes (refused where the cluster does not serve that API) "
        f"(default {Settings.gpus_per_node})",
    )
    parser.add_argument(
        "--serving-priority-class",
        default=Settings.serving_priority_class,
        metavar="NAME",
        help="PriorityClass of every deployment's router and managed Redis unless its spec names one "
        "(the chart creates one; default: none)",
    )
    parser.add_argument(
        "--not-ready-grace-seconds",
        type=float,
        default=Settings.not_ready_grace_seconds,
        metavar="S",
        help="how long a running pod may fail readiness before its deployment's status reports it "
        f"(default {Settings.not_ready_grace_seconds:g}: loading a large checkpoint takes minutes)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def register_all(
    registry: kopf.OperatorRegistry,
    *,
    login=handlers.default_login,
    resync_seconds: float = Settings.resync_seconds,
    autoscaler_settings: autoscaler.Settings | None = None,
    env=os.environ,
    settings: Settings | None = None,
) -> Reconciler:
    """The operator's handlers, plus the autoscaler's unless DISAGG_AUTOSCALER_DISABLED is set."""
    reconciler = handlers.register(registry, login=login, resync_seconds=resync_seconds, settings=settings)
    if env.get("DISAGG_AUTOSCALER_DISABLED", "") not in ("1", "true"):
        # One process, one API client: the autoscaler uses the one the operator's login configures.
        autoscaler.register(registry, kube=reconciler.kube, settings=autoscaler_settings)
    return reconciler


def build_registry(
    resync_seconds: float = Settings.resync_seconds, settings: Settings | None = None
) -> kopf.OperatorRegistry:
    """The default registry with every handler of the process."""
    registry = kopf.get_default_registry()
    register_all(registry, resync_seconds=resync_seconds, settings=settings)
    return registry


def settings_from(args: argparse.Namespace) -> Settings:
    for prefix in args.allow_host_path:
        if not prefix.startswith("/"):
            raise SystemExit(f"disagg operator: --allow-host-path {prefix!r} must be an absolute path")
    if args.gpus_per_node < 1:
        raise SystemExit(f"disagg operator: --gpus-per-node must be at least 1, got {args.gpus_per_node}")
    if args.not_ready_grace_seconds < 0:
        raise SystemExit(
            f"disagg operator: --not-ready-grace-seconds must not be negative, got {args.not_ready_grace_seconds:g}"
        )
    return Settings(
        host_path_prefixes=tuple(args.allow_host_path),
        operator_namespace=args.operator_namespace or None,
        gpus_per_node=args.gpus_per_node,
        resync_seconds=args.resync_seconds,
        serving_priority_class=args.serving_priority_class or None,
        not_ready_grace_seconds=args.not_ready_grace_seconds,
    )


# kopf's peering resources: namespaced for a namespaced operator, cluster-wide otherwise.
PEERING_API = "kopf.dev/v1"
PEERING_PLURAL = {True: "clusterkopfpeerings", False: "kopfpeerings"}


async def peering_problem(kube: Kube, clusterwide: bool) -> str | None:
    """Why `--peering` cannot work here, or None. Without its CRD kopf would pause every watch and
    wait for it forever, reconciling nothing and saying so only at debug level."""
    plural = PEERING_PLURAL[clusterwide]
    try:
        served = await kube.serves(PEERING_API, plural)
    finally:
        await kube.close()
    if served:
        return None
    return (
        f"--peering needs kopf's peering CRD ({plural}.kopf.dev), which this cluster does not serve: "
        "install kopf's peering CRDs and RBAC for them, or run one replica with --standalone"
    )


def peering_identity() -> str:
    """This replica's name in kopf's peering: host (the pod's name in a pod), pid and start time.
    Given to kopf explicitly because its default asks the password database for the user name,
    which fails in an image run under a uid it has no entry for (the chart's 65532)."""
    return f"disagg-operator@{socket.gethostname()}/{os.getpid()}/{int(time.time())}"


def run(args: argparse.Namespace) -> int:
    fmt = {"plain": kopf.LogFormat.PLAIN, "full": kopf.LogFormat.FULL, "json": kopf.LogFormat.JSON}[
        args.log_format
    ]
    kopf.configure(verbose=args.verbose, log_format=fmt)
    settings = settings_from(args)
    registry = build_registry(settings.resync_seconds, settings)
    clusterwide = args.all_namespaces or not args.namespace
    standalone = args.standalone or args.peering is None
    if not standalone:
        problem = asyncio.run(peering_problem(Kube(), clusterwide))
        if problem:
            print(f"disagg operator: {problem}", file=sys.stderr)
            return 2
    logging.getLogger(__name__).info(
        "watching %s", "all namespaces" if clusterwide else ", ".join(args.namespace)
    )
    try:
        asyncio.run(
            kopf.operator(
                registry=registry,
                clusterwide=clusterwide,
                namespaces=() if clusterwide else args.namespace,
                standalone=standalone,
                peering_name=args.peering,
                identity=peering_identity(),
                liveness_endpoint=args.liveness,
            )
        )
    except KeyboardInterrupt:
        return 130
    return 0
