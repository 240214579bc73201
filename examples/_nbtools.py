"""Small helpers shared by the example notebooks (not part of the mla_cute package).

- ``capture_stderr()``: capture standard error, both file descriptor 2 (C level, where
  native code such as ptxas writes) and ``sys.stderr`` (Python level, where cutlass-dsl
  prints ptxas' resource report as a compiler remark).
- ``ptxas_report(text)``: the registers and stack/spill bytes in that report.
- ``ptx_counts(ptx)``: how often instruction families occur in a PTX string.
- ``median_time(fn)``: median seconds per call, synchronized on CUDA (single calls, or
  ``back_to_back`` calls per synchronization).
- ``load_gpu_cases()``: ``tests/gpu_cases.py`` (FlashMLA-style inputs) from this checkout.
- ``print_table(rows, header)``: an aligned text table.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


class _Captured:
    text: str = ""


class _StderrProxy:
    """Stands in for ``sys.stderr``: collects writes while active, then forwards them.

    Anything that keeps a reference to it (a logging handler created during the capture) then
    writes to whatever ``sys.stderr`` is at that time (the real one, or a later capture)
    instead of into a dead buffer.
    """

    def __init__(self, original):
        self._original = original
        self._buffer = io.StringIO()
        self.active = True

    def _target(self):
        return sys.stderr if sys.stderr is not self else self._original

    def write(self, text):
        return self._buffer.write(text) if self.active else self._target().write(text)

    def flush(self):
        if not self.active:
            self._target().flush()

    def getvalue(self):
        return self._buffer.getvalue()

    def __getattr__(self, name):
        return getattr(self._original, name)


@contextlib.contextmanager
def capture_stderr():
    """Capture standard error at both levels for the duration of the block.

    ``with capture_stderr() as cap: ...`` then ``cap.text`` holds what was written.

    - fd 2 (C level): ptxas and other native code write there directly, which a Python-level
      redirect does not see; fd 2 is pointed at a temporary file with ``os.dup2`` and restored
      afterwards (in a Jupyter kernel it is the kernel's own pipe).
    - ``sys.stderr`` (Python level): cutlass-dsl 4.8 formats the ptxas report as a compiler
      remark and ``print``s it to ``sys.stderr``, which in a Jupyter kernel is not fd 2.
    """
    cap = _Captured()
    sys.stderr.flush()
    saved = os.dup(2)
    py_err = _StderrProxy(sys.stderr)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            with contextlib.redirect_stderr(py_err):
                yield cap
        finally:
            py_err.active = False
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            cap.text = tmp.read().decode("utf-8", errors="replace") + py_err.getvalue()


_SPILL_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS_RE = re.compile(r"Used (\d+) registers")


def ptxas_report(text: str) -> dict:
    """Registers and stack/spill bytes from ptxas' report (one entry per compiled kernel)."""
    spills = [tuple(map(int, m)) for m in _SPILL_RE.findall(text)]
    regs = [int(m) for m in _REGS_RE.findall(text)]
    return {"registers": regs, "stack_spill_store_load": spills}


# Instruction lines: optional predicate, then the opcode with its modifiers.
_OPCODE_RE = re.compile(r"^\s*(?:@!?%\w+\s+)?([a-z][\w.:]*)", re.M)


def ptx_counts(ptx: str, families) -> dict:
    """Count instruction lines whose opcode starts with each family (``"bar.sync"`` counts
    ``bar.sync`` but not ``mbarrier.*``; ``"wgmma.mma_async"`` counts every wgmma shape)."""
    opcodes = _OPCODE_RE.findall(ptx)
    return {f: sum(op == f or op.startswith(f + ".") for op in opcodes) for f in families}


def median_time(fn, reps: int = 20, warmup: int = 3, back_to_back: int = 1) -> float:
    """Median seconds per call of ``fn()``, synchronized on CUDA.

    Each sample times ``back_to_back`` consecutive calls and one synchronization: with 1 a
    number includes the host's launch cost; with many the launches overlap the GPU work and
    the number approaches the kernels' own time.
    """
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(back_to_back):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / back_to_back)
    return statistics.median(times)


def load_gpu_cases():
    """Import ``tests/gpu_cases.py`` of this checkout by path (``tests`` is no installed package)."""
    name = "_mla_cute_gpu_cases"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "tests" / "gpu_cases.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def print_table(rows, header) -> None:
    """Print a list of rows as an aligned text table."""
    table = [list(map(str, header))] + [list(map(str, r)) for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for k, r in enumerate(table):
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if k == 0:
            print("  ".join("-" * w for w in widths))
