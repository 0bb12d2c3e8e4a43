"""`disagg drain`: the worker pod's preStop hook, run inside the pod (an `exec` hook).

A kubelet `httpGet` hook cannot carry a credential from a Secret, and `/drain` requires the
deployment's internal credential; this command reads it where the worker does
(DISAGG_INTERNAL_TOKEN or DISAGG_INTERNAL_TOKEN_FILE) and calls the worker's `/drain`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request

from disagg.worker.cli.flags import Drain


def add_arguments(p: argparse.ArgumentParser) -> None:
    port = os.environ.get("DISAGG_METRICS_PORT", "")
    p.add_argument(Drain.URL, default=f"http://127.0.0.1:{port}/drain" if port else None,
                   help="the worker's /drain (default: 127.0.0.1 on DISAGG_METRICS_PORT)")  # fmt: skip
    p.add_argument(Drain.TIMEOUT, type=float, default=3600.0, help="seconds to wait for the answer")
    from disagg.worker.serving import auth

    auth.add_cli_args(p)


def run(args) -> int:
    from disagg.worker.serving import auth

    if not args.url:
        raise SystemExit("disagg drain: give --url or set DISAGG_METRICS_PORT")
    credential = auth.from_cli_args(args, "disagg drain")
    request = urllib.request.Request(args.url, headers=credential.headers)
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as resp:
            body = json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as e:
        print(f"disagg drain: {args.url}: HTTP {e.code}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError) as e:
        print(f"disagg drain: {args.url}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(body), flush=True)
    return 0 if body.get("drained") else 1
