"""``mla_cute.write_kv_cache`` on the GPU: the time of one call that quantizes a decode step's new rows into their
slots, per format (the call every layer makes every step).

Per row: a cache of b requests x 32768 tokens (page 64) in the format, n = b x s_q new bf16 rows in random
distinct slots; each call timed by CUDA events around it (host work included: the checks read the slots),
median of 50 after 5 warm-up calls.

    python benchmarks/bench_write_cache.py [--out rows.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import mla_cute
from bench_decode import event_median
from mla_cute.kv_formats import HEAD_DIM

ROWS = [(fmt, b, s_q) for fmt in ("V32", "V4", "V41", "V41_FP4") for b, s_q in ((2, 1), (128, 2))]
TOKENS, PAGE = 32768, 64


def time_row(fmt, b, s_q):
    d, nb = HEAD_DIM[fmt], b * TOKENS // PAGE
    cache = mla_cute.quantize_kv_cache(torch.zeros(nb, PAGE, 1, d, device="cuda", dtype=torch.bfloat16), fmt)
    n = b * s_q
    rows = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(nb * PAGE, device="cuda")[:n].to(torch.int32)
    call = lambda: mla_cute.write_kv_cache(cache, rows, slots, kv_format=fmt)  # noqa: E731
    us = event_median(call, warmup=5, runs=50) * 1e3
    return dict(kv_format=fmt, b=b, s_q=s_q, rows=n, us=us)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    print("| kv_format | b | s_q | rows | us |\n|---|---|---|---|---|")
    recs = []
    for row in ROWS:
        rec = time_row(*row)
        recs.append(rec)
        print(f"| {rec['kv_format']} | {rec['b']} | {rec['s_q']} | {rec['rows']} | {rec['us']:.1f} |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=dict(device=torch.cuda.get_device_name(), torch=torch.__version__), rows=recs), f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
