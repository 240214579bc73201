"""Sparse prefill (``flash_mla_sparse_fwd``) timed side by side with FlashMLA's SM90 kernel.

    python benchmarks/bench_prefill.py [--rows 0,3] [--prompt | --fp8-cache] [--rounds 5] [--out rows.json] [--check]

Rows are FlashMLA's own performance cases (s_q 4096, attention sink on, random distinct indices within
s_kv), plus h_q 16 and 32, which FlashMLA runs only padded to 64 heads (its time for 64 heads is the one
compared).  Each round draws nothing new: the row's inputs are drawn once, then every round times FlashMLA
and mla-cute once each (0.5 s of GPU work first, then the median of do_bench over the whole call), the
order alternating; a row reports the medians over the rounds and ``ratio`` = FlashMLA's / ours.
FLOPs = 2 * s_q * h_q * topk * (d_qk + 512).  ``--check``: each row's output against FlashMLA's first.
``--prompt``: the prompt rows instead: kv is the prompt itself (s_kv = s_q) and token i picks min(i + 1, topk)
of the keys 0..i, the rest of its list -1, as an indexer over a causal prompt gives (FLOPs counted as if every
index were valid).
``--fp8-cache``: the FP8 rows instead: kv quantized into the paged 656-byte cache (64-token pages, in order, so
an index names the same token in both), mla-cute's prefill reading it directly, against FlashMLA's
dequantize-then-prefill: ``mla_cute.dequantize_kv_cache`` of the s_kv rows into a bf16 kv (torch operations, as
an engine without a fused kernel would), then FlashMLA's prefill over it; both steps are timed together
(``flashmla_us``, the ratio's) and each alone (``dequant_us``, ``flashmla_prefill_us``; ``ratio_prefill_only``
leaves the dequantization out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

import mla_cute  # noqa: E402
from bench_decode import bench, warm_gpu  # noqa: E402
from flashmla_side import flash_mla, median  # noqa: E402

KEYS = ("d_qk", "h_q", "topk", "s_kv", "s_q")
ROWS = ([(576, 128, 2048, s_kv, 4096) for s_kv in (8192, 32768, 65536, 98304, 131072)]
        + [(512, 64, 512, s_kv, 4096) for s_kv in (8192, 32768, 49152, 65536)]
        + [(512, 128, 1024, s_kv, 4096) for s_kv in (8192, 32768, 49152, 65536)]
        + [(576, 32, 2048, 32768, 4096), (576, 16, 2048, 32768, 4096)])
FP8_ROWS = [(576, 128, 2048, 8192, 4096), (576, 128, 2048, 32768, 4096), (576, 128, 2048, 131072, 4096),
            (576, 64, 2048, 32768, 4096), (576, 32, 2048, 32768, 4096), (576, 16, 2048, 32768, 4096)]
PROMPT_ROWS = [(576, 128, 2048, 4096, 4096), (576, 128, 2048, 8192, 8192), (512, 64, 512, 4096, 4096),
               (512, 128, 1024, 4096, 4096)]


def make_inputs(d_qk, h_q, topk, s_kv, s_q, seed=0, prompt=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(s_q, h_q, d_qk, generator=gen, device="cuda").to(torch.bfloat16)
    kv = torch.randn(s_kv, 1, d_qk, generator=gen, device="cuda").to(torch.bfloat16)
    # Distinct random indices per query: the top topk of a random score over s_kv.
    score = torch.rand(s_q, s_kv, generator=gen, device="cuda")
    if prompt:  # token i sees keys 0..i: the others score -1 and come last, as -1
        score.masked_fill_(torch.ones(s_q, s_kv, dtype=torch.bool, device="cuda").triu(1), -1.0)
    top = score.topk(topk, dim=1)
    idx = top.indices.masked_fill(top.values < 0, -1)
    sink = torch.randn(max(h_q, 64), generator=gen, device="cuda")
    return q, kv, idx.to(torch.int32).view(s_q, 1, topk), sink


def flops(d_qk, h_q, topk, s_kv, s_q):
    return 2 * s_q * h_q * topk * (d_qk + 512)


def time_row(row, fm, rounds, check, prompt=False, fp8=False):
    d_qk, h_q, topk, s_kv, s_q = row
    q, kv, idx, sink = make_inputs(*row, prompt=prompt)
    scale = d_qk ** -0.5
    ours_kv = mla_cute.quantize_kv_cache(kv.view(s_kv // 64, 64, 1, d_qk)) if fp8 else kv
    ours = lambda: mla_cute.flash_mla_sparse_fwd(q, ours_kv, idx, scale, attn_sink=sink[:h_q], backend="cute")  # noqa: E731
    fns = {"mla_cute": ours}
    if fm is not None:
        # FlashMLA takes 64 or 128 heads: fewer heads run padded to 64 (the work it would be given).
        qf = q if h_q in (64, 128) else torch.cat([q, q.new_zeros(s_q, 64 - h_q, d_qk)], dim=1)
        hf = qf.shape[1]
        if fp8:
            dequant = lambda: mla_cute.dequantize_kv_cache(ours_kv).view(s_kv, 1, d_qk)  # noqa: E731
            kv = dequant()
            fns["flashmla"] = lambda: fm.flash_mla_sparse_fwd(qf, dequant(), idx, scale, attn_sink=sink[:hf],  # noqa: E731
                                                              use_legacy=True)
            fns["dequant"] = dequant
        fns["flashmla_prefill"] = lambda: fm.flash_mla_sparse_fwd(qf, kv, idx, scale, attn_sink=sink[:hf],  # noqa: E731
                                                                  use_legacy=True)
        if not fp8:
            fns["flashmla"] = fns.pop("flashmla_prefill")
    rec = dict(zip(KEYS, row), indices="prompt" if prompt else "random", kv="fp8 cache" if fp8 else "bf16")
    got = ours()
    if check and fm is not None:
        want = fns["flashmla"]()
        rec["max_abs_vs_flashmla"] = float((got[0].float() - want[0][:, :h_q].float()).abs().max())
        rec["lse_max_abs_vs_flashmla"] = float((got[2] - want[2][:, :h_q]).abs().max())
    warm_gpu()
    times = {name: [] for name in fns}
    for r in range(rounds):
        for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            times[name].append(bench(fns[name]) * 1e3)
    us = {name: median(t) for name, t in times.items()}
    rec["us"] = us["mla_cute"]
    rec["tflops"] = flops(*row) / us["mla_cute"] / 1e6
    if "flashmla" in us:
        rec["flashmla_us"] = us["flashmla"]
        rec["flashmla_tflops"] = flops(d_qk, max(h_q, 64), topk, s_kv, s_q) / us["flashmla"] / 1e6
        rec["ratio"] = us["flashmla"] / us["mla_cute"]
    if "dequant" in us:
        rec["dequant_us"], rec["flashmla_prefill_us"] = us["dequant"], us["flashmla_prefill"]
        rec["ratio_prefill_only"] = us["flashmla_prefill"] / us["mla_cute"]
    rec["times"] = times
    return rec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="", help="comma-separated row numbers (default: all)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--prompt", action="store_true", help="the prompt rows (PROMPT_ROWS)")
    ap.add_argument("--fp8-cache", action="store_true", help="the FP8 cache rows (FP8_ROWS)")
    args = ap.parse_args()
    table = PROMPT_ROWS if args.prompt else FP8_ROWS if args.fp8_cache else ROWS
    rows = [table[int(i)] for i in args.rows.split(",")] if args.rows else table
    fm = flash_mla()
    print("FlashMLA:", "imported, timed in the same rounds" if fm is not None else "not importable: mla-cute alone")
    out = []
    for row in rows:
        rec = time_row(row, fm, args.rounds, args.check, args.prompt, args.fp8_cache)
        out.append(rec)
        print(json.dumps({k: v for k, v in rec.items() if k != "times"}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
