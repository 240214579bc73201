"""Sparse decode on FlashMLA's own performance cases, side by side with FlashMLA's SM90 kernel (``flash_mla``, every
call ``use_legacy=True``), eager and inside a CUDA graph, plus the host time of a call.

The rows are the ``performance_cases`` of FlashMLA's sparse decode test: DeepSeek V3.2 (h_q 128, s_q 2, topk 2048,
the 656-byte cache on page 64, b 2 / 64 / 74 / 128), DeepSeek V4's four production configurations (d_qk 512, the
584-byte cache: topk 128 on a page-256 cache plus an extra window cache of topk 512 or 1024 on page 64 or page 2,
with or without ``extra_topk_length``; h_q 64 / 128; b 2 to 256) and the peak cases (b 148, topk 16384, d_qk 512
and 576, h_q 64 / 128).  Every row has s_q 2, an ``attn_sink`` (random, some heads +inf or -inf) and varlen
requests (lengths drawn around s_k, at least s_q), as there.

The inputs are made here: random bf16 rows quantized by ``mla_cute.quantize_kv_cache`` (the bytes FlashMLA's
quantizer writes), each request's blocks placed at random, topk distinct random tokens per query out of its
length; the same tensors go to both.  Outputs are compared first (relative Frobenius error of out over the finite
entries, max |lse difference|).

Modes:
  eager  the whole call with metadata reused (as FlashMLA's test and an engine without graphs call it): after 0.5 s
         of GPU work, ``--rounds`` rounds each time FlashMLA and ours once (order rotated) by the median of
         triton.testing.do_bench(warmup=10, rep=50); us = the median over the rounds.
  graph  the call captured in a CUDA graph with its metadata made inside the capture (the scheduler kernel is in
         the graph, as an engine captures a step), replays timed the same way.
  host   CPU time of the calling thread (time.thread_time) per call over 1000 back-to-back eager calls on the
         b = 2 rows, in 5 blocks of 200 (the GPU drained before each), the median block's; FlashMLA's and ours.

    python benchmarks/bench_sparse_cases.py [--configs V32,CONFIG1,...,PEAK] [--batches 2,64] [--modes eager,graph,host]
                                           [--rounds 3] [--out rows.json] [--invariant]
(``--invariant``: our call with ``enable_batch_invariant=True`` timed beside both, its cells last.)
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time

import torch

import flashmla_side
import mla_cute
from bench_decode import bench, warm_gpu

REPS = dict(warmup=10, rep=50)
HOST_CALLS = 1000
PRODUCTION_BATCHES = (2, 64, 74, 128, 148, 256)
# name: (h_q, d_qk, s_k, topk, page, extra (s_k, topk, page) or None, extra_topk_length, batches)
CONFIGS = {
    "V32": (128, 576, 32768, 2048, 64, None, False, (2, 64, 74, 128)),
    "CONFIG1": (64, 512, 16384, 128, 256, (16384, 512, 64), False, PRODUCTION_BATCHES),
    "CONFIG2": (128, 512, 16384, 128, 256, (16384, 1024, 64), False, PRODUCTION_BATCHES),
    "CONFIG3": (64, 512, 16384, 128, 256, (16384, 1024, 2), True, PRODUCTION_BATCHES),
    "CONFIG4": (128, 512, 16384, 128, 256, (16384, 1024, 2), True, PRODUCTION_BATCHES),
    "PEAK_H64_D512": (64, 512, 32768, 16384, 64, None, False, (148,)),
    "PEAK_H64_D576": (64, 576, 32768, 16384, 64, None, False, (148,)),
    "PEAK_H128_D512": (128, 512, 32768, 16384, 64, None, False, (148,)),
    "PEAK_H128_D576": (128, 576, 32768, 16384, 64, None, False, (148,)),
}
S_Q = 2
POOL_TOKENS = 1 << 22


def _scope(g, b: int, s_k: int, topk: int, page: int, fmt: str):
    """One cache and its indices: varlen requests (lengths ~ N(s_k, s_k / 2), at least s_q), blocks at random, topk
    distinct tokens of each query's request (all of them where it has fewer, the rest -1).  The requests' blocks
    are drawn from a pool of at most POOL_TOKENS tokens (over a GB: far beyond L2), which keeps the largest rows'
    caches within the GPU's memory."""
    lens = [max(int(random.normalvariate(s_k, s_k / 2)), S_Q) for _ in range(b)]
    blocks = -(-max(lens) // page)
    pool = min(b * blocks, -(-POOL_TOKENS // page))
    table = torch.randperm(b * blocks, generator=g, device="cuda").view(b, blocks) % pool
    rows = torch.randn(pool, page, 1, 512 if fmt != "V32" else 576, generator=g, device="cuda",
                       dtype=torch.bfloat16).mul_(0.1).clamp_(-1, 1)
    cache = mla_cute.quantize_kv_cache(rows, kv_format=fmt)
    del rows
    n = torch.tensor(lens, device="cuda").view(b, 1, 1)
    key = torch.rand(b, S_Q, blocks * page, generator=g, device="cuda")
    key = key.masked_fill(torch.arange(blocks * page, device="cuda") >= n, 2.0)  # past the length: last
    pos = key.argsort(dim=-1)[..., :topk]
    phys = torch.gather(table.unsqueeze(1).expand(b, S_Q, blocks), 2, pos // page) * page + pos % page
    indices = torch.where(pos < n, phys, -1).to(torch.int32)
    return cache, indices


def make_inputs(name: str, b: int, seed: int = 0):
    h_q, d_qk, s_k, topk, page, extra, extra_len, _ = CONFIGS[name]
    random.seed(seed * 1000 + b)
    g = torch.Generator(device="cuda").manual_seed(seed * 1000 + b)
    fmt = "V32" if d_qk == 576 else "V4"
    q = torch.randn(b, S_Q, h_q, d_qk, generator=g, device="cuda").clamp(-1, 1).bfloat16()
    sink = torch.randn(h_q, generator=g, device="cuda")
    mask = torch.randn(h_q, generator=g, device="cuda")
    sink = sink.masked_fill(mask > 0.5, float("inf")).masked_fill(mask < -0.5, float("-inf"))
    cache, indices = _scope(g, b, s_k, topk, page, fmt)
    args = dict(q=q, k_cache=cache, indices=indices, attn_sink=sink, sm_scale=d_qk ** -0.55)
    if extra is not None:
        e_s_k, e_topk, e_page = extra
        args["extra_k_cache"], args["extra_indices_in_kvcache"] = _scope(g, b, e_s_k, e_topk, e_page, fmt)
        if extra_len:
            args["extra_topk_length"] = torch.randint(0, e_topk + 1, (b,), generator=g, device="cuda",
                                                      dtype=torch.int32)
    return args


def call(mod, a: dict, meta, **kw):
    """FlashMLA's decode call as its test makes it (positional, in its order)."""
    return mod.flash_mla_with_kvcache(
        a["q"], a["k_cache"], None, None, 512, meta, None, a["sm_scale"], False, True, a["indices"], a["attn_sink"],
        a.get("extra_k_cache"), a.get("extra_indices_in_kvcache"), None, a.get("extra_topk_length"), **kw)


def eager_fn(mod, a: dict, caller=call, **kw):
    """The call with its metadata made by a first call and reused (``caller``: how the rows call, ``call``'s
    arguments)."""
    meta = mod.get_mla_metadata()[0]
    caller(mod, a, meta, **kw)
    return lambda: caller(mod, a, meta, **kw)


def graph_fn(mod, a: dict, caller=call, **kw):
    """The call captured with its metadata made inside the capture; returns the replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        caller(mod, a, mod.get_mla_metadata()[0], **kw)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        caller(mod, a, mod.get_mla_metadata()[0], **kw)
    g.replay()
    torch.cuda.synchronize()
    return g.replay


def host_us(fn, blocks: int = 5) -> float:
    """CPU time of the calling thread per call over HOST_CALLS back-to-back calls, in ``blocks`` blocks (the GPU
    drained before each): the median block's (us)."""
    for _ in range(20):
        fn()
    per_call = []
    for _ in range(blocks):
        torch.cuda.synchronize()
        t0 = time.thread_time()
        for _ in range(HOST_CALLS // blocks):
            fn()
        per_call.append((time.thread_time() - t0) / (HOST_CALLS // blocks) * 1e6)
    torch.cuda.synchronize()
    return sorted(per_call)[blocks // 2]


def compare(fm_out, ours_out) -> dict:
    (oa, la), (ob, lb) = fm_out, ours_out
    a, b = oa.float(), ob.float()
    m = torch.isfinite(a) & torch.isfinite(b)
    lm = torch.isfinite(la) & torch.isfinite(lb)
    return dict(out_rel=float((a[m] - b[m]).norm() / a[m].norm().clamp_min(1e-30)),
                lse_maxdiff=float((la[lm] - lb[lm]).abs().max()) if lm.any() else 0.0,
                lse_inf_agree=bool(torch.equal(torch.isinf(la), torch.isinf(lb))),
                ours_nan=int(torch.isnan(ob).sum()))


def timed(fns: dict, rounds: int) -> dict:
    warm_gpu()
    times = flashmla_side.interleaved(fns, rounds, lambda fn: bench(fn, **REPS) * 1e3)
    return {k: flashmla_side.median(v) for k, v in times.items()}


def row(fm, name: str, b: int, modes, rounds: int, invariant: bool = False) -> dict:
    h_q, d_qk, s_k, topk, page, extra, extra_len, _ = CONFIGS[name]
    a = make_inputs(name, b)
    rec = dict(config=name, b=b, s_q=S_Q, h_q=h_q, d_qk=d_qk, topk=topk, page=page,
               extra_topk=extra[1] if extra else 0, extra_page=extra[2] if extra else None, extra_topk_length=extra_len)
    return measure(fm, a, rec, modes, rounds, b == 2, invariant=invariant)


def measure(fm, a: dict, rec: dict, modes, rounds: int, host: bool, caller=call, invariant: bool = False) -> dict:
    """Both calls' outputs compared, then the ``modes`` timed (the host time where ``host``), into ``rec``.
    ``invariant``: our call with ``enable_batch_invariant=True`` timed too, interleaved with both (``inv_*``)."""
    fm_e, ours_e = eager_fn(fm, a, caller, use_legacy=True), eager_fn(mla_cute, a, caller)
    rec.update(compare(fm_e(), ours_e()))
    inv = dict(enable_batch_invariant=True)
    if "eager" in modes:
        fns = {"fm": fm_e, "ours": ours_e} | ({"inv": eager_fn(mla_cute, a, caller, **inv)} if invariant else {})
        t = timed(fns, rounds)
        rec.update(fm_us=t["fm"], ours_us=t["ours"], ratio=t["fm"] / t["ours"])
        if invariant:
            rec.update(inv_us=t["inv"], inv_ratio=t["fm"] / t["inv"])
    if "graph" in modes:
        fns = {"fm": graph_fn(fm, a, caller, use_legacy=True), "ours": graph_fn(mla_cute, a, caller)}
        t = timed(fns | ({"inv": graph_fn(mla_cute, a, caller, **inv)} if invariant else {}), rounds)
        rec.update(fm_graph_us=t["fm"], ours_graph_us=t["ours"], graph_ratio=t["fm"] / t["ours"])
        if invariant:
            rec.update(inv_graph_us=t["inv"], inv_graph_ratio=t["fm"] / t["inv"])
    if "host" in modes and host:
        rec.update(fm_host_us=host_us(fm_e), ours_host_us=host_us(ours_e))
    return rec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--batches", default=None, help="only these batch sizes (default: each configuration's)")
    args, fm, modes = parse_side_by_side(ap)
    only = {int(x) for x in args.batches.split(",")} if args.batches else None
    recs = []
    print("| config | b | h_q | eager FlashMLA / ours us (ratio) | graph FlashMLA / ours us (ratio) | host us "
          "FlashMLA / ours | out rel |\n|---|---|---|---|---|---|---|", flush=True)
    for name in args.configs.split(","):
        for b in CONFIGS[name][-1]:
            if only is not None and b not in only:
                continue
            rec = row(fm, name, b, modes, args.rounds, args.invariant)
            recs.append(rec)
            print(f"| {name} | {b} | {rec['h_q']} | {timing_cells(rec)} |", flush=True)
            torch.cuda.empty_cache()
    if args.out:
        write_rows(args.out, recs, method=__doc__.split("Modes:")[1].strip())
    return 0


def parse_side_by_side(ap):
    """``ap``'s arguments with the modes, rounds and output every side-by-side table takes; FlashMLA's module (these
    rows are timed beside it only) and the modes asked."""
    ap.add_argument("--modes", default="eager,graph,host")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--invariant", action="store_true",
                    help="also time our call with enable_batch_invariant=True (last cells: FlashMLA / it, eager, graph)")
    args = ap.parse_args()
    fm = flashmla_side.flash_mla()
    if fm is None:
        raise SystemExit("flash_mla does not import: these rows are timed beside FlashMLA only")
    return args, fm, set(args.modes.split(","))


def timing_cells(rec: dict) -> str:
    """A row's eager, graph and host cells and its output error, as the tables print them."""
    eager = f"{rec['fm_us']:.1f} / {rec['ours_us']:.1f} ({rec['ratio']:.2f})" if "fm_us" in rec else "-"
    graph = (f"{rec['fm_graph_us']:.1f} / {rec['ours_graph_us']:.1f} ({rec['graph_ratio']:.2f})"
             if "fm_graph_us" in rec else "-")
    host = f"{rec['fm_host_us']:.1f} / {rec['ours_host_us']:.1f}" if "fm_host_us" in rec else "-"
    cells = f"{eager} | {graph} | {host} | {rec['out_rel']:.1e}"
    if "inv_us" in rec or "inv_graph_us" in rec:  # enable_batch_invariant=True beside FlashMLA
        cells += " | " + " | ".join(f"{rec[k]:.1f} ({rec[r]:.2f})" if k in rec else "-"
                                    for k, r in (("inv_us", "inv_ratio"), ("inv_graph_us", "inv_graph_ratio")))
    return cells


def write_rows(path: str, recs: list, **about) -> None:
    """The rows and the run's device, versions and ``about`` as JSON."""
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, python=platform.python_version(),
                **about)
    with open(path, "w") as f:
        json.dump(dict(meta=meta, rows=recs), f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
