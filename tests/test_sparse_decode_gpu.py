"""Sparse FP8 decode kernel on the H200 against the reference on the dequantized cache
(FlashMLA's sparse grid, invalid and out-of-range indices, topk_length, attention sinks)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gpu_cases import assert_close_flashmla, magnitude_abs_tol, make_sparse_case, poison_allocator

pytestmark = pytest.mark.gpu

OUT_ABS, OUT_REL, OUT_COS = 8e-4, 2.01 / 128, 5e-6
LSE_ABS, LSE_REL = 1e-6, 8.01 / 65536


def run_and_check(case, *, reuse=1, schedule=None, magnitude_tol=False):
    """``schedule=None``: the whole-tile gather (no crossover), so the grid covers that path; the
    crossover (the default for h_q = 128) has its own tests below."""
    import mla_cute
    from mla_cute.schedules import NO_CROSSOVER_SPARSE_SCHEDULE

    schedule = schedule or NO_CROSSOVER_SPARSE_SCHEDULE

    ref_out, ref_lse = mla_cute.flash_mla_with_kvcache(
        block_table=None, cache_seqlens=None, head_dim_v=512, tile_scheduler_metadata=mla_cute.get_mla_metadata()[0],
        is_fp8_kvcache=True, backend="reference", **case,
    )
    meta, _ = mla_cute.get_mla_metadata()
    for _ in range(reuse):
        poison_allocator()
        out, lse = mla_cute.flash_mla_with_kvcache(
            block_table=None, cache_seqlens=None, head_dim_v=512, tile_scheduler_metadata=meta,
            is_fp8_kvcache=True, backend="cute", schedule=schedule, **case,
        )
        torch.cuda.synchronize()
        assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
        out_abs = magnitude_abs_tol(ref_out, OUT_ABS) if magnitude_tol else OUT_ABS
        assert_close_flashmla("out", out, ref_out, out_abs, OUT_REL, OUT_COS)
        assert_close_flashmla("lse", lse, ref_lse, LSE_ABS, LSE_REL)
    return out, lse


# FlashMLA's sparse decode grid: (s_k, topk, page) x b x s_q x h_q.
SHAPES = [(512, 64, 2), (512, 64, 64), (512, 64, 69), (1024, 576, 61), (2046, 2048, 64), (2046, 2048, 576)]
GRID = [(b, s_q, h_q, s_k, topk, page) for s_k, topk, page in SHAPES for b in (4, 74) for s_q in (1, 3)
        for h_q in (64, 128)]


@pytest.mark.parametrize("b,s_q,h_q,s_k,topk,page", GRID)
def test_sparse_grid(b, s_q, h_q, s_k, topk, page):
    run_and_check(make_sparse_case(b, s_q, h_q, s_k, topk, page, seed=b * 7 + s_q + h_q + topk))


@pytest.mark.parametrize("h_q", [16, 32, 256])
def test_head_counts_flashmla_lacks(h_q):
    run_and_check(make_sparse_case(6, 2, h_q, 1000, 512, 64, seed=h_q))


def test_all_indices_invalid():
    case = make_sparse_case(4, 2, 128, 512, 128, 64, invalid_frac=1.0)
    out, lse = run_and_check(case)
    assert torch.all(out == 0) and torch.all(torch.isposinf(lse))


def test_topk_length_and_sinks():
    """topk_length 0 / partial / beyond topk, and sinks of -inf, +inf and finite values, split and unsplit."""
    b, h_q = 8, 128
    sink = torch.randn(h_q) * 2
    sink[0], sink[1], sink[5] = float("inf"), float("-inf"), float("inf")
    for topk_len in ([0, 1, 63, 64, 65, 1000, 2048, 5000], [2048] * b):
        run_and_check(make_sparse_case(b, 2, h_q, 4096, 2048, 64, topk_length=topk_len, attn_sink=sink, seed=3),
                      reuse=2)


@pytest.mark.parametrize("partials_16bit", [False, True])
@pytest.mark.parametrize("b", [1, 2])
def test_sink_with_splits_and_few_requests(b, partials_16bit):
    """b <= 2 with long topk: every request is split over many CTAs, so the sink goes through the combine
    (its spread launch: 132 parts, at least 48 a request), with sinks of -inf and +inf among them; fp32
    partials, or 16-bit ones staged like the final rows."""
    from mla_cute.schedules import NO_CROSSOVER_SPARSE_SCHEDULE

    sink = torch.linspace(-3, 3, 64)
    sink[3], sink[7] = float("inf"), float("-inf")
    schedule = dataclasses.replace(NO_CROSSOVER_SPARSE_SCHEDULE, partials_16bit=partials_16bit)
    run_and_check(make_sparse_case(b, 1, 64, 8192, 4096, 64, attn_sink=sink, seed=5), schedule=schedule)


@pytest.mark.parametrize("b,s_q,topk_length", [(2, 2, None), (5, 1, [0, 1, 700, 2048, 3000])])
def test_crossover_16bit_partials(b, s_q, topk_length):
    """The crossover's leader-follower consumers with 16-bit partials (each split's rows staged in Q's
    bytes, the next request's Q loaded after their copies), h_q = 128, with and without topk_length."""
    from mla_cute.schedules import CROSSOVER_SPARSE_SCHEDULE

    schedule = dataclasses.replace(CROSSOVER_SPARSE_SCHEDULE, partials_16bit=True)
    run_and_check(make_sparse_case(b, s_q, 128, 4096, 2048, 64, topk_length=topk_length, seed=17), schedule=schedule,
                  reuse=2)


