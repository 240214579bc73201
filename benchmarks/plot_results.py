"""Plot a dense decode result file's ratios to FlashMLA (needs matplotlib); the title says whether FlashMLA was
timed in the same run or its times are the remembered anchor's (another board).

    python benchmarks/plot_results.py benchmarks/results/dense_decode_h200.json docs/performance.png \
        [--label "serial=serial baseline"]
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from flashmla_side import REMEMBERED, THIS_RUN  # noqa: E402


def main(src: str, dst: str, labels: list) -> None:
    data = json.load(open(src))
    rows = [r for r in data["rows"] if r.get("kind", "dense") == "dense"]
    # Files from before FlashMLA ran in the same process hold no ratio_from: their ratios are the anchor's.
    same_run = all(r.get("ratio_from") == THIS_RUN for r in rows)
    schedules = list(dict.fromkeys(r["schedule"] for r in rows))
    # A schedule name may hold '=' itself (default:load_warpgroup=False): match the names, not the first '='.
    labels_for = {name: x[len(name) + 1:] for x in labels for name in schedules if x.startswith(name + "=")}
    configs = list(dict.fromkeys((r["b"], r["s_q"], r["h_q"], r["s_k"]) for r in rows))
    labels = [f"b{b} s{s}\nh{h}\n{k // 1024}K" for b, s, h, k in configs]
    fig, ax = plt.subplots(figsize=(11, 3.6), dpi=80)
    width = 0.8 / len(schedules)
    for i, name in enumerate(schedules):
        by = {(r["b"], r["s_q"], r["h_q"], r["s_k"]): r["ratio"] for r in rows if r["schedule"] == name}
        ax.bar([x + i * width for x in range(len(configs))], [by.get(c, 0) for c in configs], width,
               label=labels_for.get(name, name))
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + width * (len(schedules) - 1) / 2 for x in range(len(configs))], labels, fontsize=7)
    ax.set_ylabel("throughput / FlashMLA")
    flashmla = "FlashMLA timed in the same run" if same_run else f"FlashMLA's times {REMEMBERED}"
    device = data["meta"]["device"]
    ax.set_title(f"mla-cute dense decode on the {device}, relative to FlashMLA ({flashmla}, same method)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dst)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--label", action="append", default=[], help="SCHEDULE=LEGEND, to rename a legend entry")
    args = ap.parse_args()
    main(args.src, args.dst, args.label)
