"""Shared pytest setup: CPU-only defaults, the CuTe DSL check, skipping of `gpu` / `compile` tests.

The CuTe DSL (`nvidia-cutlass-dsl`) is a requirement of the install on Linux (pyproject.toml:
``sys_platform == 'linux'``).  There a `compile` or `gpu` test that is collected needs
``import cutlass`` to work, and a failing import ends the test run with an error: a broken
install must not turn into skipped tests.  Elsewhere the DSL has no wheels and is not installed;
the `compile` and `gpu` tests skip and say so.  The import runs only when such tests are
collected (it is slow).
"""

import atexit
import importlib
import importlib.util
import os
import shutil
import sys
import tempfile

import pytest
import torch

# The platforms on which pyproject.toml installs the DSL (its `sys_platform == 'linux'` markers).
DSL_PLATFORMS = ("linux",)

# Without a GPU the CuTe DSL cannot query the target arch; this must be set before
# anything imports cutlass (test modules are imported after conftest).
if not torch.cuda.is_available():
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

# The DSL writes the files that `--keep-ptx` asks for (the compile tests' options) into
# $CUTE_DSL_DUMP_DIR, read once when cutlass is imported, by default the working directory:
# point it at a temporary folder for the whole run, removed at exit.
if "CUTE_DSL_DUMP_DIR" not in os.environ:
    _dump_dir = tempfile.mkdtemp(prefix="mla_cute_dsl_dump_")
    os.environ["CUTE_DSL_DUMP_DIR"] = _dump_dir
    atexit.register(shutil.rmtree, _dump_dir, ignore_errors=True)


def _dsl_required() -> bool:
    return sys.platform in DSL_PLATFORMS


def _dsl_skip_reason():
    """None when `import cutlass` works; a skip reason where the DSL is not part of the install.

    Where the DSL is a requirement (Linux), or where it is installed at all, a failing import
    stops the run with the error instead."""
    if not _dsl_required() and importlib.util.find_spec("cutlass") is None:
        return (f"the CuTe DSL (nvidia-cutlass-dsl) is installed on Linux only, "
                f"not on this platform ({sys.platform})")
    try:
        importlib.import_module("cutlass")
    except Exception as exc:  # reported, not hidden: a broken install can raise more than ImportError
        where = "a requirement of this install on Linux" if _dsl_required() else "installed here"
        pytest.exit(
            f"import cutlass failed ({type(exc).__name__}: {exc}). The CuTe DSL (nvidia-cutlass-dsl) is "
            f"{where}, and the collected compile/gpu tests need it: repair the install "
            "(pip install -e .), or deselect them with -m 'not compile and not gpu'.",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )
    return None


def _hopper_missing():
    if not torch.cuda.is_available():
        return "no CUDA device"
    cap = torch.cuda.get_device_capability()
    if cap != (9, 0):
        return f"CUDA device has capability {cap}, need (9, 0)"
    return None


@pytest.hookimpl(trylast=True)  # after `-m` / `-k` deselection: only the tests that will run count
def pytest_collection_modifyitems(config, items):
    gpu_items = [it for it in items if it.get_closest_marker("gpu")]
    compile_items = [it for it in items if it.get_closest_marker("compile")]
    hopper_missing = _hopper_missing() if gpu_items else None
    # The DSL is imported only when a test that is not skipped anyway needs it.
    if not compile_items and (not gpu_items or hopper_missing):
        dsl_skip = None
    else:
        dsl_skip = _dsl_skip_reason()
    if gpu_items:
        reasons = [r for r in (hopper_missing, dsl_skip) if r]
        if reasons:
            skip = pytest.mark.skip(reason="gpu test: " + "; ".join(reasons))
            for it in gpu_items:
                it.add_marker(skip)
    if compile_items and dsl_skip:
        skip = pytest.mark.skip(reason="compile test: " + dsl_skip)
        for it in compile_items:
            it.add_marker(skip)
