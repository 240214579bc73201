"""Nsight Compute profile of one decode configuration (run on the GPU machine).

    python benchmarks/profile.py --b 128 --s-q 1 --h-q 128 --s-k 4096 [--schedule default] [--out DIR]
    python benchmarks/profile.py --sparse --b 128 --s-q 2 --h-q 128 --s-k 32768 --topk 2048

Runs ncu on the split kernel of one call (``--kernel combine``: the combine kernel) and prints duration, DRAM throughput, tensor-pipe
(GMMA) activity, long-scoreboard stalls, executed instructions, global-load sectors (and how many miss L1), the
shared-memory pipe's and banks' use, and the L2 hit rate.

``--source CSV``: instead, sample warp stalls per SASS instruction (ncu's source page) and
write them as CSV; the top instructions by samples are printed with their stall reasons.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import subprocess
import sys

METRICS = [
    "gpu__time_duration.sum",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "dram__bytes_read.sum",
    # the tensor pipe busy with HGMMA (the gmma-named cycles counter is not one of Hopper's: it read n/a)
    "sm__pipe_tensor_op_hmma_type_hmma_hgmma_qgmma_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__inst_executed_pipe_tensor_op_gmma.sum",
    "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
    "smsp__sass_inst_executed.sum",
    "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio",
    "smsp__issue_active.avg.pct_of_peak_sustained_active",
    # shared memory (the LSU's wavefronts: threads' loads, stores and barrier operations; the data banks' reads and
    # writes), the global loads that miss L1, and the L2 hit rate
    "l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed",
    "l1tex__data_bank_reads.avg.pct_of_peak_sustained_elapsed",
    "l1tex__data_bank_writes.avg.pct_of_peak_sustained_elapsed",
    "l1tex__t_sectors_pipe_lsu_mem_global_op_ld_lookup_miss.sum",
    "lts__t_sector_hit_rate.pct",
]


def workload(args):
    import torch

    sys.path.insert(0, os.path.dirname(__file__))
    import mla_cute
    from bench_decode import dense_decode, make_inputs, schedule_named

    if args.sparse:
        from bench_sparse import make_inputs as make_sparse, schedules

        q, k_cache, indices = make_sparse(args.b, args.s_q, args.h_q, args.s_k, args.topk)
        meta, _ = mla_cute.get_mla_metadata()
        for _ in range(3):
            mla_cute.flash_mla_with_kvcache(q, k_cache, None, None, 512, meta, is_fp8_kvcache=True, indices=indices,
                                            schedule=schedules()[args.schedule])
        torch.cuda.synchronize()
        return
    sched = schedule_named(args.schedule)
    q, k_cache, block_table, seqlens = make_inputs(args.b, args.s_q, args.h_q, args.s_k)
    meta, _ = mla_cute.get_mla_metadata()
    for _ in range(3):
        dense_decode(sched, q, k_cache, block_table, seqlens, 512, meta, causal=args.s_q > 1)
    torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--b", type=int, default=128)
    ap.add_argument("--s-q", type=int, default=1)
    ap.add_argument("--h-q", type=int, default=128)
    ap.add_argument("--s-k", type=int, default=4096)
    ap.add_argument("--schedule", default="default",
                    help="dense: default or an experiment (benchmarks/experiments.py), optionally with fields changed "
                    "('default:split_fixed_cost=3', as bench_decode.py takes); sparse: a name of "
                    "bench_sparse.schedules()")
    ap.add_argument("--kernel", choices=["split", "combine"], default="split")
    ap.add_argument("--sparse", action="store_true", help="profile the sparse FP8 decode kernel")
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--out", default=None, help="folder for the raw ncu csv")
    ap.add_argument("--source", default=None, help="write per-SASS-instruction stall samples to this CSV")
    ap.add_argument("--workload", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.workload:
        workload(args)
        return
    if args.kernel == "combine":
        kernel = "regex:CombineKernel"
    else:
        kernel = "regex:SparseDecodeFp8Kernel" if args.sparse else "regex:Dense(Decode|Seesaw)Kernel"
    target = [sys.executable, __file__, "--workload", "--b", str(args.b), "--s-q", str(args.s_q), "--h-q",
              str(args.h_q), "--s-k", str(args.s_k), "--schedule", args.schedule, "--topk", str(args.topk)]
    target += ["--sparse"] if args.sparse else []
    select = ["ncu", "--clock-control", "none", "-k", kernel, "--launch-skip", "2", "--launch-count", "1"]
    if args.source:
        source_page(select, target, args.source)
        return
    cmd = select + ["--metrics", ",".join(METRICS), "--csv"] + target
    proc = subprocess.run(cmd, capture_output=True, text=True)
    text = proc.stdout
    start = text.find('"ID"')
    if proc.returncode != 0 or start < 0:
        print(proc.stdout[-3000:], proc.stderr[-3000:])
        sys.exit(1)
    rows = list(csv.DictReader(io.StringIO(text[start:])))
    kind = f"sparse topk={args.topk} " if args.sparse else ""
    print(f"config {kind}b={args.b} s_q={args.s_q} h_q={args.h_q} s_k={args.s_k} schedule={args.schedule} "
          f"kernel={args.kernel}")
    for r in rows:
        print(f"  {r['Metric Name']:75s} {r['Metric Value']:>16s} {r['Metric Unit']}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        name = args.schedule.replace(":", "_").replace("=", "-").replace(",", "_")
        with open(os.path.join(args.out, f"ncu_{'sparse_' if args.sparse else ''}{name}_{args.kernel}_b{args.b}_sq{args.s_q}_h{args.h_q}_sk{args.s_k}.csv"),
                  "w") as f:
            f.write(text[start:])


def source_page(select, target, path):
    """Stall sampling per SASS instruction: profile into a report, export ncu's source page as CSV."""
    report = path + ".ncu-rep"
    proc = subprocess.run(select + ["--section", "SourceCounters", "--section", "WarpStateStats", "-f", "-o",
                                    report[: -len(".ncu-rep")]] + target, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-3000:])
        sys.exit(1)
    page = subprocess.run(["ncu", "-i", report, "--page", "source", "--print-source", "sass", "--csv"],
                          capture_output=True, text=True)
    text = page.stdout
    start = text.find('"Address"')  # after the kernel-name line
    with open(path, "w") as f:
        f.write(text[max(start, 0):])
    rows = list(csv.DictReader(io.StringIO(text[max(start, 0):])))
    if not rows:
        print(text[-3000:], page.stderr[-3000:])
        sys.exit(1)
    samples = "Warp Stall Sampling (All Samples)"
    reasons = [k for k in rows[0] if k and k.startswith("stall_") and "Not Issued" not in k]

    def count(r, key=samples):
        try:
            return float(r.get(key) or 0)
        except ValueError:
            return 0.0

    total = sum(count(r) for r in rows) or 1.0
    by_reason = sorted(((sum(count(r, k) for r in rows), k) for k in reasons), reverse=True)
    print("stall reasons, % of samples: " + ", ".join(f"{k[6:]} {100 * v / total:.1f}" for v, k in by_reason[:8]))
    for r in sorted(rows, key=count, reverse=True)[:40]:
        top = max(reasons, key=lambda k: count(r, k)) if reasons else ""
        print(f"{100 * count(r) / total:5.1f}%  {r.get('Address', '')[-6:]}  {top[6:]:12s} {r.get('Source', '')[:80]}")


if __name__ == "__main__":
    main()
