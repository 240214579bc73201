"""Dense decode on FlashMLA's own performance cases, side by side with FlashMLA's SM90 kernel (``flash_mla``, every
call ``use_legacy=True``), eager and inside a CUDA graph, plus the host time of a call.

The rows are the ``performance_cases`` of FlashMLA's dense decode test: b 128, h_q 128, one KV head, page 64,
s_q 1 and 2, s_k 4K to 32K, varlen requests (lengths drawn from N(s_k, s_k / 2), at least s_q, as its generator
draws them), causal off and on; and small batches at long context (b 1 and 8, s_k 64K to 256K, varlen), where a
request's split decides the time.  The inputs are made here as FlashMLA's generator makes them (normal / 10 clamped
to [-1, 1], a block table of distinct blocks in random order); the same tensors go to both.

Modes, timing and the host time as ``bench_sparse_cases.py`` (the host time on the b 1 rows).

    python benchmarks/bench_dense_cases.py [--rows perf,long] [--modes eager,graph,host] [--rounds 3] [--out rows.json]
        [--invariant]  (also ``enable_batch_invariant=True``, timed beside both: its cost)
"""

from __future__ import annotations

import argparse
import random
import sys

import torch

from bench_sparse_cases import measure, parse_side_by_side, timing_cells, write_rows

# (b, s_q, s_k, causal): FlashMLA's performance cases, then small batches at long context.
ROWS = {
    "perf": [(128, s_q, s_k, causal) for causal in (False, True) for s_q in (1, 2) for s_k in (4096, 8192, 16384, 32768)],
    "long": [(b, 1, s_k, False) for b in (1, 8) for s_k in (65536, 131072, 262144)],
}
H_Q, PAGE = 128, 64


def make_inputs(b: int, s_q: int, s_k: int, causal: bool, seed: int = 0) -> dict:
    random.seed(seed * 1000 + b + s_q + s_k)
    g = torch.Generator(device="cuda").manual_seed(seed * 1000 + b + s_q + s_k)
    lens = [max(int(random.normalvariate(s_k, s_k / 2)), s_q) for _ in range(b)]
    blocks = -(-max(lens) // 256) * 256 // PAGE
    table = torch.randperm(b * blocks, generator=g, device="cuda").to(torch.int32).view(b, blocks)
    cache = (torch.randn(b * blocks, PAGE, 1, 576, generator=g, device="cuda") / 10).clamp_(-1, 1).bfloat16()
    q = (torch.randn(b, s_q, H_Q, 576, generator=g, device="cuda") / 10).clamp_(-1, 1).bfloat16()
    return dict(q=q, k_cache=cache, block_table=table, causal=causal,
                cache_seqlens=torch.tensor(lens, dtype=torch.int32, device="cuda"))


def call(mod, a: dict, meta, **kw):
    """FlashMLA's dense decode call as its test makes it."""
    return mod.flash_mla_with_kvcache(a["q"], a["k_cache"], a["block_table"], a["cache_seqlens"], 512, meta, None,
                                      causal=a["causal"], **kw)


def row(fm, b: int, s_q: int, s_k: int, causal: bool, modes, rounds: int, invariant: bool = False) -> dict:
    a = make_inputs(b, s_q, s_k, causal)
    rec = dict(b=b, s_q=s_q, h_q=H_Q, s_k=s_k, causal=causal, tokens=int(a["cache_seqlens"].sum()))
    return measure(fm, a, rec, modes, rounds, b == 1, call, invariant)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="perf,long")
    args, fm, modes = parse_side_by_side(ap)
    recs = []
    print("| b | s_q | s_k | causal | eager FlashMLA / ours us (ratio) | graph FlashMLA / ours us (ratio) | host us "
          "FlashMLA / ours | out rel |\n|---|---|---|---|---|---|---|---|", flush=True)
    for group in args.rows.split(","):
        for b, s_q, s_k, causal in ROWS[group]:
            rec = row(fm, b, s_q, s_k, causal, modes, args.rounds, args.invariant)
            recs.append(rec)
            print(f"| {b} | {s_q} | {s_k} | {causal} | {timing_cells(rec)} |", flush=True)
            torch.cuda.empty_cache()
    if args.out:
        write_rows(args.out, recs, rows=__doc__.split("The rows are")[1].split("Modes")[0].strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
