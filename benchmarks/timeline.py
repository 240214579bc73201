"""Kernel timeline of a few decode calls (torch profiler): each kernel's duration and the gap before it.

    python benchmarks/timeline.py default,serial [--b 128 --s-q 1 --h-q 128 --s-k 4096]
    python benchmarks/timeline.py default --sparse --b 2 --s-q 2 --s-k 32768 --topk 2048
"""
import argparse
import sys

import torch
sys.path.insert(0, "benchmarks")
import mla_cute  # noqa: E402
from bench_decode import dense_decode, make_inputs, schedule_named  # noqa: E402
from flashmla_side import schedule_list  # noqa: E402
import bench_sparse  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("schedules", help="comma list of bench_decode schedule names")
ap.add_argument("--b", type=int, default=128)
ap.add_argument("--s-q", type=int, default=1)
ap.add_argument("--h-q", type=int, default=128)
ap.add_argument("--s-k", type=int, default=4096)
ap.add_argument("--sparse", action="store_true", help="sparse FP8 decode (schedules: bench_sparse names)")
ap.add_argument("--topk", type=int, default=2048)
args = ap.parse_args()
b, s_q, h_q, s_k = args.b, args.s_q, args.h_q, args.s_k
for name in schedule_list(args.schedules):
    meta, _ = mla_cute.get_mla_metadata()
    if args.sparse:
        sched = bench_sparse.schedule_named(name)
        q, k, idx = bench_sparse.make_inputs(b, s_q, h_q, s_k, args.topk)

        def fn():
            return mla_cute.flash_mla_with_kvcache(q, k, None, None, 512, meta, is_fp8_kvcache=True, indices=idx,
                                                   backend="cute", schedule=sched)
    else:
        sched = schedule_named(name)
        q, k, bt, sl = make_inputs(b, s_q, h_q, s_k)

        def fn():
            return dense_decode(sched, q, k, bt, sl, 512, meta, causal=s_q > 1, backend="cute")

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA], acc_events=True) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    evs = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    prev = None
    print(name)
    for e in evs:
        gap = e.time_range.start - prev if prev is not None else 0
        print(f"  {e.name[:60]:60s} start+{gap:8.1f}us dur {e.time_range.elapsed_us():8.1f}us")
        prev = e.time_range.end
