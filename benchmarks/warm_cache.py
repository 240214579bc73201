"""Fill the disk compile cache for the GPU tests and benchmarks (runs on a CPU: compiles for sm_90a).

    CUTE_DSL_ARCH=sm_90a MLA_CUTE_CACHE_DIR=DIR python benchmarks/warm_cache.py [--jobs 2]

A GPU machine given DIR (same DSL version and sources) then loads every kernel instead of
compiling it.
"""

from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ProcessPoolExecutor

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def configs(subset: str):
    import dataclasses
    import random

    from mla_cute.schedules import (DEFAULT_DENSE_SCHEDULE, PREFETCH_DENSE_SCHEDULE, SEESAW_DENSE_SCHEDULE,
                                    SERIAL_DENSE_SCHEDULE)

    seen = set()
    import test_dense_decode_gpu as grid
    from bench_decode import CONFIGS

    if subset == "schedules":  # the tile-position test and the benchmark rows, serial and seesaw
        for sched in (SERIAL_DENSE_SCHEDULE, SEESAW_DENSE_SCHEDULE):
            for dtype, s_q, h_q, h_kv, causal in grid.SCHEDULE_CASES:
                seen.add((dtype, s_q, h_q, h_kv, causal and s_q > 1, 64, sched))
            for b, s_q, h_q, s_k in CONFIGS:
                seen.add((torch.bfloat16, s_q, h_q, 1, s_q > 1, 64, sched))
        return sorted(seen, key=repr)

    if subset in ("all", "grid"):
        for b, s_q, s_k, h_q, h_kv, varlen, causal in grid.GRID:
            seen.add((torch.bfloat16, s_q, h_q, h_kv, causal and s_q > 1, 64, DEFAULT_DENSE_SCHEDULE))
        if subset == "grid":
            return sorted(seen, key=repr)
    for seed in range(12):  # test_fuzz draws its configuration the same way
        rng = random.Random(seed)
        h_kv = rng.choice([1, 1, 1, 2, 4])
        h_q = h_kv * rng.choice([1, 5, 16, 32, 64, 100, 128])
        s_q = rng.choice([1, 1, 2, 3])
        b = rng.randint(1, 40)
        [rng.choice([0, rng.randint(1, 70), rng.randint(1, 5000)]) for _ in range(b)]
        dtype = rng.choice([torch.bfloat16, torch.float16])
        causal = rng.random() < 0.5
        seen.add((dtype, s_q, h_q, h_kv, causal and s_q > 1, 64, DEFAULT_DENSE_SCHEDULE))
    seen.add((torch.bfloat16, 2, 128, 1, True, 64, PREFETCH_DENSE_SCHEDULE))  # runtime tests
    seen.add((torch.bfloat16, 1, 128, 1, False, 64, DEFAULT_DENSE_SCHEDULE))
    seen.add((torch.bfloat16, 2, 64, 1, True, 64, DEFAULT_DENSE_SCHEDULE))
    for dtype in (torch.bfloat16, torch.float16):  # corner tests
        seen.add((dtype, 2, 128, 1, True, 64, DEFAULT_DENSE_SCHEDULE))
    seen.add((torch.bfloat16, 1, 128, 1, False, 128, DEFAULT_DENSE_SCHEDULE))
    seen.add((torch.bfloat16, 1, 64, 1, False, 128, DEFAULT_DENSE_SCHEDULE))
    seen.add((torch.bfloat16, 1, 64, 1, False, 256, DEFAULT_DENSE_SCHEDULE))
    seen.add((torch.bfloat16, 1, 128, 1, False, 64, PREFETCH_DENSE_SCHEDULE))
    for chunked_batch in (0, 64):  # the combine test
        sched = dataclasses.replace(DEFAULT_DENSE_SCHEDULE, num_sm_parts=132, combine_chunked_batch=chunked_batch)
        seen.add((torch.bfloat16, 3, 5, 1, True, 64, sched))
        seen.add((torch.bfloat16, 1, 128, 1, False, 64, sched))
    named = grid._schedules()  # the tile-position tests: every schedule they name, and tile multicast forced on
    for name in grid.TILE_POSITION_SCHEDULES:
        for dtype, s_q, h_q, h_kv, causal in grid.SCHEDULE_CASES:
            seen.add((dtype, s_q, h_q, h_kv, causal and s_q > 1, 64, named[name]))
    for s_q, causal in ((1, False), (2, True)):  # two multicast pairs a KV head, the default schedule
        seen.add((torch.bfloat16, s_q, 256, 1, causal, 64, DEFAULT_DENSE_SCHEDULE))
    for dtype, s_q, h_q, h_kv, causal in grid.MULTICAST_CASES:
        for name in ("seesaw_multicast", "seesaw_no_loader_multicast"):
            seen.add((dtype, s_q, h_q, h_kv, causal and s_q > 1, 64, named[name]))
    for b, s_q, h_q, s_k in (CONFIGS if subset == "all" else []):
        for sched in (DEFAULT_DENSE_SCHEDULE, SERIAL_DENSE_SCHEDULE):
            seen.add((torch.bfloat16, s_q, h_q, 1, s_q > 1, 64, sched))
    return sorted(seen, key=repr)


