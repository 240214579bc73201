"""Sparse FP8 decode benchmark, by the method of the FlashMLA anchor numbers
(benchmarks/results/anchor_flashmla_sparse_fp8_h200.json).

Random distinct topk tokens per query out of its request's s_k, page 64, random block
placement, 656-byte FP8 rows (random e4m3 values, power-of-two scales, bf16 RoPE), no
topk_length, no sink, metadata computed on the first call and reused; after 0.5 s of GPU
work, time = median of triton.testing.do_bench(fn, warmup=10, rep=100) over the whole call
(split kernel + combine, or the split kernel alone when the plan splits no request).
FLOPs = 2*b*s_q*h_q*topk*(576+512); bytes = b*s_q*topk*656 + 2*b*s_q*h_q*(576+512).

    python benchmarks/bench_sparse.py [--out results.json] [--quick] [--schedules default,...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import mla_cute
from bench_decode import bench, pick_rows, save, schedule_list, table, warm_gpu, with_fields

CONFIGS = [  # (b, s_q, h_q, s_k, topk): the anchor's rows
    (2, 2, 128, 32768, 2048), (64, 2, 128, 32768, 2048), (74, 2, 128, 32768, 2048), (128, 2, 128, 32768, 2048),
    (128, 2, 64, 32768, 2048), (128, 1, 128, 32768, 2048), (64, 2, 128, 65536, 16384),
]
ANCHOR = os.path.join(os.path.dirname(__file__), "results", "anchor_flashmla_sparse_fp8_h200.json")
REPS = dict(warmup=10, rep=100)  # do_bench's, as the anchor was timed


def schedules():
    from mla_cute.schedules import DEFAULT_SPARSE_SCHEDULE, SERIAL_SPARSE_SCHEDULE, SparseDecodeSchedule

    return {"default": DEFAULT_SPARSE_SCHEDULE,
            "no_crossover": SparseDecodeSchedule(crossover=False),
            "crossover": SparseDecodeSchedule(crossover=True),
            "serial": SERIAL_SPARSE_SCHEDULE}


def make_inputs(b, s_q, h_q, s_k, topk, page=64, device="cuda"):
    blocks = (s_k + page - 1) // page
    nb = b * blocks
    raw = torch.empty(nb, page, 656, dtype=torch.uint8, device=device)
    raw[..., :512] = torch.randn(nb, page, 512, device=device).to(torch.float8_e4m3fn).view(torch.uint8)
    scales = torch.pow(2.0, torch.randint(-8, -3, (nb, page, 4), device=device).float())
    raw[..., 512:528] = scales.view(torch.uint8)
    raw[..., 528:] = (torch.randn(nb, page, 64, device=device) * 0.1).to(torch.bfloat16).view(torch.uint8)
    k_cache = raw.view(torch.float8_e4m3fn).view(nb, page, 1, 656)
    block_table = torch.randperm(nb, device=device, dtype=torch.int64).view(b, blocks)
    pos = torch.rand(b, s_q, s_k, device=device).argsort(dim=-1)[..., :topk]
    phys = torch.gather(block_table.unsqueeze(1).expand(b, s_q, blocks), 2, pos // page)
    indices = (phys * page + pos % page).to(torch.int32)
    q = torch.randn(b, s_q, h_q, 576, device=device, dtype=torch.bfloat16)
    return q, k_cache, indices


def sparse_call(inputs, schedule, meta):
    """The whole sparse decode call on ``make_inputs``' tensors."""
    q, k_cache, indices = inputs
    return lambda: mla_cute.flash_mla_with_kvcache(q, k_cache, None, None, 512, meta, is_fp8_kvcache=True,
                                                   indices=indices, backend="cute", schedule=schedule)


def rel_err(b, s_q, q, k_cache, indices, out):
    """Relative error (Frobenius) against the torch reference, or NaN above 16 queries (too slow there)."""
    if b * s_q > 16:
        return float("nan")
    ref, _ = mla_cute.flash_mla_with_kvcache(q, k_cache, None, None, 512, mla_cute.get_mla_metadata()[0],
                                             is_fp8_kvcache=True, indices=indices, backend="reference")
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def schedule_named(name: str):
    """A name of ``schedules()``, optionally with fields changed for a sweep:
    ``crossover:num_sm_parts=16``, ``default:split_fixed_cost=2``."""
    return with_fields(schedules(), name)


def run(configs, schedule_name="default"):
    schedule = schedule_named(schedule_name)
    rows = []
    for b, s_q, h_q, s_k, topk in configs:
        torch.manual_seed(b * 7 + s_q * 3 + h_q + topk)
        q, k_cache, indices = make_inputs(b, s_q, h_q, s_k, topk)
        meta, _ = mla_cute.get_mla_metadata()
        fn = sparse_call((q, k_cache, indices), schedule, meta)
        out, _ = fn()
        torch.cuda.synchronize()
        err = rel_err(b, s_q, q, k_cache, indices, out)
        warm_gpu()
        us = bench(fn, **REPS) * 1e3
        flops = 2 * b * s_q * h_q * topk * (576 + 512)
        nbytes = b * s_q * topk * 656 + 2 * b * s_q * h_q * (576 + 512)
        rows.append(dict(b=b, s_q=s_q, h_q=h_q, s_k=s_k, topk=topk, us=us, tflops=flops / us / 1e6,
                         gbps=nbytes / us / 1e3, rel_err=err, schedule=schedule_name))
        del q, k_cache, indices, out, meta
        torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--anchor", default=ANCHOR)
    ap.add_argument("--quick", action="store_true", help="three rows only")
    ap.add_argument("--schedules", default="default",
                    help="list of: " + ", ".join(schedules()) + " (',' between names; ';' when a name changes "
                    "fields: 'crossover;crossover:num_sm_parts=16')")
    ap.add_argument("--rows", default=None, help="comma list of row numbers of CONFIGS (0-based)")
    args = ap.parse_args()
    configs = pick_rows(CONFIGS, [CONFIGS[0], CONFIGS[3], CONFIGS[4]], args)
    rows = []
    for name in schedule_list(args.schedules):
        rows += run(configs, name)
    anchor = json.load(open(args.anchor)) if os.path.exists(args.anchor) else []
    print(table(rows, anchor, keys=("b", "s_q", "h_q", "s_k", "topk")))
    if args.out:
        save(args.out, rows, "0.5 s of GPU work right before each row, then the median of "
                            f"triton.testing.do_bench(warmup={REPS['warmup']}, rep={REPS['rep']}), whole call")


if __name__ == "__main__":
    sys.exit(main())
