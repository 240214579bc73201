"""Sparse decode on the d_qk-512 cache formats, side by side: mla-cute beside FlashMLA's SM90 kernel (``flash_mla``,
every call ``use_legacy=True``) where it reads the format (V32_NO_ROPE, V4), and our V41 and V41_PAGED beside our
V4 on the same rows (V4.1 has no Hopper peer).  Head counts below 64 are timed beside FlashMLA on q padded to 64 heads (its
smallest).  ``--extra-topk N``: each query also attends to N tokens of an extra cache of the same format (a
request's window of 4096 tokens, page 64), one softmax over both (``extra_k_cache``); ``--extra-format V41_FP4``: the
V41 rows' extra cache in V4.1's FP4 format (their V4 peer keeps a V4 extra cache).

Per row: random bf16 latent rows (page 64, s_k tokens a request, blocks placed at random) quantized to the format
by ``mla_cute.quantize_kv_cache``; random distinct topk tokens per query; metadata computed on the first call and
reused.  After 0.5 s of GPU work, each of ``--rounds`` rounds times ours and the peer once (order rotated) by the
median of triton.testing.do_bench(fn, warmup=10, rep=50) over the whole call; us = the median over the rounds;
ratio = peer's us / ours.  Outputs are checked against each other first (relative Frobenius error; for the
padded peer over the real heads).

    python benchmarks/bench_sparse_formats.py [--formats V32_NO_ROPE,V4,V41] [--heads 64,128] [--quick]
                                              [--extra-topk 128 [--extra-format V41_FP4]] [--rounds 3]
                                              [--out rows.json]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import platform
import sys

import torch

import flashmla_side
import mla_cute
from bench_decode import bench, warm_gpu

S_K = 32768
PAGE = 64
WINDOW = 4096  # an extra cache's tokens a request
REPS = dict(warmup=10, rep=50)
BATCHES, QUERIES, TOPKS = (2, 64, 128), (1, 2), (512, 1024, 2048)


@functools.lru_cache(maxsize=1)
def _bf16_rows(b: int):
    """Every block's bf16 latent rows for ``b`` requests (one draw, shared by the formats of a batch size)."""
    g = torch.Generator(device="cuda").manual_seed(b)
    nb = b * S_K // PAGE
    return (torch.randn(nb, PAGE, 1, 512, generator=g, device="cuda") * 0.5).bfloat16()


