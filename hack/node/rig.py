"""Entry point: `python hack/node/rig.py [--help] up|down|images|status|tag|test`.

The folder is loaded as a package under a name of its own (`disagg_node_rig`), so its modules
import each other relatively and no name here (`node`, `build`, ...) can collide with another
package on sys.path. It runs as a file on a node host, with or without the project installed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

PACKAGE = "disagg_node_rig"


def load_package():
    if PACKAGE in sys.modules:
        return sys.modules[PACKAGE]
    here = Path(__file__).resolve().parent
    spec = importlib.util.spec_from_file_location(
        PACKAGE, here / "__init__.py", submodule_search_locations=[str(here)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = module
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    load_package()
    from disagg_node_rig import cli  # noqa: E402

    sys.exit(cli.main())
