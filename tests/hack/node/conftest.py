"""The rig's modules (hack/node/) load as the package `disagg_node_rig`, as rig.py loads them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("disagg_node_rig_entry", ROOT / "hack" / "node" / "rig.py")
_entry = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_entry)
_entry.load_package()
