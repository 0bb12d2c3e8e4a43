"""Map the top-level folders into one `disagg.*` distribution.

A top-level package named `operator` would shadow the standard library, so each
folder is installed under the `disagg` namespace instead (see DESIGN.md §2).
"""

import os

from setuptools import setup

FOLDERS = {
    "worker": "disagg.worker",
    "kernels": "disagg.kernels",
    "proto": "disagg.proto",
    "operator": "disagg.operator",
}


def _packages():
    packages, package_dir = [], {}
    for folder, name in FOLDERS.items():
        for root, _dirs, files in os.walk(folder):
            if "__init__.py" not in files or "__pycache__" in root:
                continue
            rel = os.path.relpath(root, folder)
            pkg = name if rel == "." else name + "." + rel.replace(os.sep, ".")
            packages.append(pkg)
            package_dir[pkg] = root
    return packages, package_dir


packages, package_dir = _packages()
setup(
    packages=packages,
    package_dir=package_dir,
    package_data={"disagg.proto": ["*.proto"], "disagg.kernels": ["*.c"]},
)