@functools.lru_cache(maxsize=4)
def _cache(fmt: str, b: int, tokens: int = S_K):
    return mla_cute.quantize_kv_cache(_bf16_rows(b)[: b * tokens // PAGE], kv_format=fmt)


def _indices(g, b, s_q, tokens, topk):
    """topk distinct random tokens of each request's ``tokens``, its blocks placed at random."""
    blocks = tokens // PAGE
    table = torch.randperm(b * blocks, generator=g, device="cuda").view(b, blocks)
    pos = torch.rand(b, s_q, tokens, generator=g, device="cuda").argsort(dim=-1)[..., :topk]
    phys = torch.gather(table.unsqueeze(1).expand(b, s_q, blocks), 2, pos // PAGE)
    return (phys * PAGE + pos % PAGE).to(torch.int32)


def make_inputs(fmt, b, s_q, h_q, topk, extra_topk=0):
    g = torch.Generator(device="cuda").manual_seed(b * 7 + s_q * 3 + h_q + topk)
    q = torch.randn(b, s_q, h_q, 512, generator=g, device="cuda", dtype=torch.bfloat16)
    extra = _indices(g, b, s_q, WINDOW, extra_topk) if extra_topk else None
    return q, _indices(g, b, s_q, S_K, topk), extra


def _kwargs(fmt, q, indices, extra, extra_fmt=None):
    kw = dict(is_fp8_kvcache=True, indices=indices, kv_format=fmt)
    if extra is not None:
        kw.update(extra_k_cache=_cache(extra_fmt or fmt, q.shape[0], WINDOW), extra_indices_in_kvcache=extra)
    return kw


def ours(fmt, q, indices, extra=None, extra_fmt=None):
    cache, meta = _cache(fmt, q.shape[0]), mla_cute.get_mla_metadata()[0]
    kw = _kwargs(fmt, q, indices, extra, extra_fmt)
    return lambda: mla_cute.flash_mla_with_kvcache(q, cache, None, None, 512, meta, backend="cute", **kw)


def flashmla(fm, fmt, q, indices, extra=None):
    """FlashMLA on the same caches, q padded with random heads up to 64 where it has fewer."""
    if q.shape[2] < 64:
        pad = torch.randn(*q.shape[:2], 64 - q.shape[2], 512, device="cuda", dtype=q.dtype)
        q = torch.cat([q, pad], dim=2)
    cache, meta, kw = _cache(fmt, q.shape[0]), fm.get_mla_metadata()[0], _kwargs(fmt, q, indices, extra)
    return lambda: fm.flash_mla_with_kvcache(q, cache, None, None, 512, meta, use_legacy=True, **kw)


def row(fm, fmt, b, s_q, h_q, topk, rounds, extra_topk=0, extra_fmt=None):
    q, indices, extra = make_inputs(fmt, b, s_q, h_q, topk, extra_topk)
    mine = ours(fmt, q, indices, extra, extra_fmt if fmt in ("V41", "V41_PAGED") else None)
    if fmt in ("V41", "V41_PAGED"):
        peer_name, peer = "mla-cute V4", ours("V4", q, indices, extra)
    else:
        peer_name, peer = ("FlashMLA" + (" (64 heads)" if h_q < 64 else "")), flashmla(fm, fmt, q, indices, extra)
    a, p = mine()[0], peer()[0][:, :, :h_q]
    if torch.isnan(a).any():
        raise ValueError(f"{fmt} {(b, s_q, h_q, topk)}: NaN in the output")
    err = float((a.float() - p.float()).norm() / p.float().norm())
    warm_gpu()
    times = flashmla_side.interleaved({"ours": mine, "peer": peer}, rounds, lambda fn: bench(fn, **REPS) * 1e3)
    us, peer_us = flashmla_side.median(times["ours"]), flashmla_side.median(times["peer"])
    return dict(kv_format=fmt, b=b, s_q=s_q, h_q=h_q, topk=topk, extra_topk=extra_topk,
                extra_format=(extra_fmt if fmt in ("V41", "V41_PAGED") else None) or (fmt if extra_topk else None), us=us, us_rounds=times["ours"], peer=peer_name,
                peer_us=peer_us, peer_us_rounds=times["peer"], ratio=peer_us / us, rel_err_vs_peer=err)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="V32_NO_ROPE,V4,V41")
    ap.add_argument("--heads", default="64,128")
    ap.add_argument("--quick", action="store_true", help="b 64 and 128, s_q 2, topk 2048 only")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--extra-topk", type=int, default=0, help="an extra cache's tokens a query (0: none)")
    ap.add_argument("--extra-format", default=None, help="the V41 rows' extra cache format (default: theirs)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    fm = flashmla_side.flash_mla()
    formats = args.formats.split(",")
    if fm is None and any(f not in ("V41", "V41_PAGED") for f in formats):
        raise SystemExit("flash_mla does not import: only --formats V41,V41_PAGED run without it")
    grid = ((64, 128), (2,), (2048,)) if args.quick else (BATCHES, QUERIES, TOPKS)
    heads = [int(h) for h in args.heads.split(",")]
    print("| kv_format | b | s_q | h_q | topk | extra topk | us | peer | peer us | ratio | rel_err vs peer |\n|"
          + "---|" * 11)
    recs = []
    for fmt, b in itertools.product(formats, grid[0]):
        for s_q, h_q, topk in itertools.product(grid[1], heads, grid[2]):
            rec = row(fm, fmt, b, s_q, h_q, topk, args.rounds, args.extra_topk, args.extra_format)
            recs.append(rec)
            print(f"| {fmt} | {b} | {s_q} | {h_q} | {topk} | {args.extra_topk} | {rec['us']:.1f} | {rec['peer']} "
                  f"| {rec['peer_us']:.1f} "
                  f"| {rec['ratio']:.3f} | {rec['rel_err_vs_peer']:.1e} |", flush=True)
        _cache.cache_clear()
        torch.cuda.empty_cache()
    if args.out:
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, python=platform.python_version(),
                    method=f"0.5 s of GPU work before each row, then {args.rounds} rounds, each timing ours and the "
                    f"peer once (order rotated) by the median of triton.testing.do_bench (warmup=10, rep=50), "
                    f"whole call; us = the median over the rounds; s_k {S_K}, page {PAGE}")
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=recs), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
