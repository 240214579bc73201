"""``python -m mla_cute.precompile``: build the kernels of named shape sets into the disk cache, in parallel
processes, for an engine to run at build or start time (``mla_cute.precompile`` over each configuration).

    python -m mla_cute.precompile --sets deepseek-v32-sparse,deepseek-v3-dense [--jobs 8] [--dry-run]
    python -m mla_cute.precompile --list

Each configuration is one ``mla_cute.precompile`` entry (every kernel a call of it can resolve to); ``--jobs N``
builds N configurations at once, each in its own process (the DSL compiles on one core), so a set costs about
its configurations' compile time over N.  Needs no GPU: without one the kernels are built for sm_90a.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import multiprocessing
import os
import sys
import time

import torch

HEADS = (16, 32, 64, 128)  # DeepSeek's 128 heads and what tensor parallelism leaves of them
QUERIES = (1, 2, 3, 4)  # one token a step, and multi-token prediction's


def _dense(dtypes=(torch.bfloat16, torch.float16)) -> list:
    return [dict(dtype=dtype, s_q=s_q, h_q=h_q, h_kv=1, causal=s_q > 1, page_block_size=64)
            for dtype in dtypes for s_q in QUERIES for h_q in HEADS]


def _sparse(kv_format: str, extra_cache=False) -> list:
    """With and without topk_length; with an extra cache the kernels read lengths whichever a call passes."""
    lengths = (True,) if extra_cache else (False, True)
    return [dict(sparse=True, s_q=s_q, h_q=h_q, kv_format=kv_format, topk_length=given, extra_cache=extra_cache)
            for s_q in QUERIES for h_q in HEADS for given in lengths]


# The named sets: DeepSeek V3 (dense decode over the bf16/fp16 cache), V3.2 (sparse decode over the 656-byte
# cache, with and without topk_length), V4 (its 584-byte cache with the sliding-window extra cache) and V4.1 (its
# 528-byte cache with the FP4 extra cache); the sparse sets with their formats' cache writers.
def _writers(kv_format: str) -> list:
    """The cache writer of the format for bf16 rows, with int32 and int64 slots."""
    return [dict(write_cache=True, kv_format=kv_format, dtype=torch.bfloat16, slot_dtype=slots)
            for slots in (torch.int32, torch.int64)]


SETS = {
    "deepseek-v3-dense": _dense(),
    "deepseek-v32-sparse": _sparse("V32") + _writers("V32"),
    "deepseek-v4-sparse": _sparse("V4", extra_cache=True) + _writers("V4"),
    "deepseek-v41-sparse": _sparse("V41", extra_cache="V41_FP4") + _writers("V41") + _writers("V41_FP4"),
}


def describe(cfg: dict) -> str:
    return ", ".join(f"{k}={str(v).replace('torch.', '')}" for k, v in cfg.items())


def _build(cfg: dict) -> float:
    """One configuration in this process; its seconds."""
    import mla_cute

    t0 = time.perf_counter()
    mla_cute.precompile([cfg])
    return time.perf_counter() - t0


def run(configs: list, jobs: int, build=_build, out=sys.stdout) -> float:
    """Build ``configs`` with ``jobs`` processes (1: in this one), printing a line per configuration done;
    returns the wall seconds."""
    t0 = time.perf_counter()
    if jobs <= 1:
        for i, cfg in enumerate(configs):
            print(f"[{i + 1}/{len(configs)}] {describe(cfg)}: {build(cfg):.1f} s", file=out, flush=True)
        return time.perf_counter() - t0
    context = multiprocessing.get_context("spawn")  # no forked CUDA or DSL state
    # Each process builds its configuration's kernels one after another (the jobs are the parallelism).
    with _environment(MLA_CUTE_COMPILE_JOBS="1"), \
            concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
        futures = {pool.submit(build, cfg): cfg for cfg in configs}
        for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
            print(f"[{done}/{len(configs)}] {describe(futures[future])}: {future.result():.1f} s", file=out,
                  flush=True)
    return time.perf_counter() - t0


@contextlib.contextmanager
def _environment(**values):
    """``values`` in os.environ while the block runs (spawned processes inherit them)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mla_cute.precompile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", default="", help="comma list of: " + ", ".join(SETS))
    ap.add_argument("--jobs", type=int, default=1, help="configurations built at once, one process each")
    ap.add_argument("--list", action="store_true", help="the sets and their configurations' counts")
    ap.add_argument("--dry-run", action="store_true", help="print the configurations, build nothing")
    args = ap.parse_args(argv)
    if args.list:
        for name, configs in SETS.items():
            print(f"{name}: {len(configs)} configurations")
        return 0
    names = [n for n in args.sets.split(",") if n]
    unknown = [n for n in names if n not in SETS]
    if not names or unknown:
        ap.error(f"--sets: name one or more of {', '.join(SETS)}" + (f" (unknown: {', '.join(unknown)})"
                                                                   if unknown else ""))
    if args.jobs < 1:
        ap.error("--jobs must be >= 1")
    configs = [cfg for name in names for cfg in SETS[name]]
    if args.dry_run:
        for cfg in configs:
            print(describe(cfg))
        return 0
    wall = run(configs, args.jobs)
    import mla_cute

    info = mla_cute.cache_info()
    print(f"{len(configs)} configurations in {wall:.0f} s; {len(info['disk'])} kernels warm in {info['directory']}")
    return 0
