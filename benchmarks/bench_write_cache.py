"""``mla_cute.write_kv_cache`` on the GPU: one call that quantizes a step's new rows into their slots, per format
(the call every layer makes every step), the cache writer kernel beside the torch writer (``backend="reference"``
on the same tensors).

Per row: a cache of 64 K tokens (page 64) in the format, n new bf16 rows in random distinct slots (a decode step
of b requests x s_q tokens, or a prefill chunk).  Three times per row, medians after warm-up:
  call_us     CUDA events around one kernel call (host work included), interleaved with
  torch_us    the same around one torch-writer call;
  graph_us    GPU time of one kernel call inside a CUDA graph of 61 calls (a DeepSeek step's layers).

    python benchmarks/bench_write_cache.py [--out rows.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

import mla_cute
from bench_decode import event_median
from mla_cute.kv_formats import HEAD_DIM

FORMATS = ("V32", "V32_NO_ROPE", "V4", "V41", "V41_PAGED", "V41_FP4")
SHAPES = ((2, 1), (128, 2), (1, 8192))  # (b, s_q): n = b * s_q rows
TOKENS, PAGE, LAYERS = 65536, 64, 61


def time_row(fmt, b, s_q):
    d, nb = HEAD_DIM[fmt], TOKENS // PAGE
    cache = mla_cute.quantize_kv_cache(torch.randn(nb, PAGE, 1, d, device="cuda").bfloat16(), fmt)
    n = b * s_q
    rows = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(nb * PAGE, device="cuda")[:n].to(torch.int32)
    kernel = lambda: mla_cute.write_kv_cache(cache, rows, slots, kv_format=fmt)  # noqa: E731
    ref = lambda: mla_cute.write_kv_cache(cache, rows, slots, kv_format=fmt, backend="reference")  # noqa: E731
    calls, torches = [], []
    for _ in range(5):  # interleaved blocks
        calls.append(event_median(kernel, warmup=3, runs=20))
        torches.append(event_median(ref, warmup=2, runs=10))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAYERS):
            kernel()
    graphs = []
    for _ in range(5):
        graph.replay()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        graphs.append(s.elapsed_time(e) / LAYERS)
    return dict(kv_format=fmt, b=b, s_q=s_q, rows=n, call_us=statistics.median(calls) * 1e3,
                torch_us=statistics.median(torches) * 1e3, graph_us=statistics.median(graphs) * 1e3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    print("| kv_format | b | s_q | rows | kernel call us | torch call us | kernel in a graph us |\n"
          "|---|---|---|---|---|---|---|")
    recs = []
    for fmt in FORMATS:
        for b, s_q in SHAPES:
            rec = time_row(fmt, b, s_q)
            recs.append(rec)
            print(f"| {fmt} | {b} | {s_q} | {rec['rows']} | {rec['call_us']:.1f} | {rec['torch_us']:.1f} | "
                  f"{rec['graph_us']:.2f} |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=dict(device=torch.cuda.get_device_name(), torch=torch.__version__), rows=recs), f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
