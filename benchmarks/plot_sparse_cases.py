"""Plot ``bench_sparse_cases.py`` results: FlashMLA's time / ours on each of its sparse decode performance cases,
eager and in a CUDA graph (needs matplotlib).

    python benchmarks/plot_sparse_cases.py RESULTS.json OUT.png [--before OLD.json]

``--before``: a run of an earlier build, drawn beside it (its rows matched by configuration and batch).
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _rows(path: str) -> dict:
    with open(path) as f:
        data = json.load(f)
    return {(r["config"], r["b"]): r for r in data["rows"]}, data["meta"].get("device", "")


def main(src: str, dst: str, before: str | None) -> None:
    rows, device = _rows(src)
    old = _rows(before)[0] if before else {}
    keys = list(rows)
    labels = [f"{c.replace('CONFIG', 'V4 C').replace('PEAK_', 'pk ').replace('_', ' ').lower()}\nb{b}".replace(" d", "\nd")
              for c, b in keys]
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 0.42 * len(keys)), 6), sharex=True)
    for ax, (field, title) in zip(axes, (("ratio", "eager (metadata reused)"),
                                         ("graph_ratio", "CUDA graph (metadata made in the capture)"))):
        x = range(len(keys))
        width = 0.4 if old else 0.8
        if old:
            ax.bar([i - width / 2 for i in x], [old.get(k, {}).get(field, 0) for k in keys], width,
                   color="#bbbbbb", label="before")
        ax.bar([i + (width / 2 if old else 0) for i in x], [rows[k].get(field, 0) for k in keys], width,
               color="#2a7ab0", label="mla-cute" if not old else "now")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.axhline(1.1, color="#c0392b", lw=0.8, ls="--")
        ax.set_ylabel("FlashMLA / ours")
        ax.set_title(title, fontsize=9)
        if old:
            ax.legend(fontsize=7, loc="upper left")
    axes[1].set_xticks(list(range(len(keys))))
    axes[1].set_xticklabels(labels, fontsize=6)
    fig.suptitle(f"Sparse decode on FlashMLA's performance cases, side by side ({device})", fontsize=10)
    fig.tight_layout()
    fig.savefig(dst, dpi=72)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--before", default=None)
    args = ap.parse_args()
    main(args.src, args.dst, args.before)
