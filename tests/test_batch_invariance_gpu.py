"""Batch-invariant decode on the GPU (``enable_batch_invariant=True``): a request's out and lse are bit-identical
whatever batch it is in (alone, at another position, beside other lengths, inside a CUDA graph replayed with new
lengths), and close to the reference."""

from __future__ import annotations

import pytest
import torch

from gpu_cases import assert_close_flashmla, make_dense_case, make_sparse_case, poison_allocator
from test_sparse_extra_cache_gpu import with_extra

pytestmark = pytest.mark.gpu

# Requests long enough for several pieces (2048 tokens a dense piece, 512 a sparse one), one empty, one tile.
DENSE_LENGTHS = [5000, 0, 64, 33000, 1, 2047, 2049, 17000]
SPARSE_LENGTHS = [2048, 1, 600, 513, 64, 2000, 0, 1500]


def _take(case: dict, rows: list, shrink: dict = None) -> dict:
    """The call of requests ``rows`` (in that order) of ``case``; ``shrink``: {position: length} for lengths
    made shorter (the cache's poison stays past every original length)."""
    out = {}
    for key, val in case.items():
        if key in ("k_cache", "extra_k_cache", "kv_format", "attn_sink"):
            out[key] = val
        else:
            out[key] = val[rows].clone()
    for at, n in (shrink or {}).items():
        name = "cache_seqlens" if "cache_seqlens" in out else "topk_length"
        out[name][at] = min(int(out[name][at]), n)
    return out


def _call(case, **kw):
    import mla_cute

    meta = mla_cute.get_mla_metadata()[0]
    case = dict(block_table=None, cache_seqlens=None) | case  # sparse decode takes neither
    out, lse = mla_cute.flash_mla_with_kvcache(**case, head_dim_v=512, tile_scheduler_metadata=meta,
                                               enable_batch_invariant=True, **kw)
    torch.cuda.synchronize()
    return out, lse


def _batches(b: int, mine: int) -> list:
    """Batches that hold request ``mine``: (rows, its position, other lengths shrunk)."""
    others = [r for r in range(b) if r != mine]
    return [
        (list(range(b)), mine, None),
        ([mine], 0, None),
        (others[::-1] + [mine], b - 1, {0: 3, 1: 700}),
        ([mine] + others[:2], 0, {1: 0, 2: 100000}),
    ]


def _check_invariant(case, b, causal=False, reference_tol=None):
    import mla_cute

    base_out, base_lse = _call(case, causal=causal)
    if reference_tol is not None:
        ref = mla_cute.flash_mla_with_kvcache(**(dict(block_table=None, cache_seqlens=None) | case), head_dim_v=512,
                                              causal=causal,
                                              tile_scheduler_metadata=mla_cute.get_mla_metadata()[0],
                                              backend="reference")
        assert_close_flashmla("out", base_out, ref[0], *reference_tol[:3])
        assert_close_flashmla("lse", base_lse, ref[1], *reference_tol[3:])
    for mine in range(b):
        for rows, at, shrink in _batches(b, mine):
            poison_allocator()
            out, lse = _call(_take(case, rows, shrink), causal=causal)
            assert torch.equal(out[at], base_out[mine]), f"request {mine} in batch {rows}: out differs"
            assert torch.equal(lse[at], base_lse[mine]), f"request {mine} in batch {rows}: lse differs"
    return base_out, base_lse


@pytest.mark.parametrize("s_q,h_q,h_kv,causal", [(1, 128, 1, False), (2, 128, 1, True), (2, 64, 1, True),
                                                 (1, 16, 1, False), (2, 32, 2, True)])
def test_dense_request_bits_do_not_depend_on_the_batch(s_q, h_q, h_kv, causal):
    case = make_dense_case(len(DENSE_LENGTHS), s_q, 0, h_q, h_kv, lengths=DENSE_LENGTHS)
    _check_invariant(case, len(DENSE_LENGTHS), causal, reference_tol=(8e-4, 2.01 / 128, 5e-6, 1e-6, 8.01 / 65536))


@pytest.mark.parametrize("fmt,h_q", [("V32", 128), ("V32", 64), ("V4", 64)])
def test_sparse_request_bits_do_not_depend_on_the_batch(fmt, h_q):
    sink = torch.randn(h_q) * 2
    case = make_sparse_case(len(SPARSE_LENGTHS), 2, h_q, 4096, 2048, 64, topk_length=SPARSE_LENGTHS, attn_sink=sink,
                            seed=h_q, kv_format=fmt)
    _check_invariant(case, len(SPARSE_LENGTHS), reference_tol=(8e-4, 2.01 / 128, 5e-6, 1e-6, 8.01 / 65536))


def test_sparse_two_caches():
    """V4's shape: topk 128 on a page-256 cache beside an extra topk 512 on page 64, the extra lengths kept."""
    case = make_sparse_case(6, 2, 64, 1024, 128, 256, topk_length=[128, 1, 0, 64, 100, 128], seed=9, kv_format="V4")
    case = with_extra(case, nb=40, page=64, topk=512, lengths=[512, 0, 300, 512, 1, 65], seed=10)
    lengths = case.pop("extra_topk_length")
    base = _call(dict(case, extra_topk_length=lengths))
    for rows in ([5, 4, 3, 2, 1, 0], [2], [0, 3]):
        got = _call(dict(_take(case, rows), extra_topk_length=lengths[rows].clone()))
        for at, mine in enumerate(rows):
            assert torch.equal(got[0][at], base[0][mine]) and torch.equal(got[1][at], base[1][mine])


def test_dense_in_a_cuda_graph_replayed_with_new_lengths():
    """Captured once at b = 8, replayed after the lengths change in place: each request's bits are those of an
    eager call of that request alone."""
    import mla_cute

    case = make_dense_case(8, 2, 0, 128, 1, lengths=DENSE_LENGTHS)
    lens = case["cache_seqlens"]
    captured = dict(case, cache_seqlens=torch.full_like(lens, 64))
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode():
        static = captured["cache_seqlens"]
        with torch.cuda.graph(graph):
            out, lse = mla_cute.flash_mla_with_kvcache(**captured, head_dim_v=512, causal=True,
                                                       tile_scheduler_metadata=mla_cute.get_mla_metadata()[0],
                                                       enable_batch_invariant=True)
        for new in (lens, lens.flip(0).clamp(max=lens)):
            static.copy_(new)
            graph.replay()
            torch.cuda.synchronize()
            for i in range(8):
                alone = _call(dict(_take(case, [i]), cache_seqlens=new[i:i + 1].clone()), causal=True)
                assert torch.equal(out[i], alone[0][0]) and torch.equal(lse[i], alone[1][0]), f"request {i}"
