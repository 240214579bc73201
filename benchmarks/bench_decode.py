"""Dense decode benchmark, by the method of the FlashMLA anchor numbers (benchmarks/results/anchor_*.json).

Fixed s_k per request, page 64, random block table, random normal bf16 q and cache,
softmax_scale 576**-0.5, causal when s_q > 1, metadata computed on the first call and
reused; after 0.5 s of GPU work, time = median of triton.testing.do_bench(fn, warmup=20,
rep=200) over the whole call (split kernel + combine, or the split kernel alone when the plan
splits no request).  FLOPs = 2*b*s_q*h_q*s_k*(576+512);
bytes = 2*(b*s_k*576 + b*s_q*h_q*(576+512)).

    python benchmarks/bench_decode.py [--out results.json] [--anchor anchors.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys

import torch

import mla_cute

CONFIGS = [  # (b, s_q, h_q, s_k): the anchor's rows
    (128, 1, 128, 4096), (128, 2, 128, 4096), (128, 1, 128, 8192), (128, 2, 128, 8192),
    (128, 1, 128, 16384), (128, 1, 128, 32768), (128, 1, 64, 8192), (128, 1, 32, 8192),
    (128, 1, 16, 8192), (64, 1, 16, 16384), (128, 4, 16, 8192), (8, 1, 128, 65536),
    (1, 1, 128, 131072),
]
ANCHOR = os.path.join(os.path.dirname(__file__), "results", "anchor_flashmla_dense_h200.json")
REPS = dict(warmup=20, rep=200)  # do_bench's, as the anchor was timed


def bench(fn, warmup=REPS["warmup"], rep=REPS["rep"]):
    try:
        import triton.testing

        return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    except ImportError:  # same idea with CUDA events: ms, median of many runs
        for _ in range(10):
            fn()
        times = []
        for _ in range(100):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        return statistics.median(times)


def warm_gpu(seconds: float = 0.5) -> None:
    """Keep the GPU busy for a while right before a row is timed.  The row's first call may load
    its kernels from disk (the GPU idles meanwhile), and a short row timed right after read up to
    1.8x slower than the same row timed later (the sparse b = 2 row: 25 us, or 34-56 us as the
    first row of a process)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    while True:
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
        stop.record()
        stop.synchronize()
        if start.elapsed_time(stop) >= seconds * 1e3:
            return


def make_inputs(b, s_q, h_q, s_k, dtype=torch.bfloat16, page=64, device="cuda"):
    blocks = (s_k + page - 1) // page
    block_table = torch.randperm(b * blocks, device=device, dtype=torch.int32).view(b, blocks)
    k_cache = torch.randn(b * blocks, page, 1, 576, device=device, dtype=dtype)
    q = torch.randn(b, s_q, h_q, 576, device=device, dtype=dtype)
    seqlens = torch.full((b,), s_k, device=device, dtype=torch.int32)
    return q, k_cache, block_table, seqlens


def decode_call(inputs, s_q, schedule, meta):
    """The whole dense decode call on ``make_inputs``' tensors (causal when s_q > 1)."""
    q, k_cache, block_table, seqlens = inputs
    return lambda: mla_cute.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, meta, causal=s_q > 1,
                                                   backend="cute", schedule=schedule)


def rel_err(b, s_q, h_q, s_k, q, k_cache, block_table, seqlens, out):
    if b * s_k > 128 * 8192:  # the reference would take too long
        return float("nan")
    ref, _ = mla_cute.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, mla_cute.get_mla_metadata()[0],
                                             causal=s_q > 1, backend="reference")
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def schedule_named(name: str):
    """default, serial, prefetch or seesaw, optionally with fields changed for a sweep:
    ``seesaw:kv_evict_first=False``, ``default:split_fixed_cost=3,num_sm_parts=64``."""
    from mla_cute.schedules import (DEFAULT_DENSE_SCHEDULE, PREFETCH_DENSE_SCHEDULE, SEESAW_DENSE_SCHEDULE,
                                    SERIAL_DENSE_SCHEDULE)

    return with_fields({"default": DEFAULT_DENSE_SCHEDULE, "serial": SERIAL_DENSE_SCHEDULE,
                        "prefetch": PREFETCH_DENSE_SCHEDULE, "seesaw": SEESAW_DENSE_SCHEDULE}, name)


