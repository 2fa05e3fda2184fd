"""The package's build step: generates the Python code of Lattice's hook
contract (lattice/hooks/v1/hooks.proto and what it imports) into
lattice_hook/pb of the build directory while the package is built.

The .proto files are read from LATTICE_PROTO_DIR, else ../../proto (this
package inside Lattice's repository). protoc writes absolute imports
(`from lattice.agent.v1 import ...`); they are rewritten to point inside
this package, so that installing it adds no top-level `lattice` package.
"""

import os
import pathlib
import re
import shutil
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = pathlib.Path(__file__).resolve().parent
PROTOS = ("lattice/agent/v1/content.proto", "lattice/hooks/v1/hooks.proto")


def proto_dir() -> pathlib.Path:
    for candidate in (os.environ.get("LATTICE_PROTO_DIR"), HERE / "proto", HERE.parent.parent / "proto"):
        if candidate and (pathlib.Path(candidate) / PROTOS[1]).is_file():
            return pathlib.Path(candidate)
    sys.exit("lattice-hook: Lattice's .proto files were not found: build from the repository or set LATTICE_PROTO_DIR")


def generate(out: pathlib.Path) -> None:
    from grpc_tools import protoc

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{proto_dir()}", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}",
            f"--grpc_python_out={out}", *PROTOS]
    if protoc.main(args) != 0:
        sys.exit("lattice-hook: protoc failed on Lattice's .proto files")
    imports = re.compile(r"^from lattice\.", re.MULTILINE)
    for path in out.rglob("*.py*"):
        path.write_text(imports.sub("from lattice_hook.pb.lattice.", path.read_text()))
    for directory in [out, *(p for p in out.rglob("*") if p.is_dir())]:
        (directory / "__init__.py").touch()
    (out / "__init__.py").write_text('"""The generated code of Lattice\'s hook contract."""\n')


class BuildWithContract(build_py):
    """Copies the package as usual, then generates the contract's code into
    the build directory (the source tree is left as it is)."""

    def run(self):
        super().run()
        generate(pathlib.Path(self.build_lib) / "lattice_hook" / "pb")


setup(cmdclass={"build_py": BuildWithContract})
