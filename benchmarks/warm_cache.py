"""Fill the disk compile cache for the benchmarks' configurations (runs on a CPU: compiles for sm_90a).

    CUTE_DSL_ARCH=sm_90a MLA_CUTE_CACHE_DIR=DIR python benchmarks/warm_cache.py [--jobs 2]

Every kernel ``mla_cute.precompile`` builds for the dense rows of ``bench_decode.py`` (their s_q and h_q, h_kv = 1,
bf16, causal when s_q > 1) and the sparse rows of ``bench_sparse.py``, one configuration a process.  A GPU
machine given DIR (same DSL version and sources) then loads every kernel instead of compiling it.  (The GPU
tests compile what they need in parallel processes: ``tests/shards.py``.)
"""

from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ProcessPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(__file__))


def configs() -> list[dict]:
    import bench_decode
    import bench_sparse

    dense = sorted({(s_q, h_q) for _, s_q, h_q, _ in bench_decode.CONFIGS})
    sparse = sorted({(s_q, h_q) for _, s_q, h_q, _, _ in bench_sparse.CONFIGS})
    return ([dict(dtype=torch.bfloat16, s_q=s_q, h_q=h_q, h_kv=1, causal=s_q > 1) for s_q, h_q in dense]
            + [dict(sparse=True, s_q=s_q, h_q=h_q) for s_q, h_q in sparse])


def _one(cfg: dict) -> dict:
    import mla_cute

    mla_cute.precompile([cfg])
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    todo = configs()
    print(f"{len(todo)} configurations", flush=True)
    with ProcessPoolExecutor(args.jobs) as pool:
        for i, cfg in enumerate(pool.map(_one, todo)):
            print(f"{i + 1}/{len(todo)} {cfg}", flush=True)


if __name__ == "__main__":
    main()
