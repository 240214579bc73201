"""Sparse FP8 decode kernel on the H200 against the reference on the dequantized cache
(FlashMLA's sparse grid, invalid and out-of-range indices, topk_length, attention sinks)."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from gpu_cases import assert_close_flashmla, magnitude_abs_tol, make_sparse_case, poison_allocator

pytestmark = pytest.mark.gpu

OUT_ABS, OUT_REL, OUT_COS = 8e-4, 2.01 / 128, 5e-6
LSE_ABS, LSE_REL = 1e-6, 8.01 / 65536


@contextlib.contextmanager
def forced_split(**fields):
    """Inside the block, the cute backend's sparse calls run the split config the resolver returns with
    ``fields`` replaced (the step's and the capture step's), through the rest of the runtime path: the plan,
    its workspace (16-bit partials follow the config) and the launch.  For kernel variants the resolver picks
    for other shapes or plans (the whole-tile gather where the head tiles pair, the crossover with or without
    producer halves, 16-bit partials)."""
    import mla_cute.backends.cute as backend

    real = backend.resolve_sparse

    def force(step):
        return dataclasses.replace(step, split=dataclasses.replace(step.split, **fields))

    def resolve(*args, **kwargs):
        call = real(*args, **kwargs)
        return dataclasses.replace(call, step=force(call.step), capture_step=force(call.capture_step))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(backend, "resolve_sparse", resolve)
        yield


# The whole-tile gather (each CTA gathers all 64 rows of a token tile), forced where the 64-head tiles pair.
WHOLE_TILE = dict(crossover=False, producer_halves=False)


def run_and_check(case, *, reuse=1, force=None, expect=None, magnitude_tol=False):
    """The cute backend against the reference on ``case``, with the kernel the resolver picks, or with the
    split config's fields ``force`` replaced (``forced_split``); the split config the calls ran must have the
    fields ``force`` and ``expect``."""
    import mla_cute

    ref_out, ref_lse = mla_cute.flash_mla_with_kvcache(
        block_table=None, cache_seqlens=None, head_dim_v=512, tile_scheduler_metadata=mla_cute.get_mla_metadata()[0],
        is_fp8_kvcache=True, backend="reference", **case,
    )
    with forced_split(**force) if force else contextlib.nullcontext():
        meta, _ = mla_cute.get_mla_metadata()
        for _ in range(reuse):
            poison_allocator()
            out, lse = mla_cute.flash_mla_with_kvcache(
                block_table=None, cache_seqlens=None, head_dim_v=512, tile_scheduler_metadata=meta,
                is_fp8_kvcache=True, backend="cute", **case,
            )
            torch.cuda.synchronize()
            assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
            out_abs = magnitude_abs_tol(ref_out, OUT_ABS) if magnitude_tol else OUT_ABS
            assert_close_flashmla("out", out, ref_out, out_abs, OUT_REL, OUT_COS)
            assert_close_flashmla("lse", lse, ref_lse, LSE_ABS, LSE_REL)
    plan = meta._state["sparse"]
    split = plan.config.step.split
    for name, value in {**(expect or {}), **(force or {})}.items():
        assert getattr(split, name) == value, f"{name}: the calls ran {split}"
    assert plan.o_accum.dtype == (torch.bfloat16 if split.partials_16bit else torch.float32)
    return out, lse


# FlashMLA's sparse decode grid: (s_k, topk, page) x b x s_q x h_q.
SHAPES = [(512, 64, 2), (512, 64, 64), (512, 64, 69), (1024, 576, 61), (2046, 2048, 64), (2046, 2048, 576)]
GRID = [(b, s_q, h_q, s_k, topk, page) for s_k, topk, page in SHAPES for b in (4, 74) for s_q in (1, 3)
        for h_q in (64, 128)]


@pytest.mark.parametrize("b,s_q,h_q,s_k,topk,page", GRID)
def test_sparse_grid(b, s_q, h_q, s_k, topk, page):
    """The resolver's kernels: the whole-tile gather at h_q = 64, the crossover at h_q = 128."""
    run_and_check(make_sparse_case(b, s_q, h_q, s_k, topk, page, seed=b * 7 + s_q + h_q + topk),
                  expect=dict(crossover=h_q == 128))


# The whole-tile gather on the h_q = 128 cases, where the resolver takes the crossover: two head tiles a CTA
# grid row, each gathering every token tile itself.
@pytest.mark.parametrize("b,s_q,h_q,s_k,topk,page", [g for g in GRID if g[2] == 128])
def test_whole_tile_gather_grid(b, s_q, h_q, s_k, topk, page):
    run_and_check(make_sparse_case(b, s_q, h_q, s_k, topk, page, seed=b * 7 + s_q + h_q + topk), force=WHOLE_TILE)


@pytest.mark.parametrize("h_q,force", [(16, None), (32, None), (256, None), (256, WHOLE_TILE)],
                         ids=["16", "32", "256", "256-whole-tile"])
def test_head_counts_flashmla_lacks(h_q, force):
    run_and_check(make_sparse_case(6, 2, h_q, 1000, 512, 64, seed=h_q), force=force,
                  expect=dict(crossover=h_q == 256 and force is None))


@pytest.mark.parametrize("force", [None, WHOLE_TILE], ids=["crossover", "whole-tile"])
def test_all_indices_invalid(force):
    case = make_sparse_case(4, 2, 128, 512, 128, 64, invalid_frac=1.0)
    out, lse = run_and_check(case, force=force)
    assert torch.all(out == 0) and torch.all(torch.isposinf(lse))


