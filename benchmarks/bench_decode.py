"""Dense decode benchmark, by the method of the FlashMLA anchor numbers (benchmarks/results/anchor_*.json),
FlashMLA timed beside it (``flashmla_side.py``: same inputs, same process, interleaved rounds).

Fixed s_k per request, page 64, random block table, random normal bf16 q and cache,
softmax_scale 576**-0.5, causal when s_q > 1, metadata computed on the first call and
reused; after 0.5 s of GPU work, each of ``--rounds`` rounds times FlashMLA (where
``flash_mla`` imports; every call ``use_legacy=True``) and every schedule once, the order
rotated, by the median of triton.testing.do_bench(fn, warmup=20, rep=200) over the whole call
(split kernel + combine, or the split kernel alone when the plan splits no request); time =
the median over the rounds, ratio = FlashMLA's / ours.  Without ``flash_mla`` the ratio is
against the anchor file, marked "remembered, another board".
FLOPs = 2*b*s_q*h_q*s_k*(576+512); bytes = 2*(b*s_k*576 + b*s_q*h_q*(576+512)).

    python benchmarks/bench_decode.py [--out results.json] [--anchor anchors.json] [--quick] [--rows 0,6]
                                      [--schedules default,serial] [--rounds 3]
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys

import torch

import flashmla_side
import mla_cute
import mla_cute.schedules
from experiments import EXPERIMENTS

NAME = "dense"
KEYS = ("b", "s_q", "h_q", "s_k")
CONFIGS = [  # (b, s_q, h_q, s_k): the anchor's rows
    (128, 1, 128, 4096), (128, 2, 128, 4096), (128, 1, 128, 8192), (128, 2, 128, 8192),
    (128, 1, 128, 16384), (128, 1, 128, 32768), (128, 1, 64, 8192), (128, 1, 32, 8192),
    (128, 1, 16, 8192), (64, 1, 16, 16384), (128, 4, 16, 8192), (8, 1, 128, 65536),
    (1, 1, 128, 131072),
]
QUICK = CONFIGS[:1] + CONFIGS[6:7] + CONFIGS[-1:]
ANCHOR = os.path.join(os.path.dirname(__file__), "results", "anchor_flashmla_dense_h200.json")
REPS = dict(warmup=20, rep=200)  # do_bench's, as the anchor was timed


def bench(fn, warmup=REPS["warmup"], rep=REPS["rep"]):
    try:
        import triton.testing

        return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    except ImportError:  # same idea with CUDA events: ms, median of many runs
        return event_median(fn)


def event_median(fn, warmup: int = 10, runs: int = 100) -> float:
    """ms of one call: CUDA events around each of ``runs`` calls (waiting for each), after ``warmup``; the
    median.  The host's work counts where the GPU waits for it."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
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


def call(row, inputs, variant):
    """The whole dense decode call on ``make_inputs``' tensors (causal when s_q > 1), with fresh metadata."""
    q, k_cache, block_table, seqlens = inputs
    meta = mla_cute.get_mla_metadata()[0]
    args = (q, k_cache, block_table, seqlens, 512, meta)
    dense_decode(variant, *args, causal=row[1] > 1, backend="cute")  # the metadata's kernels, under the experiment
    return lambda: mla_cute.flash_mla_with_kvcache(*args, causal=row[1] > 1, backend="cute", schedule=variant.schedule)


@dataclasses.dataclass(frozen=True)
class Variant:
    """A dense schedule, and the experiment (``experiments.py``; "" for none) its calls resolve under."""

    schedule: object
    experiment: str = ""


def dense_decode(variant: Variant, *args, **kwargs):
    """``mla_cute.flash_mla_with_kvcache(*args, schedule=variant.schedule, **kwargs)`` under the variant's
    experiment (which acts where a metadata object's first call resolves its kernels)."""
    if not variant.experiment:
        return mla_cute.flash_mla_with_kvcache(*args, schedule=variant.schedule, **kwargs)
    with mla_cute.schedules.experiment(EXPERIMENTS[variant.experiment]):
        return mla_cute.flash_mla_with_kvcache(*args, schedule=variant.schedule, **kwargs)


def flash_call(fm, row, inputs):
    """FlashMLA's call (``fm``: the ``flash_mla`` package) on the same tensors."""
    q, k_cache, block_table, seqlens = inputs
    meta = fm.get_mla_metadata()[0]
    return lambda: fm.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, meta, causal=row[1] > 1,
                                             use_legacy=True)


def reference(row, inputs):
    """The torch reference's out, or None where it would take too long."""
    b, s_q, h_q, s_k = row
    if b * s_k > 128 * 8192:
        return None
    q, k_cache, block_table, seqlens = inputs
    return mla_cute.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, mla_cute.get_mla_metadata()[0],
                                           causal=s_q > 1, backend="reference")[0]


def work(b, s_q, h_q, s_k):
    """(FLOPs, bytes) of one call."""
    return 2 * b * s_q * h_q * s_k * (576 + 512), 2 * (b * s_k * 576 + b * s_q * h_q * (576 + 512))


def schedule_named(name: str) -> Variant:
    """``default`` or an experiment of ``experiments.py`` (the default schedule, its kernels rewritten),
    optionally with schedule fields changed for a sweep: ``default:split_fixed_cost=3,num_sm_parts=64``,
    ``serial:quad_multicast_tiles=0``."""
    base, _, fields = name.partition(":")
    if base != "default" and base not in EXPERIMENTS:
        raise KeyError(f"unknown dense variant {base!r}: default or one of {sorted(EXPERIMENTS)}")
    schedule = with_fields({base: mla_cute.schedules.DEFAULT_DENSE_SCHEDULE}, name)
    return Variant(schedule, "" if base == "default" else base)


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


def main():
    args = flashmla_side.parser("list of: default, " + ", ".join(EXPERIMENTS) + " (',' between names; ';' when a "
                                "name changes fields: 'default;default:split_fixed_cost=3')").parse_args()
    flashmla_side.main([sys.modules[__name__]], args)


if __name__ == "__main__":
    sys.exit(main())
