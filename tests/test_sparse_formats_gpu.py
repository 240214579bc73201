"""The sparse decode kernel on the d_qk-512 cache formats (V32_NO_ROPE, V4, V41, V41_PAGED) against the reference on the
dequantized cache: FlashMLA's sparse grid thinned to three shapes, each kernel variant, head counts below 64,
topk_length and sinks, invalid and out-of-range indices, the fp16 operand range's ends, metadata reuse (the CUDA
graph replay: test_sparse_decode_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from gpu_cases import make_sparse_case
from test_sparse_decode_gpu import WHOLE_TILE, run_and_check

pytestmark = pytest.mark.gpu

FORMATS = ["V32_NO_ROPE", "V4", "V41", "V41_PAGED"]
# (s_k, topk, page) of FlashMLA's grid: odd pages, a topk past s_k, the longest topk.
SHAPES = [(512, 64, 69), (1024, 576, 61), (2046, 2048, 64)]
GRID = [(fmt, b, s_q, h_q, s_k, topk, page) for fmt in FORMATS for s_k, topk, page in SHAPES for b in (4, 74)
        for s_q in (1, 3) for h_q in (64, 128)]


@pytest.mark.parametrize("fmt,b,s_q,h_q,s_k,topk,page", GRID)
def test_format_grid(fmt, b, s_q, h_q, s_k, topk, page):
    """The resolver's kernels: the whole-tile gather at h_q = 64, the crossover at h_q = 128."""
    run_and_check(make_sparse_case(b, s_q, h_q, s_k, topk, page, seed=b * 7 + s_q + h_q + topk, kv_format=fmt),
                  expect=dict(crossover=h_q == 128, kv_format=fmt))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("force", [WHOLE_TILE, dict(crossover=True, producer_halves=False),
                                   dict(crossover=True, producer_halves=True), dict(partials_16bit=True)],
                         ids=["whole-tile", "whole-producer", "producer-halves", "16bit-partials"])
def test_format_kernel_variants(fmt, force):
    """Every kernel variant at h_q = 128, with sinks (+-inf among them) and topk_length (0, partial, past topk),
    metadata reused."""
    sink = torch.randn(128) * 2
    sink[0], sink[1] = float("inf"), float("-inf")
    case = make_sparse_case(8, 2, 128, 4096, 2048, 64, topk_length=[0, 1, 63, 64, 65, 1000, 2048, 5000],
                            attn_sink=sink, seed=3, kv_format=fmt)
    run_and_check(case, force=force, reuse=2)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("h_q", [16, 32])
def test_format_head_counts_below_64(fmt, h_q):
    run_and_check(make_sparse_case(6, 2, h_q, 1000, 512, 64, seed=h_q, kv_format=fmt), expect=dict(crossover=False))


@pytest.mark.parametrize("fmt", FORMATS)
def test_format_invalid_and_out_of_range_indices(fmt):
    run_and_check(make_sparse_case(16, 2, 64, 700, 320, 35, out_of_range=True, seed=9, kv_format=fmt))
    run_and_check(make_sparse_case(5, 1, 64, 300, 100, 16, seed=11, kv_format=fmt))  # topk not a multiple of 64
    out, lse = run_and_check(make_sparse_case(4, 2, 128, 512, 128, 64, invalid_frac=1.0, kv_format=fmt))
    assert torch.all(out == 0) and torch.all(torch.isposinf(lse))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("crossover", [False, True])
@pytest.mark.parametrize("kv_scale,q_scale", [(0.03, 1e4), (1e4, 1e-2)])
def test_format_fp16_operand_range_ends(fmt, crossover, kv_scale, q_scale):
    """The power-of-two scales at the ends of what the fp16 operands hold exactly: about 2^-13 with |q| near 10^3,
    and 2^5 with |q| near 10^-3 (V4's bf16 RoPE values near 10^3 convert to fp16 too)."""
    run_and_check(make_sparse_case(4, 3, 128, 4096, 2048, 64, kv_scale=kv_scale, q_scale=q_scale, seed=77,
                                   kv_format=fmt),
                  force=None if crossover else WHOLE_TILE, expect=dict(crossover=crossover),
                  magnitude_tol=kv_scale > 1)


def test_metadata_serves_one_format():
    """A metadata object bound by a V4 call refuses a V41 call of the same shape (another kernel)."""
    import mla_cute

    v4 = make_sparse_case(4, 1, 64, 512, 128, 64, seed=1, kv_format="V4")
    v41 = make_sparse_case(4, 1, 64, 512, 128, 64, seed=1, kv_format="V41")
    meta, _ = mla_cute.get_mla_metadata()
    kw = dict(block_table=None, cache_seqlens=None, head_dim_v=512, tile_scheduler_metadata=meta,
              is_fp8_kvcache=True, backend="cute")
    mla_cute.flash_mla_with_kvcache(**kw, **v4)
    with pytest.raises(ValueError, match="kv_format"):
        mla_cute.flash_mla_with_kvcache(**kw, **v41)
