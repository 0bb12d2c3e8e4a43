"""The wheel carries the generated gRPC modules (grpcio-tools is a build requirement only); an
editable install leaves them to `python -m disagg.proto.build` in the checkout. The packages
themselves are found under src/ (pyproject.toml)."""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithProtos(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        spec = importlib.util.spec_from_file_location("proto_build", Path("src/disagg/proto/build.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        out = Path(self.build_lib) / "disagg" / "proto"
        out.mkdir(parents=True, exist_ok=True)
        module.build(force=True, out_dir=out)


setup(cmdclass={"build_py": BuildWithProtos})