def sparse_configs():
    """(s_q, h_q, attn_sink) of the sparse GPU tests and benchmark, as precompile dicts."""
    import test_sparse_decode_gpu as sparse

    seen = {(s_q, h_q, False) for _, s_q, h_q, *_ in sparse.GRID}
    seen |= {(2, h, False) for h in (16, 32, 256)} | {(2, 128, True), (1, 64, True), (2, 64, False), (1, 64, False)}
    seen |= {(2, 128, False), (1, 128, False)}  # benchmark rows
    from mla_cute.schedules import SparseDecodeSchedule

    whole = SparseDecodeSchedule(crossover=False)  # what the tests run unless they ask for the crossover
    out = [dict(sparse=True, s_q=s_q, h_q=h_q, attn_sink=sink, schedule=whole) for s_q, h_q, sink in sorted(seen)]
    paired = {(s_q, 128, False) for s_q in (1, 2, 3)} | {(2, 128, True), (1, 128, True), (2, 256, False)}
    paired |= {(2, 64, False)}  # the benchmark's default-schedule rows (the crossover does not pair h_q = 64)
    out += [dict(sparse=True, s_q=s_q, h_q=h_q, attn_sink=sink, schedule=SparseDecodeSchedule(crossover=True))
            for s_q, h_q, sink in sorted(paired)]
    # The other consumer split, hand-over and producer split: the crossover corners and the benchmark's schedules,
    # and the serial consumer's whole-tile grid test.
    corners = {(2, 128, True), (1, 128, True), (2, 128, False), (1, 128, False), (2, 256, False), (2, 64, False)}
    for lf, bulk, fp16, halves in ((False, True, True, False), (True, False, True, False), (False, False, True, False),
                                   (True, True, False, False), (False, True, False, False), (True, True, True, False),
                                   (True, True, True, True), (True, True, False, True)):
        other = SparseDecodeSchedule(crossover=True, leader_follower=lf, peer_bulk_copy=bulk, fp16_operands=fp16,
                                     producer_halves=halves)
        out += [dict(sparse=True, s_q=s_q, h_q=h_q, attn_sink=sink, schedule=other) for s_q, h_q, sink in sorted(corners)]
    serial_whole = SparseDecodeSchedule(crossover=False, leader_follower=False)
    out += [dict(sparse=True, s_q=3, h_q=h_q, attn_sink=sink, schedule=serial_whole)
            for h_q in (64, 128) for sink in (False, True)]
    # The tests that pass topk_length pass a sink too; the kernel that reads the lengths.
    out += [dict(cfg, topk_length=True) for cfg in out if cfg["attn_sink"]]
    return out


def _one(cfg):
    import mla_cute

    if isinstance(cfg, dict):
        mla_cute.precompile([cfg])
        return tuple(v for k, v in cfg.items() if k != "schedule") + (cfg.get("schedule"),)
    dtype, s_q, h_q, h_kv, causal, page, sched = cfg
    mla_cute.precompile([dict(dtype=dtype, s_q=s_q, h_q=h_q, h_kv=h_kv, causal=causal, page_block_size=page,
                              schedule=sched)])
    return cfg


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--subset", choices=["all", "corner", "sparse", "schedules", "grid"], default="all",
                    help="corner: skip the parametrized grid (corner, fuzz and runtime tests, benchmarks); "
                         "sparse: only the sparse decode kernels; schedules: the dense tile-position test "
                         "and benchmark rows under the serial and seesaw schedules; grid: the dense grid test")
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(__file__))
    todo = [] if args.subset == "sparse" else configs(args.subset)
    if args.subset not in ("schedules", "grid"):
        todo += sparse_configs()
    print(f"{len(todo)} configurations", flush=True)
    with ProcessPoolExecutor(args.jobs) as pool:
        for i, cfg in enumerate(pool.map(_one, todo)):
            print(f"{i + 1}/{len(todo)} {cfg[:6]}", flush=True)


if __name__ == "__main__":
    main()