def test_out_of_range_indices_are_skipped():
    run_and_check(make_sparse_case(16, 2, 64, 700, 320, 35, out_of_range=True, seed=9))


def test_topk_not_multiple_of_64():
    run_and_check(make_sparse_case(5, 1, 64, 300, 100, 16, seed=11))


def test_non_contiguous_q():
    case = make_sparse_case(8, 2, 128, 512, 256, 64, seed=13)
    wide = torch.zeros(8, 2, 128, 640, dtype=torch.bfloat16, device="cuda")
    wide[..., :576] = case["q"]
    case["q"] = wide[..., :576]
    assert not case["q"].is_contiguous()
    run_and_check(case)


def test_cuda_graph_replays_sparse_step():
    import mla_cute

    case = make_sparse_case(16, 2, 128, 2048, 1024, 64, seed=17)
    meta, _ = mla_cute.get_mla_metadata()
    call = lambda: mla_cute.flash_mla_with_kvcache(  # noqa: E731
        block_table=None, cache_seqlens=None, head_dim_v=512, tile_scheduler_metadata=meta, is_fp8_kvcache=True,
        backend="cute", **case,
    )
    call()  # compile outside the capture
    meta, _ = mla_cute.get_mla_metadata()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = call()
    for seed in (21, 22):
        fresh = make_sparse_case(16, 2, 128, 2048, 1024, 64, seed=seed)
        for k in ("q", "k_cache", "indices"):
            case[k].copy_(fresh[k])
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = mla_cute.flash_mla_with_kvcache(
            block_table=None, cache_seqlens=None, head_dim_v=512,
            tile_scheduler_metadata=mla_cute.get_mla_metadata()[0], is_fp8_kvcache=True, backend="reference", **case,
        )
        assert_close_flashmla("out", out, ref_out, OUT_ABS, OUT_REL, OUT_COS)
        assert_close_flashmla("lse", lse, ref_lse, LSE_ABS, LSE_REL)


def _crossover():
    from mla_cute.schedules import CROSSOVER_SPARSE_SCHEDULE

    return CROSSOVER_SPARSE_SCHEDULE


@pytest.mark.parametrize("crossover", [False, True])
def test_scores_growing_past_the_max_slack(crossover):
    """Scores that grow along each query's topk order by hundreds in log2 units: the leader's running
    max, held while a tile stays within ``MAX_SLACK`` of it, must move again and again (a max held too
    long overflows 2^(S - max)), and O be rescaled mid-request.  The outputs reach the hundreds: the
    exact-max kernel measured the same largest error (one bf16 step)."""
    run_and_check(make_sparse_case(4, 2, 128, 4096, 2048, 64, invalid_frac=0.05, growing=True, seed=21),
                  schedule=_crossover() if crossover else None, magnitude_tol=True)


