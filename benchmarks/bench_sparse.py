"""Sparse FP8 decode benchmark, by the method of the FlashMLA anchor numbers
(benchmarks/results/anchor_flashmla_sparse_fp8_h200.json), FlashMLA timed beside it (``flashmla_side.py``).

Random distinct topk tokens per query out of its request's s_k, page 64, random block
placement, 656-byte FP8 rows (random e4m3 values, power-of-two scales, bf16 RoPE), no
topk_length, no sink, metadata computed on the first call and reused; after 0.5 s of GPU
work, each of ``--rounds`` rounds times FlashMLA (where ``flash_mla`` imports; every call
``use_legacy=True``) and every schedule once, the order rotated, by the median of
triton.testing.do_bench(fn, warmup=10, rep=100) over the whole call (split kernel + combine,
or the split kernel alone when the plan splits no request); time = the median over the
rounds, ratio = FlashMLA's / ours.  Without ``flash_mla`` the ratio is against the anchor
file, marked "remembered, another board".
FLOPs = 2*b*s_q*h_q*topk*(576+512); bytes = b*s_q*topk*656 + 2*b*s_q*h_q*(576+512).

    python benchmarks/bench_sparse.py [--out results.json] [--quick] [--rows 0,3] [--schedules default,...]
                                      [--anchor anchors.json] [--rounds 3]
"""

from __future__ import annotations

import os
import sys

import torch

import flashmla_side
import mla_cute
from bench_decode import bench, warm_gpu, with_fields  # noqa: F401  (bench, warm_gpu: flashmla_side's kind)

NAME = "sparse"
KEYS = ("b", "s_q", "h_q", "s_k", "topk")
CONFIGS = [  # (b, s_q, h_q, s_k, topk): the anchor's rows
    (2, 2, 128, 32768, 2048), (64, 2, 128, 32768, 2048), (74, 2, 128, 32768, 2048), (128, 2, 128, 32768, 2048),
    (128, 2, 64, 32768, 2048), (128, 1, 128, 32768, 2048), (64, 2, 128, 65536, 16384),
]
ANCHOR = os.path.join(os.path.dirname(__file__), "results", "anchor_flashmla_sparse_fp8_h200.json")
QUICK = [CONFIGS[0], CONFIGS[3], CONFIGS[4]]
REPS = dict(warmup=10, rep=100)  # do_bench's, as the anchor was timed


def schedules():
    from mla_cute.schedules import DEFAULT_SPARSE_SCHEDULE

    return {"default": DEFAULT_SPARSE_SCHEDULE}


def make_inputs(b, s_q, h_q, s_k, topk, page=64, device="cuda"):
    blocks = (s_k + page - 1) // page
    nb = b * blocks
    raw = torch.empty(nb, page, 656, dtype=torch.uint8, device=device)
    raw[..., :512] = torch.randn(nb, page, 512, device=device).to(torch.float8_e4m3fn).view(torch.uint8)
    scales = torch.pow(2.0, torch.randint(-8, -3, (nb, page, 4), device=device).float())
    raw[..., 512:528] = scales.view(torch.uint8)
    raw[..., 528:] = (torch.randn(nb, page, 64, device=device) * 0.1).to(torch.bfloat16).view(torch.uint8)
    k_cache = raw.view(torch.float8_e4m3fn).view(nb, page, 1, 656)
    block_table = torch.randperm(nb, device=device, dtype=torch.int64).view(b, blocks)
    pos = torch.rand(b, s_q, s_k, device=device).argsort(dim=-1)[..., :topk]
    phys = torch.gather(block_table.unsqueeze(1).expand(b, s_q, blocks), 2, pos // page)
    indices = (phys * page + pos % page).to(torch.int32)
    q = torch.randn(b, s_q, h_q, 576, device=device, dtype=torch.bfloat16)
    return q, k_cache, indices


def call(row, inputs, schedule):
    """The whole sparse decode call on ``make_inputs``' tensors, with fresh metadata."""
    q, k_cache, indices = inputs
    meta = mla_cute.get_mla_metadata()[0]
    return lambda: mla_cute.flash_mla_with_kvcache(q, k_cache, None, None, 512, meta, is_fp8_kvcache=True,
                                                   indices=indices, backend="cute", schedule=schedule)


def flash_call(fm, row, inputs):
    """FlashMLA's call (``fm``: the ``flash_mla`` package) on the same tensors."""
    q, k_cache, indices = inputs
    meta = fm.get_mla_metadata()[0]
    return lambda: fm.flash_mla_with_kvcache(q, k_cache, None, None, 512, meta, is_fp8_kvcache=True,
                                             indices=indices, use_legacy=True)


def reference(row, inputs):
    """The torch reference's out, or None above 16 queries (too slow there)."""
    if row[0] * row[1] > 16:
        return None
    q, k_cache, indices = inputs
    return mla_cute.flash_mla_with_kvcache(q, k_cache, None, None, 512, mla_cute.get_mla_metadata()[0],
                                           is_fp8_kvcache=True, indices=indices, backend="reference")[0]


def work(b, s_q, h_q, s_k, topk):
    """(FLOPs, bytes) of one call."""
    return 2 * b * s_q * h_q * topk * (576 + 512), b * s_q * topk * 656 + 2 * b * s_q * h_q * (576 + 512)


def schedule_named(name: str):
    """A name of ``schedules()``, optionally with fields changed for a sweep:
    ``default:num_sm_parts=16``, ``default:split_fixed_cost=2``."""
    return with_fields(schedules(), name)


def main():
    args = flashmla_side.parser("list of: " + ", ".join(schedules()) + " (',' between names; ';' when a name "
                                "changes fields: 'default;default:num_sm_parts=16')").parse_args()
    flashmla_side.main([sys.modules[__name__]], args)


if __name__ == "__main__":
    sys.exit(main())
