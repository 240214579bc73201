"""Host time per call of flash_mla_with_kvcache (Python + launch), metadata reused.

b=128, h_q=128, s_q=1 (the decode shape of the target), short cache (256 tokens) so the GPU
keeps up.  Each call is timed alone with perf_counter (no synchronisation inside the timed
region; the queue is drained every 25 calls outside it); median and p90 of 2000 calls.

Rows: the API as users call it (later calls replay the checked plan), the API with every
check on every call (the first call's path), and its pieces: input validation, the output
allocations, the compiled split+combine entry called directly, and two one-launch entries
(the combine alone, the scheduler) that show what one launch and its tensors cost.  Where ``flash_mla``
imports, FlashMLA's call on the same tensors (``use_legacy=True``, metadata reused) too, and ``ratio`` =
its median / the API's.

    python benchmarks/bench_host_overhead.py [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import mla_cute
from flashmla_side import flash_mla
from mla_cute import validation as V


def timeit(fn, n=2000, drain=25):
    times = []
    for i in range(n):
        if i % drain == 0:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    times.sort()
    return dict(median_us=statistics.median(times) * 1e6, p90_us=times[int(0.9 * len(times))] * 1e6)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    b, s_q, h_q, s_k, page = 128, 1, 128, 256, 64
    torch.manual_seed(0)
    blocks = s_k // page
    q = torch.randn(b, s_q, h_q, 576, device="cuda", dtype=torch.bfloat16)
    k_cache = torch.randn(b * blocks, page, 1, 576, device="cuda", dtype=torch.bfloat16)
    block_table = torch.randperm(b * blocks, device="cuda", dtype=torch.int32).view(b, blocks)
    seqlens = torch.full((b,), s_k, device="cuda", dtype=torch.int32)
    meta, _ = mla_cute.get_mla_metadata()

    def api():
        return mla_cute.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, meta)

    api()
    torch.cuda.synchronize()
    plan = meta._state["dense"]
    from mla_cute.backends.cute import query_rows

    rows_q = query_rows(q, 1)
    out = torch.empty(b, s_q, h_q, 512, dtype=q.dtype, device="cuda")
    lse = torch.empty(b, h_q, s_q, dtype=torch.float32, device="cuda")

    def raw():
        plan.step(rows_q, k_cache, block_table, seqlens, meta.tile_scheduler_metadata, meta.num_splits, out, lse,
                  plan.o_accum, plan.lse_accum, 0.06)

    def api_full_checks():
        meta._replay = None  # the next call takes the checked path (and sets it again)
        return api()

    from mla_cute.kernels.build import compile_combine, compile_scheduler

    combine = compile_combine(plan.config.step.combine, h_kv=plan.h_kv)
    scheduler = compile_scheduler(plan.config.scheduler)
    sched, splits = meta.tile_scheduler_metadata, meta.num_splits
    sched_copy, splits_copy = sched.clone(), splits.clone()

    def combine_only():
        combine(splits, plan.o_accum, plan.lse_accum, out, lse, None)

    def scheduler_only():
        scheduler(seqlens, None, sched_copy, splits_copy, block_table.shape[1] * k_cache.shape[1], 0)

    def one_alloc():
        torch.empty(b, s_q, h_q, 512, dtype=q.dtype, device="cuda")

    def validate():
        V.check_dense(q, k_cache, block_table, seqlens, 512, False)

    def alloc():
        torch.empty(b, s_q, h_q, 512, dtype=q.dtype, device="cuda")
        torch.empty(b, h_q, s_q, dtype=torch.float32, device="cuda")

    # GPU time of one call, to show the host is not waiting on the device here.
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(100):
        api()
    e.record()
    e.synchronize()
    rows = dict(config=dict(b=b, s_q=s_q, h_q=h_q, s_k=s_k, page=page), gpu_us_per_call=s.elapsed_time(e) * 10,
                api=timeit(api), api_full_checks=timeit(api_full_checks), compiled_entry=timeit(raw),
                combine_entry=timeit(combine_only), scheduler_entry=timeit(scheduler_only),
                validation=timeit(validate), output_alloc=timeit(alloc), one_alloc=timeit(one_alloc))
    fm = flash_mla()
    if fm is not None:  # FlashMLA's call on the same tensors (use_legacy=True), its metadata reused as well
        flash_meta = fm.get_mla_metadata()[0]

        def flashmla_api():
            return fm.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, flash_meta, use_legacy=True)

        flashmla_api()
        rows["flashmla_api"] = timeit(flashmla_api)
        rows["ratio"] = rows["flashmla_api"]["median_us"] / rows["api"]["median_us"]
    else:
        rows["flashmla_api"] = "flash_mla does not import"
    for k, v in rows.items():
        print(f"{k:16s} {v}")
    if args.out:
        json.dump(rows, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