# The tests above run the whole-tile gather (each CTA gathers whole token tiles); those below pair
# the 64-head tiles of h_q = 128 and 256 in 2-CTA clusters (the crossover, the default) on the
# same cases.
@pytest.mark.parametrize("b,s_q,h_q,s_k,topk,page", [g for g in GRID if g[2] == 128])
def test_crossover_grid(b, s_q, h_q, s_k, topk, page):
    run_and_check(make_sparse_case(b, s_q, h_q, s_k, topk, page, seed=b * 7 + s_q + h_q + topk),
                  schedule=_crossover())


@pytest.mark.parametrize("consumer,handover,operands", [
    ("leader_follower", "bulk", "fp16"), ("serial", "bulk", "fp16"), ("leader_follower", "st_async", "fp16"),
    ("serial", "st_async", "fp16"), ("leader_follower", "bulk", "bf16"), ("serial", "bulk", "bf16"),
    ("leader_follower", "bulk_halves", "fp16"), ("leader_follower", "bulk_halves", "bf16")])
def test_crossover_corners(consumer, handover, operands):
    """Sinks and topk_length (split and unsplit), out-of-range indices, all invalid, h_q = 256; with
    each consumer split, each hand-over to the peer (bulk copies from the whole producer warpgroup or from
    producer halves, or st.async stores) and each operand type."""
    from mla_cute.schedules import SparseDecodeSchedule

    schedule = SparseDecodeSchedule(crossover=True, leader_follower=consumer == "leader_follower",
                                    peer_bulk_copy=handover != "st_async", producer_halves=handover == "bulk_halves",
                                    fp16_operands=operands == "fp16")
    sink = torch.randn(128) * 2
    sink[0], sink[1] = float("inf"), float("-inf")
    run_and_check(make_sparse_case(8, 2, 128, 4096, 2048, 64, topk_length=[0, 1, 63, 64, 65, 1000, 2048, 5000],
                                   attn_sink=sink, seed=3), schedule=schedule, reuse=2)
    run_and_check(make_sparse_case(2, 1, 128, 8192, 4096, 64, attn_sink=sink, seed=5), schedule=schedule)
    run_and_check(make_sparse_case(16, 2, 128, 700, 320, 35, out_of_range=True, seed=9), schedule=schedule)
    out, lse = run_and_check(make_sparse_case(4, 2, 128, 512, 128, 64, invalid_frac=1.0), schedule=schedule)
    assert torch.all(out == 0) and torch.all(torch.isposinf(lse))
    run_and_check(make_sparse_case(6, 2, 256, 1000, 512, 64, seed=256), schedule=schedule)


@pytest.mark.parametrize("crossover", [False, True])
@pytest.mark.parametrize("kv_scale,q_scale", [(0.03, 1e4), (1e5, 1e-2)])
def test_fp16_operand_range_ends(crossover, kv_scale, q_scale):
    """The fp16 operands (the default) at the ends of their exact range: 128-value blocks whose amax makes
    the scale about 2^-15 with |q| near 10^3, and about 2^7 with |q| near 10^-3 (the scores stay moderate;
    outputs in the thousands take the magnitude tolerance)."""
    run_and_check(make_sparse_case(4, 3, 128, 4096, 2048, 64, kv_scale=kv_scale, q_scale=q_scale, seed=77),
                  schedule=_crossover() if crossover else None, magnitude_tol=kv_scale > 1)


# The serial consumer (both warpgroups compute S) on the whole-tile gather: part of the grid
# (b = 4, s_q = 3), then with sinks and topk_length, so the split that is not the default stays tested.
@pytest.mark.parametrize("b,s_q,h_q,s_k,topk,page", [g for g in GRID if g[0] == 4 and g[1] == 3][:6])
def test_serial_consumer_grid(b, s_q, h_q, s_k, topk, page):
    from mla_cute.schedules import SparseDecodeSchedule

    serial = SparseDecodeSchedule(crossover=False, leader_follower=False)
    run_and_check(make_sparse_case(b, s_q, h_q, s_k, topk, page, seed=b * 5 + s_q + h_q + topk), schedule=serial)
    sink = torch.randn(h_q) * 2
    run_and_check(make_sparse_case(b, s_q, h_q, s_k, topk, page, topk_length=[0, 1, 65, topk][:b], attn_sink=sink,
                                   seed=b + topk), schedule=serial)