def with_fields(named: dict, name: str):
    """``named[base]`` for ``name`` = ``base`` or ``base:field=value,field=value`` (a schedule with those
    fields changed; values are Python literals)."""
    import ast
    import dataclasses

    base, _, fields = name.partition(":")
    sched = named[base]
    if fields:
        changes = dict(f.split("=", 1) for f in fields.split(","))
        sched = dataclasses.replace(sched, **{k: ast.literal_eval(v) for k, v in changes.items()})
    return sched


def schedule_list(text: str) -> list:
    """The names of ``--schedules``: ',' between names, ';' once a name changes fields (which use ',')."""
    return text.split(";" if ";" in text or ":" in text else ",")


def pick_rows(configs: list, quick: list, args) -> list:
    """The rows ``--rows`` (numbers into ``configs``) or ``--quick`` select; all by default."""
    if args.rows:
        return [configs[int(i)] for i in args.rows.split(",")]
    return quick if args.quick else configs


def run(configs, schedule_name="default"):
    schedule = schedule_named(schedule_name)
    rows = []
    for b, s_q, h_q, s_k in configs:
        torch.manual_seed(b * 7 + s_q * 3 + h_q + s_k)
        q, k_cache, block_table, seqlens = make_inputs(b, s_q, h_q, s_k)
        meta, _ = mla_cute.get_mla_metadata()
        fn = decode_call((q, k_cache, block_table, seqlens), s_q, schedule, meta)
        out, _ = fn()
        torch.cuda.synchronize()
        err = rel_err(b, s_q, h_q, s_k, q, k_cache, block_table, seqlens, out) if schedule_name in (
            "default", "seesaw") else float("nan")
        warm_gpu()
        ms = bench(fn, **REPS)
        us = ms * 1e3
        flops = 2 * b * s_q * h_q * s_k * (576 + 512)
        nbytes = 2 * (b * s_k * 576 + b * s_q * h_q * (576 + 512))
        rows.append(dict(b=b, s_q=s_q, h_q=h_q, s_k=s_k, us=us, tflops=flops / us / 1e6, gbps=nbytes / us / 1e3,
                         rel_err=err, schedule=schedule_name))
        del q, k_cache, block_table, seqlens, out, meta
        torch.cuda.empty_cache()
    return rows


def table(rows, anchor, keys=("b", "s_q", "h_q", "s_k")):
    """Markdown table of ``rows`` against the anchor rows with the same ``keys``; sets each row's
    ``anchor_us`` and ``ratio`` (anchor time / ours)."""
    ref = {tuple(r[k] for k in keys): r for r in anchor}
    head = ["schedule", *keys, "us", "TFLOP/s", "GB/s", "rel_err", "FlashMLA us", "ratio"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        a = ref.get(tuple(r[k] for k in keys))
        r["anchor_us"] = a["us"] if a else None
        r["ratio"] = a["us"] / r["us"] if a else float("nan")
        cells = [r["schedule"], *(str(r[k]) for k in keys), f"{r['us']:.1f}", f"{r['tflops']:.0f}", f"{r['gbps']:.0f}",
                 f"{r['rel_err']:.2e}", f"{a['us'] if a else float('nan'):.1f}", f"{r['ratio']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def save(path, rows, method: str) -> None:
    """The rows as JSON, with the device, versions and timing method."""
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, python=platform.python_version(),
                method=method)
    with open(path, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--anchor", default=ANCHOR)
    ap.add_argument("--quick", action="store_true", help="three rows only")
    ap.add_argument("--rows", default=None, help="comma list of row numbers of CONFIGS (0-based)")
    ap.add_argument("--schedules", default="default",
                    help="list of: default, serial, prefetch, seesaw (',' between names; ';' when a name "
                    "changes fields: 'seesaw;seesaw:kv_evict_first=False')")
    args = ap.parse_args()
    configs = pick_rows(CONFIGS, CONFIGS[:1] + CONFIGS[6:7] + CONFIGS[-1:], args)
    rows = []
    for name in schedule_list(args.schedules):
        rows += run(configs, name)
    anchor = json.load(open(args.anchor)) if os.path.exists(args.anchor) else []
    print(table(rows, anchor))
    if args.out:
        save(args.out, rows, "0.5 s of GPU work right before each row, then the median of "
                            f"triton.testing.do_bench(warmup={REPS['warmup']}, rep={REPS['rep']}), whole call")


if __name__ == "__main__":
    sys.exit(main())