@pytest.mark.parametrize("force", [None, WHOLE_TILE], ids=["crossover", "whole-tile"])
def test_topk_length_and_sinks(force):
    """topk_length 0 / partial / beyond topk, and sinks of -inf, +inf and finite values, split and unsplit."""
    b, h_q = 8, 128
    sink = torch.randn(h_q) * 2
    sink[0], sink[1], sink[5] = float("inf"), float("-inf"), float("inf")
    for topk_len in ([0, 1, 63, 64, 65, 1000, 2048, 5000], [2048] * b):
        run_and_check(make_sparse_case(b, 2, h_q, 4096, 2048, 64, topk_length=topk_len, attn_sink=sink, seed=3),
                      reuse=2, force=force)


@pytest.mark.parametrize("partials_16bit", [False, True])
@pytest.mark.parametrize("b", [1, 2])
def test_sink_with_splits_and_few_requests(b, partials_16bit):
    """b <= 2 with long topk: every request is split over many CTAs, so the sink goes through the combine
    (its spread launch: 132 parts, at least 48 a request), with sinks of -inf and +inf among them; fp32
    partials, or 16-bit ones staged like the final rows (the resolver's choice for b = 2, a small plan, forced
    on b = 1, and fp32 forced on b = 2)."""
    sink = torch.linspace(-3, 3, 64)
    sink[3], sink[7] = float("inf"), float("-inf")
    run_and_check(make_sparse_case(b, 1, 64, 8192, 4096, 64, attn_sink=sink, seed=5),
                  force=dict(partials_16bit=partials_16bit), expect=dict(crossover=False))


@pytest.mark.parametrize("b,s_q,topk_length", [(2, 2, None), (5, 1, [0, 1, 700, 2048, 3000])])
def test_crossover_16bit_partials(b, s_q, topk_length):
    """The crossover's leader-follower consumers with 16-bit partials (each split's rows staged in Q's
    bytes, the next request's Q loaded after their copies), h_q = 128, with and without topk_length: small
    plans (3 tiles a part), for which the resolver takes them, with the whole producer warpgroup on each tile."""
    run_and_check(make_sparse_case(b, s_q, 128, 4096, 2048, 64, topk_length=topk_length, seed=17), reuse=2,
                  expect=dict(crossover=True, producer_halves=False, partials_16bit=True))


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


@pytest.mark.parametrize("fmt", ["V32", "V4", "V41"])
def test_cuda_graph_replays_sparse_step(fmt):
    import mla_cute

    case = make_sparse_case(16, 2, 128, 2048, 1024, 64, seed=17, kv_format=fmt)
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
        fresh = make_sparse_case(16, 2, 128, 2048, 1024, 64, seed=seed, kv_format=fmt)
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


@pytest.mark.parametrize("crossover", [False, True])
def test_scores_growing_past_the_max_slack(crossover):
    """Scores that grow along each query's topk order by hundreds in log2 units: the leader's running
    max, held while a tile stays within ``MAX_SLACK`` of it, must move again and again (a max held too
    long overflows 2^(S - max)), and O be rescaled mid-request.  The outputs reach the hundreds: the
    exact-max kernel measured the same largest error (one bf16 step)."""
    run_and_check(make_sparse_case(4, 2, 128, 4096, 2048, 64, invalid_frac=0.05, growing=True, seed=21),
                  force=None if crossover else WHOLE_TILE, expect=dict(crossover=crossover), magnitude_tol=True)


@pytest.mark.parametrize("halves", [False, True], ids=["whole-producer", "producer-halves"])
def test_crossover_corners(halves):
    """Sinks and topk_length (split and unsplit), out-of-range indices, all invalid, h_q = 256, on the
    crossover with each hand-over to the peer: bulk copies from the whole producer warpgroup (the resolver's
    for small plans) or from producer halves (for the others), forced on every case here."""
    force = dict(crossover=True, producer_halves=halves)
    sink = torch.randn(128) * 2
    sink[0], sink[1] = float("inf"), float("-inf")
    run_and_check(make_sparse_case(8, 2, 128, 4096, 2048, 64, topk_length=[0, 1, 63, 64, 65, 1000, 2048, 5000],
                                   attn_sink=sink, seed=3), force=force, reuse=2)
    run_and_check(make_sparse_case(2, 1, 128, 8192, 4096, 64, attn_sink=sink, seed=5), force=force)
    run_and_check(make_sparse_case(16, 2, 128, 700, 320, 35, out_of_range=True, seed=9), force=force)
    out, lse = run_and_check(make_sparse_case(4, 2, 128, 512, 128, 64, invalid_frac=1.0), force=force)
    assert torch.all(out == 0) and torch.all(torch.isposinf(lse))
    run_and_check(make_sparse_case(6, 2, 256, 1000, 512, 64, seed=256), force=force)


@pytest.mark.parametrize("crossover", [False, True])
@pytest.mark.parametrize("kv_scale,q_scale", [(0.03, 1e4), (1e5, 1e-2)])
def test_fp16_operand_range_ends(crossover, kv_scale, q_scale):
    """The fp16 operands at the ends of their exact range: 128-value blocks whose amax makes the scale about
    2^-15 with |q| near 10^3, and about 2^7 with |q| near 10^-3 (the scores stay moderate; outputs in the
    thousands take the magnitude tolerance)."""
    run_and_check(make_sparse_case(4, 3, 128, 4096, 2048, 64, kv_scale=kv_scale, q_scale=q_scale, seed=77),
                  force=None if crossover else WHOLE_TILE, expect=dict(crossover=crossover),
                  magnitude_tol=kv_scale > 1)
