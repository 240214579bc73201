"""Sparse decode over two caches in one call (``extra_k_cache``: V4's sliding-window cache beside its compressed
one), on the H200 against the reference: one softmax over both index sets, per format and for V4.1's FP4 extra
cache beside V41, with the extra cache's own page size and block count, lengths on either side (0 included),
sinks, each kernel variant, a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from gpu_cases import assert_close_flashmla, make_sparse_case
from test_sparse_decode_gpu import LSE_ABS, LSE_REL, OUT_ABS, OUT_COS, OUT_REL, WHOLE_TILE, run_and_check

pytestmark = pytest.mark.gpu

FORMATS = ["V32", "V32_NO_ROPE", "V4", "V41", "V41_PAGED"]


def with_extra(case, *, nb=20, page=32, topk=128, lengths=None, invalid_frac=0.1, seed=0, fmt=None):
    """``case`` (``make_sparse_case``'s) with an extra cache of format ``fmt`` (default its own): ``nb`` blocks of
    ``page`` tokens, ``topk`` random indices a query (a fraction -1, some past the cache), ``extra_topk_length``
    ``lengths``.  V41_FP4 rows span e2m1's range: per 16 values a scale from 2^-8 to 2^2."""
    from mla_cute.kv_formats import HEAD_DIM, quantize_kv_cache

    fmt = fmt or case.get("kv_format", "V32")
    gen = torch.Generator().manual_seed(seed)
    rows = (torch.randn(nb, page, 1, HEAD_DIM[fmt], generator=gen) * 0.1).clamp(-1, 1).bfloat16()
    if fmt == "V41_FP4":
        mag = torch.pow(2.0, torch.randint(-8, 3, (nb, page, 1, HEAD_DIM[fmt] // 16, 1), generator=gen).float())
        rows = (torch.randn(nb, page, 1, HEAD_DIM[fmt] // 16, 16, generator=gen) * mag).reshape(rows.shape)
        rows = (rows * 0.1).bfloat16()
    b, s_q = case["indices"].shape[:2]
    idx = torch.randint(0, nb * page, (b, s_q, topk), generator=gen, dtype=torch.int32)
    idx[torch.rand(idx.shape, generator=gen) < invalid_frac] = -1
    idx[torch.rand(idx.shape, generator=gen) < 0.05] = nb * page + 5  # past the extra cache: never read
    case = dict(case, extra_k_cache=quantize_kv_cache(rows.cuda(), fmt),
                extra_indices_in_kvcache=idx.cuda())
    if lengths is not None:
        case["extra_topk_length"] = torch.as_tensor(lengths, dtype=torch.int32).cuda()
    return case


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("h_q", [64, 128])
def test_extra_cache_per_format(fmt, h_q):
    """Another page size and block count, with and without lengths on both sides."""
    case = make_sparse_case(8, 2, h_q, 1024, 512, 64, seed=h_q, kv_format=fmt)
    run_and_check(with_extra(case, seed=1), expect=dict(extra_cache=fmt, crossover=h_q == 128))
    case = make_sparse_case(8, 2, h_q, 4096, 2048, 64, topk_length=[0, 1, 64, 65, 700, 2048, 5000, 0], seed=2,
                            kv_format=fmt)
    run_and_check(with_extra(case, page=16, topk=128, lengths=[128, 0, 64, 1, 0, 300, 77, 100], seed=3),
                  expect=dict(extra_cache=fmt), reuse=2)


@pytest.mark.parametrize("fmt", ["V41", "V41_PAGED"])
@pytest.mark.parametrize("h_q", [64, 128])
def test_extra_fp4_cache_beside_v41(fmt, h_q):
    """V4.1's FP4 extra cache (a second codec in the kernel) beside a V41 or V41_PAGED main cache: another page
    size, lengths on both sides, 0 included, an extra topk not a multiple of 64."""
    case = make_sparse_case(8, 2, h_q, 1024, 512, 64, seed=h_q + 1, kv_format=fmt)
    run_and_check(with_extra(case, seed=31, fmt="V41_FP4"), expect=dict(extra_cache="V41_FP4", crossover=h_q == 128))
    case = make_sparse_case(8, 2, h_q, 4096, 2048, 64, topk_length=[0, 1, 64, 65, 700, 2048, 5000, 0], seed=32,
                            kv_format=fmt)
    run_and_check(with_extra(case, page=16, topk=100, lengths=[100, 0, 64, 1, 0, 99, 77, 50], seed=33,
                             fmt="V41_FP4"), expect=dict(extra_cache="V41_FP4"), reuse=2)


@pytest.mark.parametrize("force", [WHOLE_TILE, dict(crossover=True, producer_halves=False),
                                   dict(crossover=True, producer_halves=True), dict(partials_16bit=True)],
                         ids=["whole-tile", "whole-producer", "producer-halves", "16bit-partials"])
def test_extra_fp4_cache_kernel_variants(force):
    """The FP4 extra cache through every kernel variant, with sinks; only the extra cache on some requests."""
    sink = torch.randn(128) * 2
    case = make_sparse_case(6, 2, 128, 4096, 1024, 64, topk_length=[1024, 0, 500, 3000, 64, 0], attn_sink=sink,
                            seed=35, kv_format="V41")
    run_and_check(with_extra(case, nb=9, page=64, topk=128, lengths=[128, 128, 0, 50, 1, 127], seed=36,
                             fmt="V41_FP4"), force=force)


@pytest.mark.parametrize("fmt", ["V32", "V4"])
@pytest.mark.parametrize("force", [WHOLE_TILE, dict(crossover=True, producer_halves=False),
                                   dict(crossover=True, producer_halves=True), dict(partials_16bit=True)],
                         ids=["whole-tile", "whole-producer", "producer-halves", "16bit-partials"])
def test_extra_cache_kernel_variants(fmt, force):
    """Every kernel variant, sinks of +-inf among finite ones, an extra topk not a multiple of 64."""
    sink = torch.randn(128) * 2
    sink[0], sink[1] = float("inf"), float("-inf")
    case = make_sparse_case(6, 2, 128, 4096, 1024, 64, topk_length=[1024, 0, 500, 3000, 64, 1], attn_sink=sink,
                            seed=5, kv_format=fmt)
    run_and_check(with_extra(case, nb=9, page=64, topk=100, lengths=[100, 100, 0, 50, 1, 99], seed=6), force=force)


@pytest.mark.parametrize("fmt", ["V32", "V41"])
def test_extra_cache_corners(fmt):
    """Nothing on either side (out 0, lse +inf), the extra cache alone, many requests split over parts."""
    case = make_sparse_case(4, 1, 64, 512, 128, 64, invalid_frac=1.0, kv_format=fmt)
    out, lse = run_and_check(with_extra(case, invalid_frac=1.0, seed=7))
    assert torch.all(out == 0) and torch.all(torch.isposinf(lse))
    case = make_sparse_case(4, 2, 128, 512, 128, 64, topk_length=[0, 0, 0, 0], kv_format=fmt, seed=8)
    run_and_check(with_extra(case, topk=256, seed=9))
    run_and_check(with_extra(make_sparse_case(74, 2, 128, 2046, 2048, 64, seed=10, kv_format=fmt), seed=11))
    run_and_check(with_extra(make_sparse_case(2, 1, 64, 8192, 4096, 64, seed=12, kv_format=fmt), topk=1024,
                             seed=13))


def _replay_and_check(graph, out, lse, kw, case):
    """Replay ``graph`` (which writes ``out`` and ``lse``) and compare them with the reference on ``case``."""
    import mla_cute

    graph.replay()
    torch.cuda.synchronize()
    ref_out, ref_lse = mla_cute.flash_mla_with_kvcache(
        tile_scheduler_metadata=mla_cute.get_mla_metadata()[0], backend="reference", **kw, **case)
    assert_close_flashmla("out", out, ref_out, OUT_ABS, OUT_REL, OUT_COS)
    assert_close_flashmla("lse", lse, ref_lse, LSE_ABS, LSE_REL)


def test_extra_cache_cuda_graph_replay():
    import mla_cute

    case = with_extra(make_sparse_case(16, 2, 128, 2048, 1024, 64, seed=17, kv_format="V4"),
                      lengths=[128] * 8 + [3] * 8, seed=18)
    meta, _ = mla_cute.get_mla_metadata()
    kw = dict(block_table=None, cache_seqlens=None, head_dim_v=512, is_fp8_kvcache=True)
    mla_cute.flash_mla_with_kvcache(tile_scheduler_metadata=meta, backend="cute", **kw, **case)  # compile first
    meta, _ = mla_cute.get_mla_metadata()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = mla_cute.flash_mla_with_kvcache(tile_scheduler_metadata=meta, backend="cute", **kw, **case)
    for seed in (21, 22):
        fresh = with_extra(make_sparse_case(16, 2, 128, 2048, 1024, 64, seed=seed, kv_format="V4"),
                           lengths=[128] * 8 + [3] * 8, seed=seed + 10)
        for k in ("q", "k_cache", "indices", "extra_k_cache", "extra_indices_in_kvcache"):
            case[k].copy_(fresh[k])
        _replay_and_check(graph, out, lse, kw, case)


@pytest.mark.parametrize("h_q", [64, 128])
@pytest.mark.parametrize("extra_page,extra_topk,with_lengths", [(64, 512, False), (2, 1024, True)],
                         ids=["window-page64", "window-page2-lengths"])
@pytest.mark.parametrize("b", [4, 74])
def test_v4_production_shapes(h_q, extra_page, extra_topk, with_lengths, b):
    """DeepSeek V4's call as FlashMLA's performance cases make it: topk 128 of a page-256 V4 cache beside a
    window cache of 512 or 1024 tokens on page 64, or on page 2 with extra_topk_length (0 and the full topk
    among them); sinks with +-inf; the metadata reused."""
    gen = torch.Generator().manual_seed(b * h_q + extra_page)
    sink = torch.randn(h_q, generator=gen)
    sink[0], sink[1] = float("inf"), float("-inf")
    case = make_sparse_case(b, 2, h_q, 2048, 128, 256, attn_sink=sink, seed=b + h_q, kv_format="V4")
    lengths = None
    if with_lengths:
        lengths = torch.randint(0, extra_topk + 1, (b,), generator=gen)
        lengths[0], lengths[-1] = 0, extra_topk
    run_and_check(with_extra(case, nb=4096 // extra_page, page=extra_page, topk=extra_topk, lengths=lengths,
                             seed=b + 1), expect=dict(extra_cache="V4", crossover=h_q == 128), reuse=2)


@pytest.mark.parametrize("h_q", [64, 128])
def test_extra_cache_graph_replays_lengths_written_in_place(h_q):
    """A graph captured once (metadata made inside the capture) and replayed after both caches' lengths are
    written in place: its scheduler plans the new lengths (it reads the tensors the call passed, no copy)."""
    import mla_cute

    b = 12
    case = with_extra(make_sparse_case(b, 2, h_q, 2048, 128, 256, topk_length=[128] * b, seed=31, kv_format="V4"),
                      nb=1024, page=2, topk=1024, lengths=[1024] * b, seed=32)
    kw = dict(block_table=None, cache_seqlens=None, head_dim_v=512, is_fp8_kvcache=True)
    mla_cute.flash_mla_with_kvcache(tile_scheduler_metadata=mla_cute.get_mla_metadata()[0], backend="cute", **kw,
                                    **case)  # compile first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        meta, _ = mla_cute.get_mla_metadata()
        out, lse = mla_cute.flash_mla_with_kvcache(tile_scheduler_metadata=meta, backend="cute", **kw, **case)
    gen = torch.Generator().manual_seed(33)
    for _ in range(2):
        case["topk_length"].copy_(torch.randint(0, 129, (b,), generator=gen))
        case["extra_topk_length"].copy_(torch.randint(0, 1025, (b,), generator=gen))
        _replay_and_check(graph, out, lse, kw, case)


# FlashMLA's sparse decode suite's (s_k, topk, page) shapes, for either cache.
FLASHMLA_SHAPES = [(512, 64, 2), (512, 64, 64), (512, 64, 69), (1024, 576, 2), (1024, 576, 61), (2046, 2048, 2),
                   (2046, 2048, 64), (2046, 2048, 576)]


@pytest.mark.parametrize("h_q", [64, 128])
@pytest.mark.parametrize("extra", range(len(FLASHMLA_SHAPES)))
def test_extra_cache_on_flashmlas_shapes(extra, h_q):
    """Each of FlashMLA's extra-cache shapes (its suite's pages 2, 61, 64, 69 and 576) beside a main shape of the
    same list, turn by turn, V4 (d_qk 512, the format its suite's two-cache cases use), s_q 3, with and without
    either side's lengths (0 and the full topk among them), sinks with +-inf."""
    s_k, topk, page = FLASHMLA_SHAPES[(extra * 3 + 1) % len(FLASHMLA_SHAPES)]
    e_s_k, e_topk, e_page = FLASHMLA_SHAPES[extra]
    b = 74 if extra % 2 else 4
    gen = torch.Generator().manual_seed(extra * 10 + h_q)
    sink = torch.randn(h_q, generator=gen)
    sink[0], sink[1] = float("inf"), float("-inf")
    main_len = None
    if extra % 4 in (1, 2):
        main_len = torch.randint(0, topk + 1, (b,), generator=gen)
        main_len[0], main_len[-1] = 0, topk
    extra_len = None
    if extra % 4 in (2, 3):
        extra_len = torch.randint(0, e_topk + 1, (b,), generator=gen)
        extra_len[0], extra_len[-1] = e_topk, 0
    case = make_sparse_case(b, 3, h_q, s_k, topk, page, attn_sink=sink, kv_format="V4", seed=extra + h_q,
                            topk_length=main_len.tolist() if main_len is not None else None)
    run_and_check(with_extra(case, nb=-(-e_s_k // e_page) * 2, page=e_page, topk=e_topk, lengths=extra_len,
                             seed=extra + 100), expect=dict(extra_cache="V4"))


@pytest.mark.parametrize("two_caches", [False, True])
def test_flashmlas_corner_cases_at_b_321(two_caches):
    """FlashMLA's corner cases: b 321, s_q 3, every index invalid in some requests, zero lengths, sinks; one cache
    (V3.2) or two (V4)."""
    fmt = "V4" if two_caches else "V32"
    gen = torch.Generator().manual_seed(321)
    lengths = torch.randint(0, 65, (321,), generator=gen)
    lengths[::7] = 0
    case = make_sparse_case(321, 3, 64, 512, 64, 61, invalid_frac=0.5, attn_sink=torch.randn(64, generator=gen),
                            topk_length=lengths.tolist(), kv_format=fmt, seed=322)
    case["indices"][::5] = -1  # every index of some requests invalid
    if two_caches:
        extra_len = torch.randint(0, 65, (321,), generator=gen)
        extra_len[1::7] = 0
        case = with_extra(case, nb=20, page=53, topk=64, lengths=extra_len, invalid_frac=0.5, seed=323)
        case["extra_indices_in_kvcache"][::5] = -1
    out, lse = run_and_check(case)
    nothing = (lengths == 0) if not two_caches else (lengths == 0) & (extra_len == 0)
    rows = torch.arange(321)[::5]
    if not two_caches:
        assert torch.all(out[rows] == 0) and torch.all(torch.isposinf(lse[rows]))
    assert torch.all(out[nothing.nonzero().flatten().tolist()] == 0)
