"""The reference backend against an independent, token-by-token float64 formulation.

The naive functions below deliberately share no code with ``mla_cute.backends.reference``:
they walk the block table one token at a time and do a two-pass softmax per query token,
so a shared misunderstanding of paging, masking or the sink cannot cancel out.
"""

import math

import pytest
import torch

import mla_cute
from mla_cute.schedules import DenseDecodeSchedule, num_sm_parts_for, plan_splits, resolve_dense

INF = float("inf")
D_QK, D_V = 576, 512
# FlashMLA's poison for block-table entries past each request's length.
UNUSED_BLOCK = 2147480000


# ----------------------------------------------------------------------------- naive math


def naive_attend(q_heads, keys, scale):
    """q_heads [h_q, d] f64 (d 576, or 512 for latent-only rows); keys: list of [h_kv, d] f64 rows, one per visible key.

    Head h reads KV head h // (h_q // h_kv).  Returns (out [h_q, 512], lse [h_q], max [h_q]).
    """
    h_q = q_heads.shape[0]
    if not keys:
        z = torch.zeros(h_q, dtype=torch.float64)
        return torch.zeros(h_q, D_V, dtype=torch.float64), z + INF, z - INF
    h_kv = keys[0].shape[0]
    qg = q_heads.view(h_kv, h_q // h_kv, q_heads.shape[-1])
    scores = [(qg * k[:, None, :]).sum(-1).reshape(h_q) * scale for k in keys]
    m = scores[0]
    for s in scores[1:]:
        m = torch.maximum(m, s)
    denom = torch.zeros(h_q, dtype=torch.float64)
    acc = torch.zeros(h_kv, h_q // h_kv, D_V, dtype=torch.float64)
    for s, k in zip(scores, keys):
        p = torch.exp(s - m)
        denom += p
        acc += p.view(h_kv, -1, 1) * k[:, None, :D_V]
    return acc.reshape(h_q, D_V) / denom[:, None], m + torch.log(denom), m


def naive_sink(out, lse, sink):
    """out *= exp(lse) / (exp(lse) + exp(sink)) per head; nothing attended stays 0."""
    if sink is None:
        return out
    factor = 1.0 / (1.0 + torch.exp(sink.double() - lse))
    factor = torch.where(torch.isinf(lse), 0.0, factor)
    return out * factor[:, None]


def naive_dense(q, k_cache, block_table, seqlens, scale, causal):
    b, s_q, h_q, _ = q.shape
    page = k_cache.shape[1]
    cache = k_cache.double()
    q64 = q.double()
    bt, lens = block_table.tolist(), seqlens.tolist()
    out = torch.zeros(b, s_q, h_q, D_V, dtype=torch.float64)
    lse = torch.full((b, h_q, s_q), INF, dtype=torch.float64)
    for i in range(b):
        n = lens[i]
        for t in range(s_q):
            visible = max(n - (s_q - 1 - t), 0) if causal else n
            keys = [cache[bt[i][j // page], j % page] for j in range(visible)]
            o, l, _ = naive_attend(q64[i, t], keys, scale)
            out[i, t], lse[i, :, t] = o, l
    return out, lse


def naive_sparse_decode(q, kv_tokens, indices, scale, topk_length=None, attn_sink=None):
    """kv_tokens [num_tokens, 576] (the flattened cache)."""
    b, s_q, h_q, _ = q.shape
    n_tok = kv_tokens.shape[0]
    kv = kv_tokens.double()
    q64 = q.double()
    idx = indices.tolist()
    out = torch.zeros(b, s_q, h_q, D_V, dtype=torch.float64)
    lse = torch.full((b, h_q, s_q), INF, dtype=torch.float64)
    for i in range(b):
        limit = len(idx[i][0]) if topk_length is None else int(topk_length[i])
        for t in range(s_q):
            keys = [kv[j][None] for j in idx[i][t][: max(limit, 0)] if 0 <= j < n_tok]
            o, l, _ = naive_attend(q64[i, t], keys, scale)
            out[i, t], lse[i, :, t] = naive_sink(o, l, attn_sink), l
    return out, lse


def naive_sparse_prefill(q, kv, indices, scale, topk_length=None, attn_sink=None):
    s_q, h_q, d_qk = q.shape
    s_kv = kv.shape[0]
    kv64 = kv.double().reshape(s_kv, d_qk)
    q64 = q.double()
    idx = indices.tolist()
    out = torch.zeros(s_q, h_q, D_V, dtype=torch.float64)
    lse = torch.empty(s_q, h_q, dtype=torch.float64)
    mx = torch.empty(s_q, h_q, dtype=torch.float64)
    for t in range(s_q):
        limit = len(idx[t][0]) if topk_length is None else int(topk_length[t])
        keys = [kv64[j][None] for j in idx[t][0][: max(limit, 0)] if 0 <= j < s_kv]
        o, l, m = naive_attend(q64[t], keys, scale)
        out[t], lse[t], mx[t] = naive_sink(o, l, attn_sink), l, m
    return out, mx, lse


# ----------------------------------------------------------------------------- inputs


def make_paged_cache(lens, page, h_kv, dtype, gen, extra_blocks=2):
    """A cache with NaN everywhere but the valid rows, blocks shuffled, unused table entries poisoned."""
    needed = [math.ceil(n / page) for n in lens]
    max_blocks = max(max(needed), 1) + 1  # one spare column, always unused
    num_blocks = sum(needed) + extra_blocks
    cache = torch.full((num_blocks, page, h_kv, D_QK), float("nan"), dtype=dtype)
    table = torch.full((len(lens), max_blocks), UNUSED_BLOCK, dtype=torch.int32)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    for i, n in enumerate(lens):
        for j in range(needed[i]):
            blk = perm.pop()
            table[i, j] = blk
            rows = min(page, n - j * page)
            cache[blk, :rows] = torch.randn(rows, h_kv, D_QK, generator=gen).to(dtype)
    return cache, table


def make_q(b, s_q, h_q, dtype, gen):
    return torch.randn(b, s_q, h_q, D_QK, generator=gen).to(dtype)


def seqlens(lens):
    return torch.tensor(lens, dtype=torch.int32)


def run_dense(q, cache, table, lens_t, causal=False, softmax_scale=None, is_fp8=False):
    meta, _ = mla_cute.get_mla_metadata()
    return mla_cute.flash_mla_with_kvcache(
        q, cache, table, lens_t, D_V, meta, softmax_scale=softmax_scale, causal=causal,
        is_fp8_kvcache=is_fp8, backend="reference",
    )


def check_out(out, ref, dtype):
    # The reference rounds its fp32 result to q's dtype once; the naive loop is float64.
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def check_lse(lse, ref):
    torch.testing.assert_close(lse, ref.float(), atol=1e-4, rtol=0)


def check_dense_result(out, lse, q, ref_out, ref_lse):
    b, s_q, h_q, _ = q.shape
    assert out.dtype == q.dtype and out.shape == (b, s_q, h_q, D_V)
    assert lse.dtype == torch.float32 and lse.shape == (b, h_q, s_q)
    check_out(out, ref_out, q.dtype)
    check_lse(lse, ref_lse)
    # Rows with nothing to attend must be exact, not merely close.
    empty = torch.isinf(ref_lse).transpose(1, 2)  # [b, s_q, h_q]
    assert torch.all(out[empty] == 0)


# ----------------------------------------------------------------------------- dense decode


HEADS = [(1, 1), (3, 1), (3, 3), (63, 1), (63, 3), (128, 1), (128, 2)]
QUERY_MODES = [(1, False), (2, True), (4, True), (4, False)]


@pytest.mark.parametrize("h_q,h_kv", HEADS)
@pytest.mark.parametrize("s_q,causal", QUERY_MODES)
def test_dense_heads_and_causal(h_q, h_kv, s_q, causal):
    gen = torch.Generator().manual_seed(1000 * h_q + 10 * h_kv + s_q)
    # 0 (empty), shorter than s_q (causal rows with no key), a page boundary, and ragged.
    lens = [0, 2, 64, int(torch.randint(65, 140, (1,), generator=gen))]
    cache, table = make_paged_cache(lens, 64, h_kv, torch.bfloat16, gen)
    q = make_q(len(lens), s_q, h_q, torch.bfloat16, gen)
    out, lse = run_dense(q, cache, table, seqlens(lens), causal=causal)
    ref_out, ref_lse = naive_dense(q, cache, table, seqlens(lens), D_QK**-0.5, causal and s_q > 1)
    check_dense_result(out, lse, q, ref_out, ref_lse)


@pytest.mark.parametrize("page", [1, 16, 64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_dense_page_sizes_and_dtypes(page, dtype, causal):
    gen = torch.Generator().manual_seed(page * 7 + (dtype == torch.float16) + 2 * causal)
    lens = [37, 0, 1, 100]
    h_q, h_kv, s_q = 6, 2, 2
    cache, table = make_paged_cache(lens, page, h_kv, dtype, gen)
    q = make_q(len(lens), s_q, h_q, dtype, gen)
    out, lse = run_dense(q, cache, table, seqlens(lens), causal=causal)
    ref_out, ref_lse = naive_dense(q, cache, table, seqlens(lens), D_QK**-0.5, causal)
    check_dense_result(out, lse, q, ref_out, ref_lse)


@pytest.mark.parametrize("s_q,causal", [(1, False), (2, True)])
def test_dense_all_lengths_zero(s_q, causal):
    gen = torch.Generator().manual_seed(5)
    lens = [0, 0, 0]
    cache, table = make_paged_cache(lens, 64, 1, torch.bfloat16, gen)
    q = make_q(3, s_q, 4, torch.bfloat16, gen)
    out, lse = run_dense(q, cache, table, seqlens(lens), causal=causal)
    assert torch.all(out == 0) and out.shape == (3, s_q, 4, D_V)
    assert torch.all(lse == INF)


def test_dense_causal_visibility_is_bottom_right():
    # Query t of s_q=4 sees len-(3-t) keys: with len 2, queries 0 and 1 see nothing.
    gen = torch.Generator().manual_seed(6)
    lens = [2, 3, 4]
    cache, table = make_paged_cache(lens, 16, 1, torch.bfloat16, gen)
    q = make_q(3, 4, 2, torch.bfloat16, gen)
    out, lse = run_dense(q, cache, table, seqlens(lens), causal=True)
    empty = torch.isinf(lse)  # [b, h, s_q]
    expect = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(empty, expect[:, None, :].expand_as(empty))
    # The last query of each request sees the whole cache, as if not causal.
    full_out, full_lse = run_dense(q, cache, table, seqlens(lens), causal=False)
    assert torch.equal(out[:, -1], full_out[:, -1]) and torch.equal(lse[..., -1], full_lse[..., -1])


# Every plan the host knows takes 4-CTA clusters (a KV head of 256 query heads has 4 M tiles at s_q = 1), and
# with them the idle-SM fill's parts: the plan with the most per-call choices.
QUAD_PLAN = DenseDecodeSchedule(quad_multicast_tiles=0)


@pytest.mark.parametrize("h_q,schedule", [(3, None), (256, QUAD_PLAN)])
def test_dense_causal_ignored_for_single_query(h_q, schedule):
    # FlashMLA drops causal when s_q == 1.  Its bottom-right mask hides no key from a single query anyway, so
    # out and lse cannot tell; what can is the metadata, which must be planned as for causal=False.
    gen = torch.Generator().manual_seed(7)
    lens = [5, 70]
    if schedule is QUAD_PLAN:
        call = resolve_dense(schedule, dtype="bfloat16", s_q=1, h_q=h_q, h_kv=1, causal=True, page=64,
                             host_lengths=seqlens(lens))
        assert (call.step.split.cluster_ctas, call.fill_parts, call.step.split.causal) == (4, 3, False)
    cache, table = make_paged_cache(lens, 64, 1, torch.bfloat16, gen)
    q = make_q(2, 1, h_q, torch.bfloat16, gen)
    results = []
    for causal in (True, False):
        meta, _ = mla_cute.get_mla_metadata()
        out, lse = mla_cute.flash_mla_with_kvcache(q, cache, table, seqlens(lens), D_V, meta, causal=causal,
                                                   schedule=schedule, backend="reference")
        results.append((out, lse, meta.tile_scheduler_metadata, meta.num_splits))
    (out, lse, tsm, splits), (out_nc, lse_nc, tsm_nc, splits_nc) = results
    assert torch.equal(out, out_nc) and torch.equal(lse, lse_nc)
    assert torch.equal(tsm, tsm_nc) and torch.equal(splits, splits_nc), "metadata planned for a causal s_q = 1"
    ref_out, ref_lse = naive_dense(q, cache, table, seqlens(lens), D_QK**-0.5, False)
    check_dense_result(out, lse, q, ref_out, ref_lse)


@pytest.mark.parametrize("layout", ["head_stride", "dim_slice", "transposed"])
def test_dense_noncontiguous_q(layout):
    gen = torch.Generator().manual_seed(8)
    b, s_q, h_q = 2, 2, 4
    lens = [30, 77]
    cache, table = make_paged_cache(lens, 16, 2, torch.bfloat16, gen)
    if layout == "head_stride":
        q = make_q(b, s_q, 2 * h_q, torch.bfloat16, gen)[:, :, ::2]
    elif layout == "dim_slice":
        q = torch.randn(b, s_q, h_q, 640, generator=gen).bfloat16()[..., 64:]
    else:
        q = make_q(b, h_q, s_q, torch.bfloat16, gen).transpose(1, 2)
    assert not q.is_contiguous()
    out, lse = run_dense(q, cache, table, seqlens(lens), causal=True)
    ref_out, ref_lse = naive_dense(q, cache, table, seqlens(lens), D_QK**-0.5, True)
    check_dense_result(out, lse, q, ref_out, ref_lse)
    c_out, c_lse = run_dense(q.contiguous(), cache, table, seqlens(lens), causal=True)
    assert torch.equal(out, c_out) and torch.equal(lse, c_lse)


def test_dense_custom_softmax_scale():
    gen = torch.Generator().manual_seed(9)
    lens = [50, 3]
    cache, table = make_paged_cache(lens, 64, 1, torch.bfloat16, gen)
    q = make_q(2, 1, 4, torch.bfloat16, gen)
    out, lse = run_dense(q, cache, table, seqlens(lens), softmax_scale=0.1)
    ref_out, ref_lse = naive_dense(q, cache, table, seqlens(lens), 0.1, False)
    check_dense_result(out, lse, q, ref_out, ref_lse)


def test_dense_fp8_cache():
    gen = torch.Generator().manual_seed(10)
    lens = [90, 0, 17]
    cache16, table = make_paged_cache(lens, 64, 1, torch.bfloat16, gen)
    fp8 = mla_cute.quantize_kv_cache(torch.nan_to_num(cache16))
    q = make_q(3, 2, 8, torch.bfloat16, gen)
    out, lse = run_dense(q, fp8, table, seqlens(lens), causal=True, is_fp8=True)
    deq = mla_cute.dequantize_kv_cache(fp8)
    ref_out, ref_lse = naive_dense(q, deq, table, seqlens(lens), D_QK**-0.5, True)
    check_dense_result(out, lse, q, ref_out, ref_lse)


# ----------------------------------------------------------------------------- key chunks


@pytest.fixture
def small_chunks(monkeypatch):
    """The reference reads its keys 16 at a time, so these small cases cross many chunk boundaries."""
    from mla_cute.backends import reference

    monkeypatch.setattr(reference, "_CHUNK", 16)


@pytest.mark.parametrize("s_q,causal", [(1, False), (4, True)])
def test_dense_across_key_chunks(small_chunks, s_q, causal):
    gen = torch.Generator().manual_seed(20 + s_q)
    # Inside one chunk, exactly one, one past it, and many chunks with a ragged last one.
    lens = [0, 3, 16, 17, 150]
    cache, table = make_paged_cache(lens, 16, 2, torch.bfloat16, gen)
    q = make_q(len(lens), s_q, 6, torch.bfloat16, gen)
    q[-1, :, :, :] *= 4  # sharper softmax: the running max moves between chunks
    out, lse = run_dense(q, cache, table, seqlens(lens), causal=causal)
    ref_out, ref_lse = naive_dense(q, cache, table, seqlens(lens), D_QK**-0.5, causal)
    check_dense_result(out, lse, q, ref_out, ref_lse)


@pytest.mark.parametrize("topk", [8, 40])  # two query tokens a chunk; three chunks over topk
def test_sparse_across_key_chunks(small_chunks, topk):
    gen = torch.Generator().manual_seed(30 + topk)
    fp8, tokens = make_fp8_cache(4, 16, gen)
    b, s_q, h_q = 3, 2, 8
    q = make_q(b, s_q, h_q, torch.bfloat16, gen) * 4
    indices = make_sparse_indices(b, s_q, topk, tokens.shape[0], gen)
    indices[1, 0, : min(16, topk - 1)] = -1  # a row whose first chunk holds nothing valid
    topk_length = torch.tensor([topk, topk, 5], dtype=torch.int32)
    sink = torch.randn(h_q, generator=gen)
    out, lse = run_sparse_decode(q, fp8, indices, topk_length, sink)
    ref_out, ref_lse = naive_sparse_decode(q, tokens, indices, D_QK**-0.5, topk_length, sink)
    check_dense_result(out, lse, q, ref_out, ref_lse)

    q_p, kv, idx_p = make_prefill(5, h_q, 70, topk, gen)
    out, max_logits, lse = mla_cute.flash_mla_sparse_fwd(q_p * 4, kv, idx_p, 0.05, backend="reference")
    ref_out, ref_max, ref_lse = naive_sparse_prefill(q_p * 4, kv, idx_p, 0.05)
    check_out(out, ref_out, torch.bfloat16)
    check_lse(lse, ref_lse)
    torch.testing.assert_close(max_logits, ref_max.float(), atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------- metadata


def test_metadata_reused_across_calls():
    gen = torch.Generator().manual_seed(11)
    b, s_q, h_q, h_kv = 3, 2, 16, 1
    lens = seqlens([0, 200, 65])
    cache, table = make_paged_cache(lens.tolist(), 64, h_kv, torch.bfloat16, gen)
    meta, none = mla_cute.get_mla_metadata()
    assert none is None and isinstance(meta, mla_cute.FlashMLASchedMeta)
    outs = []
    for layer in range(2):  # two "layers" of one decode step: new q, same lengths
        q = make_q(b, s_q, h_q, torch.bfloat16, gen)
        out, lse = mla_cute.flash_mla_with_kvcache(
            q, cache, table, lens, D_V, meta, causal=True, backend="reference"
        )
        if layer == 0:
            tsm, ns = meta.tile_scheduler_metadata, meta.num_splits
            parts = num_sm_parts_for(132, s_q, h_q, h_kv)
            assert tsm.dtype == torch.int32 and tsm.shape == (parts, 8)
            assert ns.dtype == torch.int32 and ns.shape == (b + 1,)
            default = mla_cute.schedules.DEFAULT_DENSE_SCHEDULE
            want_tsm, want_ns = plan_splits(lens, parts, 64, *default.plan_policy(s_q * h_q // h_kv))
            assert torch.equal(tsm, want_tsm) and torch.equal(ns, want_ns)
        else:  # the second call must not recompute
            assert meta.tile_scheduler_metadata is tsm and meta.num_splits is ns
        ref_out, ref_lse = naive_dense(q, cache, table, lens, D_QK**-0.5, True)
        check_dense_result(out, lse, q, ref_out, ref_lse)
        outs.append(out)
    assert not torch.equal(outs[0], outs[1])


# ----------------------------------------------------------------------------- sparse decode


def make_fp8_cache(num_blocks, page, gen):
    cache16 = torch.randn(num_blocks, page, 1, D_QK, generator=gen).bfloat16()
    fp8 = mla_cute.quantize_kv_cache(cache16)
    tokens = mla_cute.dequantize_kv_cache(fp8).reshape(-1, D_QK)
    return fp8, tokens


def make_sparse_indices(b, s_q, topk, n_tok, gen, invalid_frac=0.3):
    """Distinct valid indices with -1, past-the-end and below -1 values sprinkled in."""
    idx = torch.stack([torch.randperm(n_tok, generator=gen)[:topk] for _ in range(b * s_q)])
    bad_pool = torch.tensor([-1, -1, -2, -(2**31), n_tok, n_tok + 5, UNUSED_BLOCK, 2**31 - 1])
    bad = torch.rand(idx.shape, generator=gen) < invalid_frac
    pick = torch.randint(len(bad_pool), idx.shape, generator=gen)
    idx = torch.where(bad, bad_pool[pick], idx)
    return idx.reshape(b, s_q, topk).to(torch.int32)


def run_sparse_decode(q, fp8, indices, topk_length=None, attn_sink=None, softmax_scale=None):
    meta, _ = mla_cute.get_mla_metadata()
    return mla_cute.flash_mla_with_kvcache(
        q, fp8, None, None, D_V, meta, softmax_scale=softmax_scale, is_fp8_kvcache=True,
        indices=indices, topk_length=topk_length, attn_sink=attn_sink, backend="reference",
    )


@pytest.mark.parametrize("page,num_blocks", [(64, 2), (16, 5), (1, 48)])
@pytest.mark.parametrize("h_q,s_q", [(16, 1), (64, 2)])
@pytest.mark.parametrize("use_topk_length", [False, True])
def test_sparse_decode_matches_naive(page, num_blocks, h_q, s_q, use_topk_length):
    gen = torch.Generator().manual_seed(page + num_blocks + h_q + s_q + 100 * use_topk_length)
    b, topk = 3, 40
    fp8, tokens = make_fp8_cache(num_blocks, page, gen)
    q = make_q(b, s_q, h_q, torch.bfloat16, gen)
    indices = make_sparse_indices(b, s_q, topk, tokens.shape[0], gen)
    # 0 (nothing counts), partial, and more than topk (everything counts).
    topk_length = torch.tensor([0, 13, topk + 7], dtype=torch.int32) if use_topk_length else None
    out, lse = run_sparse_decode(q, fp8, indices, topk_length)
    ref_out, ref_lse = naive_sparse_decode(q, tokens, indices, D_QK**-0.5, topk_length)
    check_dense_result(out, lse, q, ref_out, ref_lse)
    if use_topk_length:
        assert torch.all(out[0] == 0) and torch.all(lse[0] == INF)


def test_sparse_decode_all_invalid_indices():
    gen = torch.Generator().manual_seed(12)
    fp8, tokens = make_fp8_cache(2, 64, gen)
    q = make_q(2, 1, 8, torch.bfloat16, gen)
    n = tokens.shape[0]
    indices = torch.tensor([[[-1, n, -7, 2**31 - 1]], [[-1, -1, -1, -1]]], dtype=torch.int32)
    out, lse = run_sparse_decode(q, fp8, indices)
    assert torch.all(out == 0) and torch.all(lse == INF)


def test_sparse_decode_attn_sink():
    gen = torch.Generator().manual_seed(13)
    b, s_q, h_q, topk = 2, 2, 8, 32
    fp8, tokens = make_fp8_cache(3, 16, gen)
    q = make_q(b, s_q, h_q, torch.bfloat16, gen)
    indices = make_sparse_indices(b, s_q, topk, tokens.shape[0], gen)
    topk_length = torch.tensor([0, 20], dtype=torch.int32)  # request 0 attends nothing
    sink = torch.tensor([INF, -INF, 0.0, 1.5, -3.0, 4.0, 10.0, -INF], dtype=torch.float32)
    out0, lse0 = run_sparse_decode(q, fp8, indices, topk_length)
    out, lse = run_sparse_decode(q, fp8, indices, topk_length, attn_sink=sink)
    ref_out, ref_lse = naive_sparse_decode(q, tokens, indices, D_QK**-0.5, topk_length, sink)
    check_dense_result(out, lse, q, ref_out, ref_lse)
    assert torch.equal(lse, lse0)  # the sink only rescales out
    assert torch.all(out[..., 0, :] == 0)  # +inf sink takes all the mass
    assert torch.equal(out[..., 1, :], out0[..., 1, :])  # -inf sink is a no-op
    assert torch.equal(out[..., 7, :], out0[..., 7, :])
    assert torch.all(out[0] == 0) and torch.all(lse[0] == INF)  # empty request stays 0, no NaN


def test_sparse_decode_metadata_reuse():
    gen = torch.Generator().manual_seed(14)
    fp8, tokens = make_fp8_cache(2, 64, gen)
    indices = make_sparse_indices(2, 1, 16, tokens.shape[0], gen)
    topk_length = torch.tensor([5, 16], dtype=torch.int32)
    meta, _ = mla_cute.get_mla_metadata()
    for _ in range(2):
        q = make_q(2, 1, 16, torch.bfloat16, gen)
        out, lse = mla_cute.flash_mla_with_kvcache(
            q, fp8, None, None, D_V, meta, is_fp8_kvcache=True, indices=indices,
            topk_length=topk_length.clone(), backend="reference",
        )
        ref_out, ref_lse = naive_sparse_decode(q, tokens, indices, D_QK**-0.5, topk_length)
        check_dense_result(out, lse, q, ref_out, ref_lse)


# ----------------------------------------------------------------------------- sparse prefill


def make_prefill(s_q, h_q, s_kv, topk, gen, d_qk=D_QK):
    q = torch.randn(s_q, h_q, d_qk, generator=gen).bfloat16()
    kv = torch.randn(s_kv, 1, d_qk, generator=gen).bfloat16()
    idx = torch.stack([torch.randperm(s_kv, generator=gen)[:topk] for _ in range(s_q)])
    bad_pool = torch.tensor([-1, -2, -(2**31), s_kv, s_kv + 1, 2**31 - 1])
    bad = torch.rand(idx.shape, generator=gen) < 0.3
    idx = torch.where(bad, bad_pool[torch.randint(len(bad_pool), idx.shape, generator=gen)], idx)
    idx[0] = -1  # one query with nothing valid
    return q, kv, idx.reshape(s_q, 1, topk).to(torch.int32)


@pytest.mark.parametrize("d_qk", [D_QK, D_V])
@pytest.mark.parametrize("h_q", [1, 16, 64])
@pytest.mark.parametrize("with_topk_length", [False, True])
@pytest.mark.parametrize("with_sink", [False, True])
def test_sparse_prefill_matches_naive(h_q, with_topk_length, with_sink, d_qk):
    """Both head dims: 576 (latent and RoPE) and 512 (latent only, scores and values over the same 512)."""
    gen = torch.Generator().manual_seed(h_q + 2 * with_topk_length + 4 * with_sink + d_qk)
    s_q, s_kv, topk = 5, 70, 24
    q, kv, indices = make_prefill(s_q, h_q, s_kv, topk, gen, d_qk)
    topk_length = torch.tensor([topk, 0, 7, topk, 100], dtype=torch.int32) if with_topk_length else None
    sink = None
    if with_sink:
        sink = torch.randn(h_q, generator=gen) * 3
        sink[0] = INF
        if h_q > 1:
            sink[1] = -INF
    scale = 0.05
    out, max_logits, lse = mla_cute.flash_mla_sparse_fwd(
        q, kv, indices, scale, attn_sink=sink, topk_length=topk_length, backend="reference"
    )
    ref_out, ref_max, ref_lse = naive_sparse_prefill(q, kv, indices, scale, topk_length, sink)
    assert out.dtype == torch.bfloat16 and out.shape == (s_q, h_q, D_V)
    assert max_logits.dtype == lse.dtype == torch.float32
    assert max_logits.shape == lse.shape == (s_q, h_q)
    check_out(out, ref_out, torch.bfloat16)
    check_lse(lse, ref_lse)
    torch.testing.assert_close(max_logits, ref_max.float(), atol=1e-4, rtol=0)
    empty = torch.isinf(ref_lse)
    assert empty[0].all()
    assert torch.all(out[empty] == 0) and torch.all(lse[empty] == INF)
    assert torch.all(max_logits[empty] == -INF)
    if with_sink:
        plain_out, plain_max, plain_lse = mla_cute.flash_mla_sparse_fwd(
            q, kv, indices, scale, topk_length=topk_length, backend="reference"
        )
        assert torch.equal(lse, plain_lse) and torch.equal(max_logits, plain_max)
        assert torch.all(out[:, 0] == 0)
        if h_q > 1:
            assert torch.equal(out[:, 1], plain_out[:, 1])


@pytest.mark.parametrize("with_topk_length", [False, True])
@pytest.mark.parametrize("with_sink", [False, True])
def test_sparse_prefill_from_fp8_cache_matches_naive_over_dequantized_rows(with_topk_length, with_sink):
    """kv as the paged FP8 cache: indices are block * page + offset over all pages, anything outside is
    invalid; the result is the prefill over the dequantized rows (a naive float64 loop here)."""
    gen = torch.Generator().manual_seed(40 + with_topk_length + 2 * with_sink)
    s_q, h_q, topk = 4, 16, 40
    fp8, tokens = make_fp8_cache(3, 32, gen)  # 96 rows
    indices = make_sparse_indices(s_q, 1, topk, tokens.shape[0], gen).reshape(s_q, 1, topk)
    indices[1] = -1  # a query with nothing valid
    q = torch.randn(s_q, h_q, D_QK, generator=gen).bfloat16()
    topk_length = torch.tensor([topk, 5, 0, 17], dtype=torch.int32) if with_topk_length else None
    sink = torch.randn(h_q, generator=gen) * 2 if with_sink else None
    scale = 0.04
    out, max_logits, lse = mla_cute.flash_mla_sparse_fwd(q, fp8.view(torch.uint8), indices, scale, attn_sink=sink,
                                                         topk_length=topk_length, backend="reference")
    ref_out, ref_max, ref_lse = naive_sparse_prefill(q, tokens.reshape(-1, 1, D_QK), indices, scale, topk_length,
                                                     sink)
    assert out.shape == (s_q, h_q, D_V) and max_logits.shape == lse.shape == (s_q, h_q)
    check_out(out, ref_out, torch.bfloat16)
    check_lse(lse, ref_lse)
    torch.testing.assert_close(max_logits, ref_max.float(), atol=1e-4, rtol=0)
    assert torch.all(out[1] == 0) and torch.all(lse[1] == INF) and torch.all(max_logits[1] == -INF)
