"""Plot a prefill result file (``bench_prefill.py --out``): TFLOP/s of FlashMLA and mla-cute per row, with the
ratio above each pair (needs matplotlib).

    python benchmarks/plot_prefill.py benchmarks/results/sparse_prefill_h200.json docs/sparse_prefill.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, dst: str) -> None:
    rows = json.load(open(src))["rows"]
    labels = [f"d{r['d_qk']} h{r['h_q']}\nk{r['topk']}\n{r['s_kv'] // 1024}K" for r in rows]
    fig, ax = plt.subplots(figsize=(11, 3.6), dpi=80)
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["flashmla_tflops"] for r in rows], 0.4, label="FlashMLA (SM90; h_q < 64 padded)")
    ax.bar([x + 0.2 for x in xs], [r["tflops"] for r in rows], 0.4, label="mla-cute")
    for x, r in zip(xs, rows):
        ax.text(x, max(r["tflops"], r["flashmla_tflops"]) + 8, f"{r['ratio']:.2f}", ha="center", fontsize=7)
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("TFLOP/s")
    ax.set_title("sparse prefill, s_q 4096, sink on: same process, interleaved, one H200 (ratio above)", fontsize=9)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(dst)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
