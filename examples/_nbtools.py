"""Small helpers shared by the example notebooks (not part of the mla_cute package).

- ``capture_fd2()``: capture what is written to file descriptor 2.  ptxas prints its
  resource report ("Used N registers", spill bytes) from C code straight to fd 2, which
  ``contextlib.redirect_stderr`` (a Python-level redirect) does not see.
- ``ptxas_report(text)``: the registers and stack/spill bytes in that report.
- ``ptx_counts(ptx)``: how often instruction families occur in a PTX string.
- ``median_time(fn)``: median seconds per call, synchronized on CUDA.
- ``load_gpu_cases()``: ``tests/gpu_cases.py`` (FlashMLA-style inputs) from this checkout.
"""

from __future__ import annotations

import contextlib
import importlib.util
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


@contextlib.contextmanager
def capture_fd2():
    """Send fd 2 (C-level stderr) into a temporary file for the duration of the block.

    ``with capture_fd2() as cap: ...`` then ``cap.text`` holds what was written.  Works in
    a plain interpreter and in a Jupyter kernel (which points fd 2 at its own pipe; the
    original fd is restored afterwards).
    """
    cap = _Captured()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield cap
        finally:
            try:
                sys.stderr.flush()
            finally:
                os.dup2(saved, 2)
                os.close(saved)
            tmp.seek(0)
            cap.text = tmp.read().decode("utf-8", errors="replace")


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


def median_time(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median seconds of ``fn()``; each call is synchronized on CUDA (so it includes launch cost)."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
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
