"""The build's one hook beyond pyproject.toml: a wheel that carries compiled kernels.

    MLA_CUTE_BUNDLE_KERNELS=deepseek-v32-sparse,deepseek-v3-dense MLA_CUTE_BUNDLE_JOBS=16 \\
        pip wheel . --no-build-isolation --no-deps -w dist

builds the named shape sets' sm_90a kernels (``python -m mla_cute.precompile``, which needs this project installed
in the building environment, e.g. ``pip install -e .``, and no GPU) into the wheel's ``mla_cute/_kernels``; an
install of that wheel loads them instead of compiling, for the same DSL and TVM-FFI versions.  Without the
variable the wheel carries no kernels.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


def bundle_kernels(target: Path, sets: str, jobs: str, run=subprocess.run) -> None:
    """Build ``sets`` into ``target`` as the disk cache does, then keep only whole entries (object, checksum,
    description; the shared library and its checksum where a compiler linked one).  ``target`` loses group and
    other write permission first (a cache directory others may write is not used)."""
    target.chmod(target.stat().st_mode & ~0o022)
    env = dict(os.environ, MLA_CUTE_CACHE_DIR=str(target), CUTE_DSL_ARCH=os.environ.get("CUTE_DSL_ARCH", "sm_90a"))
    run([sys.executable, "-m", "mla_cute.precompile", "--sets", sets, "--jobs", jobs], env=env, check=True)
    for path in target.iterdir():
        if ".tmp." in path.name or path.suffix not in (".o", ".so", ".sum", ".txt"):
            path.unlink()


class BuildWithKernels(build_py):
    def run(self):
        super().run()
        sets = os.environ.get("MLA_CUTE_BUNDLE_KERNELS")
        if sets:
            target = Path(self.build_lib) / "mla_cute" / "_kernels"
            target.mkdir(parents=True, exist_ok=True)
            bundle_kernels(target, sets, os.environ.get("MLA_CUTE_BUNDLE_JOBS", str(os.cpu_count() or 1)))


if __name__ == "__main__":
    setup(cmdclass={"build_py": BuildWithKernels})
