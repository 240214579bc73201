"""Small helpers shared by the example notebooks (not part of the mla_cute package).

- ``capture_stderr()``: capture standard error, both file descriptor 2 (C level, where
  native code such as ptxas writes) and ``sys.stderr`` (Python level, where cutlass-dsl
  prints ptxas' resource report as a compiler remark).
- ``ptxas_report(text)``: the registers and stack/spill bytes in that report.
- ``ptx_counts(ptx)``: how often instruction families occur in a PTX string.
- ``median_time(fn)``: median seconds per call, synchronized on CUDA (single calls, or
  ``back_to_back`` calls per synchronization).
- ``load_gpu_cases()``: ``tests/gpu_cases.py`` (FlashMLA-style inputs) from this checkout.
- ``load_experiments()``: ``benchmarks/experiments.py``'s named kernel variants (the serial baseline).
- ``print_table(rows, header)``: an aligned text table.
- ``pyplot()``: matplotlib's pyplot, or None where matplotlib does not import.
- ``plan_segments`` / ``plan_summary``: what each part of a split plan reads, and the plan's facts.
- ``show_plans``, ``show_bars``, ``show_histogram``: the notebooks' pictures, drawn with matplotlib where
  it imports, else printed as text.
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


def load_experiments() -> dict:
    """``EXPERIMENTS`` of ``benchmarks/experiments.py`` (name -> rewrite of a dense split config), by path."""
    name = "_mla_cute_experiments"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "benchmarks" / "experiments.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name].EXPERIMENTS


# ----------------------------------------------------------------------------- pictures


def pyplot():
    """``matplotlib.pyplot``, or None where matplotlib does not import (the pictures are then printed as text)."""
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def picture_mode() -> str:
    return "matplotlib" if pyplot() is not None else "text (matplotlib does not import)"


def _num_blocks(n: int, block_n: int) -> int:
    return max(n - 1, 0) // block_n + 1  # a request of length 0 still has its block 0 (see the planner)


def plan_segments(records, lengths, block_n: int = 64) -> list:
    """Per part, the (request, first block, end block) pieces it reads, in order, from ``plan_splits`` records."""
    lens = [int(n) for n in lengths]
    parts = []
    for begin_req, end_req, begin_block, end_block, *_ in records.tolist():
        segs = []
        for r in range(begin_req, end_req + 1):
            lo = begin_block if r == begin_req else 0
            hi = end_block if r == end_req else _num_blocks(lens[r], block_n)
            if hi > lo:
                segs.append((r, lo, hi))
        parts.append(segs)
    return parts


def plan_summary(records, num_splits, lengths, block_n: int = 64) -> dict:
    """A plan's facts: extra pieces (splits beyond one a request), requests split, the busiest part's blocks,
    parts that read from two requests or more, and whether a combine is needed."""
    splits = [b - a for a, b in zip(num_splits.tolist(), num_splits.tolist()[1:])]
    segs = plan_segments(records, lengths, block_n)
    return {
        "extra pieces": sum(splits) - len(splits),
        "requests split": sum(s > 1 for s in splits),
        "busiest part (blocks)": max(sum(hi - lo for _, lo, hi in p) for p in segs),
        "parts with 2+ requests": sum(len(p) > 1 for p in segs),
        "combine": any(s > 1 for s in splits),
    }


_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def show_plans(plans: dict, block_n: int = 64, width: int = 32) -> None:
    """Draw split plans side by side, one row per part, its blocks left to right, one color (or letter) per
    request, numbered where the room allows; pieces of a split request are hatched (lowercase).  ``plans``: title -> (records, num_splits,
    lengths), as ``plan_splits`` returns them and the lengths it planned."""
    drawn = {}
    for title, (records, num_splits, lengths) in plans.items():
        splits = [b - a for a, b in zip(num_splits.tolist(), num_splits.tolist()[1:])]
        drawn[title] = (plan_segments(records, lengths, block_n), splits)
    longest = max(sum(hi - lo for _, lo, hi in p) for segs, _ in drawn.values() for p in segs)
    plt = pyplot()
    if plt is not None:
        num_parts = max(len(segs) for segs, _ in drawn.values())
        fig, axes = plt.subplots(1, len(drawn), figsize=(5 * len(drawn), 1.2 + 0.16 * num_parts), sharey=True,
                                 squeeze=False)
        colors = plt.get_cmap("tab10").colors
        for ax, (title, (segs, splits)) in zip(axes[0], drawn.items()):
            for part, pieces in enumerate(segs):
                x = 0
                for r, lo, hi in pieces:
                    ax.barh(part, hi - lo, left=x, height=0.85, color=colors[r % len(colors)], edgecolor="black",
                            linewidth=0.3, hatch="///" if splits[r] > 1 else None)
                    if hi - lo >= longest / 12:  # the request's number, where it fits
                        ax.text(x + (hi - lo) / 2, part, str(r), ha="center", va="center", fontsize=7,
                                bbox={"boxstyle": "square,pad=0.05", "facecolor": "white", "edgecolor": "none", "alpha": 0.7})
                    x += hi - lo
            ax.set_title(title, fontsize=10)
            ax.set_xlim(0, longest * 1.02)
            ax.set_xlabel(f"{block_n}-token blocks read by the part")
        axes[0][0].set_ylabel("part")
        axes[0][0].invert_yaxis()
        fig.tight_layout()
        plt.show()
        return
    per_char = max(1, -(-longest // width))
    columns = []
    for title, (segs, splits) in drawn.items():
        lines = []
        for pieces in segs:
            line, x = "", 0
            for r, lo, hi in pieces:
                chars = max(1, round((x + hi - lo) / per_char) - round(x / per_char))
                letter = _LETTERS[r % 26]
                line += (letter.lower() if splits[r] > 1 else letter) * chars
                x += hi - lo
            lines.append(line)
        columns.append((title, lines))
    col = max(width + 2, *(len(t) for t, _ in columns))
    print("   ".join(f"{'part':>4} " + t.ljust(col) for t, _ in columns))
    for part in range(max(len(lines) for _, lines in columns)):
        print("   ".join(f"{part:4d} " + ("|" + (lines[part] if part < len(lines) else "")).ljust(col)
                         for _, lines in columns))
    print(f"(one character: {per_char} blocks of {block_n} tokens; letter: request number mod 26, A = 0; "
          f"lowercase: a piece of a split request)")


def show_bars(labels: list, values: list, *, title: str, xlabel: str, marks: list | None = None, ref: float = 1.0,
              width: int = 40) -> None:
    """A horizontal bar per label, from ``ref`` to its value (right: above ``ref``); ``marks``: per label, more
    values drawn as dots (each process's own value, say)."""
    lo, hi = min(min(values), ref), max(max(values), ref)
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(7, 0.8 + 0.38 * len(labels)))
        y = list(range(len(labels)))
        ax.barh(y, [v - ref for v in values], left=ref, height=0.6,
                color=["tab:green" if v >= ref else "tab:red" for v in values])
        for i, v in enumerate(values):
            dots = marks[i] if marks else []
            for m in dots:
                ax.plot(m, i, "k.", markersize=5)
            at = max([v, *dots]) if v >= ref else min([v, *dots])
            ax.text(at, i, f"  {v:.3f}" if v >= ref else f"{v:.3f}  ", va="center", fontsize=9,
                    ha="left" if v >= ref else "right")
        ax.axvline(ref, color="black", linewidth=0.8)
        ax.set_yticks(y, labels)
        ax.invert_yaxis()
        pad = 0.25 * (hi - lo) + 0.01
        ax.set_xlim(lo - pad, hi + pad)
        ax.set_xlabel(xlabel)
        ax.set_title(title, fontsize=10)
        fig.tight_layout()
        plt.show()
        return
    print(title)

    def at(v):
        return round((v - lo) / (hi - lo or 1.0) * width)

    center, pad = at(ref), max(len(lab) for lab in labels)
    for i, (lab, v) in enumerate(zip(labels, values)):
        cells = [" "] * (width + 1)
        for k in (range(center + 1, at(v) + 1) if v >= ref else range(at(v), center)):
            cells[k] = "#" if v >= ref else "="
        cells[center] = "|"
        extra = f"  ({', '.join(f'{m:.3f}' for m in marks[i])})" if marks else ""
        print(f"{lab.ljust(pad)} {''.join(cells)} {v:.3f}{extra}")
    print(f"({xlabel}; bars start at '|' = {ref:g}, '#' above it, '=' below"
          + ("; in brackets: each process's value)" if marks else ")"))


def show_histogram(values, *, bins: int = 24, title: str, xlabel: str, width: int = 40) -> None:
    """A histogram of ``values`` (a tensor, on any device, or a list of floats)."""
    values = [float(v) for v in (values.flatten().tolist() if hasattr(values, "tolist") else values)]
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(7, 3.2))
        ax.hist(values, bins=bins, color="tab:blue", edgecolor="white", linewidth=0.4)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("count")
        ax.set_title(title, fontsize=10)
        fig.tight_layout()
        plt.show()
        return
    lo, hi = min(values), max(values)
    step = (hi - lo) / bins or 1.0
    counts = [0] * bins
    for v in values:
        counts[min(int((v - lo) / step), bins - 1)] += 1
    print(title)
    for k, c in enumerate(counts):
        print(f"{lo + k * step:9.5f} - {lo + (k + 1) * step:9.5f} | {'#' * round(c / max(counts) * width):{width}s} {c}")
    print(f"({xlabel}; {len(values)} values)")
