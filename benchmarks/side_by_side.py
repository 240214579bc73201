"""mla-cute beside FlashMLA's SM90 kernels (the ``flash_mla`` package, every call ``use_legacy=True``), on the
same inputs, in one process, interleaved: the speed ratios this project reports.

    python benchmarks/side_by_side.py [--kind dense|sparse|all] [--rows 0,3] [--rounds 5]
                                      [--schedules "default;default:partials_16bit=False"] [--out rows.json]

Rows are those of ``bench_decode.py`` (dense) and ``bench_sparse.py`` (sparse FP8 decode), their inputs and
timing (0.5 s of GPU work first, then the median of do_bench over the whole call, metadata reused).  Each
round times FlashMLA and every mla-cute schedule once, the order rotated from round to round; a row reports
each one's median over the rounds and ``ratio`` = FlashMLA's median / ours (above 1: mla-cute faster).  The
first round also compares every output with FlashMLA's (relative Frobenius error).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

import mla_cute

sys.path.insert(0, os.path.dirname(__file__))

import bench_decode  # noqa: E402
import bench_sparse  # noqa: E402


def _flash_dense(inputs, s_q):
    import flash_mla

    q, k_cache, block_table, seqlens = inputs
    meta = flash_mla.get_mla_metadata()[0]
    return lambda: flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, meta, causal=s_q > 1,
                                                    use_legacy=True)


def _flash_sparse(inputs):
    import flash_mla

    q, k_cache, indices = inputs
    meta = flash_mla.get_mla_metadata()[0]
    return lambda: flash_mla.flash_mla_with_kvcache(q, k_cache, None, None, 512, meta, is_fp8_kvcache=True,
                                                    indices=indices, use_legacy=True)


def calls(kind: str, row: tuple, schedules: dict) -> dict:
    """name -> the whole call on one set of inputs: "flashmla" and each of ``schedules``."""
    torch.manual_seed(hash(row) % 2**31)
    if kind == "dense":
        b, s_q, h_q, s_k = row
        inputs = bench_decode.make_inputs(b, s_q, h_q, s_k)
        fns = {"flashmla": _flash_dense(inputs, s_q)}
        for name, sched in schedules.items():
            fns[name] = bench_decode.decode_call(inputs, s_q, sched, mla_cute.get_mla_metadata()[0])
    else:
        inputs = bench_sparse.make_inputs(*row)
        fns = {"flashmla": _flash_sparse(inputs)}
        for name, sched in schedules.items():
            fns[name] = bench_sparse.sparse_call(inputs, sched, mla_cute.get_mla_metadata()[0])
    return fns


def rel_to(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref.float()).norm() / ref.float().norm())


def run_row(kind: str, row: tuple, schedules: dict, rounds: int, reps: dict) -> dict:
    fns = calls(kind, row, schedules)
    outs = {name: fn()[0] for name, fn in fns.items()}
    torch.cuda.synchronize()
    errors = {name: rel_to(out, outs["flashmla"]) for name, out in outs.items() if name != "flashmla"}
    assert all(not torch.isnan(out).any() for out in outs.values()), f"{row}: NaN in an output"
    del outs
    if rounds == 0:  # compiled and checked only (e.g. to fill the disk cache)
        return dict(kind=kind, row=list(row), rel_err_vs_flashmla=errors)
    bench_decode.warm_gpu()
    times = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            times[name].append(bench_decode.bench(fns[name], **reps) * 1e3)
    us = {name: statistics.median(t) for name, t in times.items()}
    return dict(kind=kind, row=list(row), us=us, rounds=times, rel_err_vs_flashmla=errors,
                ratio={name: us["flashmla"] / us[name] for name in schedules})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", choices=["dense", "sparse", "all"], default="all")
    ap.add_argument("--rows", default=None, help="comma list of row numbers (0-based, of the kind's rows)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--schedules", default="default", help="mla-cute schedules, as bench_decode/bench_sparse name them")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    kinds = ["dense", "sparse"] if args.kind == "all" else [args.kind]
    results = []
    for kind in kinds:
        bench = bench_decode if kind == "dense" else bench_sparse
        configs = bench.CONFIGS if not args.rows else [bench.CONFIGS[int(i)] for i in args.rows.split(",")]
        schedules = {name: bench.schedule_named(name) for name in bench_decode.schedule_list(args.schedules)}
        for row in configs:
            res = run_row(kind, tuple(row), schedules, args.rounds, bench.REPS)
            results.append(res)
            if "us" not in res:
                print(f"{kind} {tuple(row)}: rel_err {max(res['rel_err_vs_flashmla'].values()):.1e}", flush=True)
                continue
            cells = " ".join(f"{n} {res['us'][n]:.1f} us ({res['ratio'][n]:.3f}x)" for n in schedules)
            print(f"{kind} {tuple(row)}: flashmla {res['us']['flashmla']:.1f} us | {cells} | "
                  f"rel_err {max(res['rel_err_vs_flashmla'].values()):.1e}", flush=True)
            torch.cuda.empty_cache()
    if args.out:
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, method=__doc__.strip().splitlines()[0])
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=results), f, indent=1)


if __name__ == "__main__":
    main()
