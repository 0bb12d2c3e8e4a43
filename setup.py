"""Map the top-level folders into one `disagg.*` distribution.

A top-level package named `operator` would shadow the standard library, so each
folder is installed under the `disagg` namespace instead (see DESIGN.md §2).
"""

import importlib.util
import os
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

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


class BuildWithProtos(build_py):
    """Generates the gRPC modules into the wheel (grpcio-tools is a build requirement only); an
    editable install leaves them to `python -m disagg.proto.build` in the checkout."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        spec = importlib.util.spec_from_file_location("proto_build", Path("proto") / "build.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        out = Path(self.build_lib) / "disagg" / "proto"
        out.mkdir(parents=True, exist_ok=True)
        module.build(force=True, out_dir=out)


packages, package_dir = _packages()
setup(
    cmdclass={"build_py": BuildWithProtos},
    packages=packages,
    package_dir=package_dir,
    package_data={"disagg.proto": ["*.proto"], "disagg.kernels": ["*.c", "*.h"]},
)
