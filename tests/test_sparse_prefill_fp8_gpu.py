"""Sparse prefill straight from the paged FP8 cache (``flash_mla_sparse_fwd`` with kv the 656-byte cache) on the
H200 against the reference over the dequantized cache: a subset of FlashMLA's prefill grid at h_q 128, 64, 32
and 16 (d_qk 576: the format holds the RoPE part), attention sinks and topk_length, all indices invalid, lists
longer than the prompt (whole 64-index blocks without a valid index), head counts FlashMLA lacks, a long prompt.

Tolerances are the bf16 prefill tests' (``test_sparse_prefill_gpu``): out by the cosine rule (1 - cos below
1e-5) and elementwise within rel 3.01/128 or abs max(8e-4, 2^-7 of the largest output); lse and max_logits
within 1e-5 relative or absolute.  The reference dequantizes the same bytes the kernel reads (the kernel's fp16
operands hold the dequantized values exactly), so only the kernel's own rounding is measured."""

from __future__ import annotations

import pytest
import torch

import mla_cute
from gpu_cases import check_prefill, make_prefill_fp8_case, replayed_in_graph

pytestmark = pytest.mark.gpu

SHAPES = [(128, 128), (592, 128), (1840, 256), (1592, 384), (1521, 512), (95, 128), (4096, 2048)]
GRID = [(h, s_kv, topk, s_q) for h in (128, 64, 32, 16) for s_kv, topk in SHAPES for s_q in (1, 62, 213)]


def run_and_check(case, *, sample=None):
    return check_prefill(case, sample=sample)


@pytest.mark.parametrize("options", [False, True], ids=["plain", "sink+topk_length"])
@pytest.mark.parametrize("h_q,s_kv,topk,s_q", GRID)
def test_prefill_fp8_grid(h_q, s_kv, topk, s_q, options):
    case = make_prefill_fp8_case(s_q, s_kv, topk, h_q, with_sink=options, with_topk_length=options,
                                 seed=s_q + s_kv + topk + h_q)
    run_and_check(case)


@pytest.mark.parametrize("s_q,s_kv,topk", [(1, 128, 128), (1234, 4321, 4096)])
def test_all_indices_invalid(s_q, s_kv, topk):
    out, max_logits, lse = run_and_check(make_prefill_fp8_case(s_q, s_kv, topk, 128, all_invalid=True))
    assert torch.all(out == 0) and torch.all(lse == float("inf")) and torch.all(max_logits == -float("inf"))


@pytest.mark.parametrize("options", [False, True], ids=["plain", "sink+topk_length"])
@pytest.mark.parametrize("s_kv,topk", [(32, 2048), (64, 8192)])
def test_lists_longer_than_the_prompt(s_kv, topk, options):
    run_and_check(make_prefill_fp8_case(256, s_kv, topk, 128, with_sink=options, with_topk_length=options))


@pytest.mark.parametrize("h_q", [8, 48, 100])
def test_head_counts_flashmla_lacks(h_q):
    run_and_check(make_prefill_fp8_case(62, 1840, 256, h_q, with_sink=True, with_topk_length=True))


@pytest.mark.parametrize("page", [1, 16])
def test_other_page_sizes(page):
    run_and_check(make_prefill_fp8_case(62, 1000, 512, 64, page=page, with_topk_length=True, seed=page))


def test_long_prompt():
    """s_q = 70000 at (s_kv, topk) = (256, 256): every token written, a sample of them checked."""
    case = make_prefill_fp8_case(70000, 256, 256, 128)
    sample = torch.cat([torch.arange(0, 70000, 997), torch.arange(69990, 70000)]).cuda()
    out, max_logits, lse = mla_cute.flash_mla_sparse_fwd(**case, backend="cute")
    assert torch.isfinite(out.float()).all() and torch.isfinite(lse).all()
    run_and_check(case, sample=sample)


def test_uint8_view_non_contiguous_q_and_graph():
    """The cache viewed as uint8, q's heads a strided view, under inference mode and in a CUDA graph."""
    case = make_prefill_fp8_case(213, 1521, 512, 64, with_sink=True, with_topk_length=True)
    wide = torch.randn(213, 128, 576, device="cuda").to(torch.bfloat16)
    wide[:, ::2] = case["q"]
    case = dict(case, q=wide[:, ::2], kv=case["kv"].view(torch.uint8))
    want = run_and_check(case)
    got = replayed_in_graph(lambda: mla_cute.flash_mla_sparse_fwd(**case, backend="cute"))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
