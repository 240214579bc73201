"""FlashMLA's precision statistics on FlashMLA's test data, for mla-cute schedules and FlashMLA's SM90 kernel
(where ``flash_mla`` imports; ``use_legacy=True``).

    python benchmarks/precision.py [--seeds 8] [--schedules "default;default:split_fixed_cost=3"] [--out p.json]

Each row (b, s_q, s_k, h_q, h_kv, causal) is drawn as FlashMLA's dense test draws it (``tests/gpu_cases.py``:
normal / 10 clamped to [-1, 1], NaN in unused pages); every kernel's out is compared with the torch reference
by the statistic FlashMLA's test bounds (cosine difference, 5e-6) and the largest absolute error (8e-4).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import mla_cute

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import bench_decode  # noqa: E402
from flashmla_side import flash_mla, schedule_list  # noqa: E402
from gpu_cases import cos_diff, make_dense_case  # noqa: E402

ROWS = [(1, 1, 4096, 1, 1, False), (1, 1, 4096, 128, 1, False), (2, 2, 4096, 64, 1, True), (6, 4, 4096, 9, 3, True),
        (1, 1, 131072, 128, 1, False), (2, 1, 4096, 128, 1, False)]


def flashmla_out(fm, case, causal):
    return fm.flash_mla_with_kvcache(case["q"], case["k_cache"], case["block_table"], case["cache_seqlens"], 512,
                                     fm.get_mla_metadata()[0], causal=causal, use_legacy=True)[0]


def ours(case, causal, variant):
    return bench_decode.dense_decode(variant, **case, head_dim_v=512,
                                     tile_scheduler_metadata=mla_cute.get_mla_metadata()[0], causal=causal)[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--schedules", default="default")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    names = schedule_list(args.schedules)
    schedules = {n: bench_decode.schedule_named(n) for n in names}
    fm = flash_mla()  # FlashMLA's column only where flash_mla imports
    rows = []
    for b, s_q, s_k, h_q, h_kv, causal in ROWS:
        stats = {n: [] for n in ["flashmla", *names]}
        for seed in range(args.seeds):
            case = make_dense_case(b, s_q, s_k, h_q, h_kv, gen=torch.Generator().manual_seed(seed))
            ref = mla_cute.flash_mla_with_kvcache(**case, head_dim_v=512,
                                                  tile_scheduler_metadata=mla_cute.get_mla_metadata()[0],
                                                  causal=causal, backend="reference")[0].float()
            outs = {"flashmla": flashmla_out(fm, case, causal) if h_kv == 1 and fm is not None else None}
            outs.update({n: ours(case, causal, s) for n, s in schedules.items()})
            for n, out in outs.items():
                if out is not None:
                    fin = torch.isfinite(ref)
                    stats[n].append(dict(cos_diff=cos_diff(out.float()[fin], ref[fin]),
                                         max_abs=float((out.float()[fin] - ref[fin]).abs().max())))
        row = dict(b=b, s_q=s_q, s_k=s_k, h_q=h_q, h_kv=h_kv, causal=causal, stats=stats)
        rows.append(row)
        summary = " | ".join(f"{n}: cos {max(x['cos_diff'] for x in v):.2e} max, "
                             f"{sum(x['cos_diff'] for x in v) / len(v):.2e} mean" for n, v in stats.items() if v)
        print(f"{(b, s_q, s_k, h_q, h_kv, causal)}: {summary}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
