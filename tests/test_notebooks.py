"""The example notebooks run top to bottom (on a CPU: reference backend and compile-only paths).

Each notebook is executed with nbclient in a fresh kernel of *this* interpreter (a kernel
spec written to a temporary folder, so a ``python3`` kernel installed elsewhere is not used),
with the notebook's folder as working directory.  The notebooks are stored without outputs,
and running them must leave nothing behind in ``examples/``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
jupyter_client = pytest.importorskip("jupyter_client")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NOTEBOOKS = ["quickstart.ipynb", "schedule_lab.ipynb", "fp8_cache.ipynb"]
CELL_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory):
    """A kernel spec named python3 that starts ipykernel with the running interpreter."""
    root = tmp_path_factory.mktemp("kernels")
    spec = root / "python3"
    spec.mkdir()
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"Python {sys.version_info.major}.{sys.version_info.minor} (tests)",
        "language": "python",
    }))
    return root


def _listing(folder: Path) -> set:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if "__pycache__" not in p.parts}


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_stored_without_outputs(name):
    nb = nbformat.read(EXAMPLES / name, as_version=4)
    nbformat.validate(nb)
    assert nb.nbformat == 4
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.execution_count is None and cell.outputs == [], f"{name}: a code cell has stored output"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, kernel_dir):
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    nb = nbformat.read(EXAMPLES / name, as_version=4)
    before = _listing(EXAMPLES)
    km = KernelManager(
        kernel_name="python3",
        kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernel_dir)], ensure_native_kernel=False),
    )
    client = nbclient.NotebookClient(
        nb, km=km, kernel_name="python3", timeout=CELL_TIMEOUT_S, startup_timeout=120,
        resources={"metadata": {"path": str(EXAMPLES)}},
    )
    client.execute()  # raises CellExecutionError (with the cell and traceback) on the first error
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            assert output.get("output_type") != "error", f"{name}: error output in a cell:\n{cell.source}"
    assert _listing(EXAMPLES) == before, f"{name} left files in examples/: {sorted(_listing(EXAMPLES) - before)}"
