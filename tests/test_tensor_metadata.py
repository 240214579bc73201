"""Dense decode with its plan given as tensors (``get_mla_decoding_metadata``), as SGLang's FlashMLA backend calls
it: buffers made once at the largest batch, a fresh plan copied into them before each step, ``num_splits`` sliced
to the batch.  The reference backend on the CPU; the cute backend's flow, inside CUDA graphs, is in
``test_engine_gpu.py``."""

import pytest
import torch

import mla_cute
from mla_cute import flash_mla_with_kvcache, get_mla_decoding_metadata, get_mla_metadata
from mla_cute.schedules import DEFAULT_DENSE_SCHEDULE, dense_tensor_plan, resolve_dense


def _case(b, h_q=16, s_q=1, h_kv=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s_q, h_q, 576, generator=g).bfloat16()
    cache = torch.randn(4 * b, 64, h_kv, 576, generator=g).bfloat16()
    table = torch.randperm(4 * b, generator=g).to(torch.int32).view(b, 4)
    lengths = torch.randint(0, 257, (b,), generator=g, dtype=torch.int32)
    return q, cache, table, lengths


def test_an_engine_refreshes_its_buffers_and_slices_num_splits():
    max_bs, h_q = 8, 16
    meta_buf, splits_buf = get_mla_decoding_metadata(torch.ones(max_bs, dtype=torch.int32), h_q, 1)
    assert meta_buf.dtype == splits_buf.dtype == torch.int32 and meta_buf.shape[1] == 8
    assert splits_buf.shape == (max_bs + 1,)
    for step, bs in enumerate((8, 3, 5)):
        q, cache, table, lengths = _case(bs, h_q, seed=step)
        plan, splits = get_mla_decoding_metadata(lengths, h_q, 1, h_q)
        assert plan.shape == meta_buf.shape  # the part count does not depend on the batch
        meta_buf.copy_(plan)
        splits_buf[: bs + 1].copy_(splits)
        got = flash_mla_with_kvcache(q, cache, table, lengths, 512, meta_buf, splits_buf[: bs + 1],
                                     softmax_scale=0.05, causal=True)
        want = flash_mla_with_kvcache(q, cache, table, lengths, 512, get_mla_metadata()[0], softmax_scale=0.05,
                                      causal=True)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("s_q,h_q,h_kv", [(1, 16, 1), (2, 128, 1), (1, 128, 2), (4, 64, 1)])
def test_the_plan_is_the_one_a_call_of_unknown_lengths_makes(s_q, h_q, h_kv):
    rows = s_q * (h_q // h_kv)
    for dtype in ("bfloat16", "float16"):
        call = resolve_dense(DEFAULT_DENSE_SCHEDULE, dtype=dtype, s_q=s_q, h_q=h_q, h_kv=h_kv, causal=True, page=64)
        assert dense_tensor_plan(DEFAULT_DENSE_SCHEDULE, rows=rows, h_kv=h_kv) == (call.parts, call.scheduler)
    q, cache, table, lengths = _case(3, h_q, s_q, h_kv)
    plan, splits = get_mla_decoding_metadata(lengths, rows, h_kv)
    assert plan.shape == (call.parts, 8) and splits.shape == (4,)
    got = flash_mla_with_kvcache(q, cache, table, lengths, 512, plan, splits, causal=True)
    want = flash_mla_with_kvcache(q, cache, table, lengths, 512, get_mla_metadata()[0], causal=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_stale_plan_is_refused_by_the_reference():
    q, cache, table, lengths = _case(4)
    plan, splits = get_mla_decoding_metadata(lengths, 16, 1)
    other = torch.tensor([256, 256, 256, 256], dtype=torch.int32)
    stale, stale_splits = get_mla_decoding_metadata(other, 16, 1)
    assert not (torch.equal(plan, stale) and torch.equal(splits, stale_splits))
    with pytest.raises(ValueError, match="another plan"):
        flash_mla_with_kvcache(q, cache, table, lengths, 512, stale, stale_splits)


def test_out_is_written_in_place():
    q, cache, table, lengths = _case(2)
    plan, splits = get_mla_decoding_metadata(lengths, 16, 1)
    out = torch.full((2, 1, 16, 512), float("nan"), dtype=torch.bfloat16)
    got, _ = flash_mla_with_kvcache(q, cache, table, lengths, 512, plan, splits, out=out)
    want, _ = flash_mla_with_kvcache(q, cache, table, lengths, 512, get_mla_metadata()[0])
    assert got is out and torch.equal(out, want)


@pytest.mark.parametrize("call,err,match", [
    (lambda L: get_mla_decoding_metadata(L.long(), 16, 1), TypeError, "seqlens_k"),
    (lambda L: get_mla_decoding_metadata(L, 16.0, 1), TypeError, "num_q_tokens_per_head_k"),
    (lambda L: get_mla_decoding_metadata(L, 0, 1), ValueError, "num_q_tokens_per_head_k"),
    (lambda L: get_mla_decoding_metadata(L, 16, 0), ValueError, "h_k"),
    (lambda L: get_mla_decoding_metadata(L, 16, 2, 15), ValueError, "h_q"),
    (lambda L: get_mla_decoding_metadata(L, 16, 1, 16.0), TypeError, "h_q must be an int"),
    (lambda L: get_mla_decoding_metadata(-L, 16, 1), ValueError, "seqlens_k must be >= 0"),
    (lambda L: get_mla_decoding_metadata(L, 16, 1, None, 1), TypeError, "is_fp8_kvcache"),
    (lambda L: get_mla_decoding_metadata(L, 16, 1, 16, False, 2048), ValueError, "is_fp8_kvcache must be True"),
    (lambda L: get_mla_decoding_metadata(L, 16, 1, None, True, 2048), ValueError, "h_q must be given"),
    (lambda L: get_mla_decoding_metadata(L, 32, 2, 16, True, 2048), ValueError, "h_k be 1"),
    (lambda L: get_mla_decoding_metadata(L, 24, 1, 16, True, 2048), ValueError, "multiple of h_q"),
    (lambda L: get_mla_decoding_metadata(L, 16, 1, 16, True, 0), ValueError, "topk must be >= 1"),
    (lambda L: get_mla_decoding_metadata(L, 16, 1, 16, True, 2048.0), TypeError, "topk must be an int"),
    (lambda L: get_mla_decoding_metadata(L, 16, 1, use_legacy=None), TypeError, "use_legacy"),
])
def test_metadata_arguments_are_checked(call, err, match):
    with pytest.raises(err, match=match):
        call(torch.tensor([5, 7], dtype=torch.int32))


def test_the_call_checks_the_plan_tensors_shapes():
    q, cache, table, lengths = _case(4)
    plan, splits = get_mla_decoding_metadata(lengths, 16, 1)
    cases = [
        ((plan, None), TypeError, "num_splits must be a tensor"),
        ((None, splits), TypeError, "tile_scheduler_metadata must be a tensor"),
        ((plan[:-1], splits), ValueError, r"tile_scheduler_metadata must have shape \[\d+, 8\]"),
        ((plan, splits[:-1]), ValueError, r"num_splits must have shape \[5\]"),
        ((plan.long(), splits), TypeError, "tile_scheduler_metadata"),
        ((plan, splits.float()), TypeError, "num_splits"),
        ((get_mla_decoding_metadata(lengths, 128, 1)[0], splits), ValueError, "tile_scheduler_metadata must have"),
    ]
    for (p, s), err, match in cases:
        with pytest.raises(err, match=match):
            flash_mla_with_kvcache(q, cache, table, lengths, 512, p, s)
    indices = torch.zeros(4, 1, 64, dtype=torch.int32)
    with pytest.raises(ValueError, match="another plan"):  # a dense plan where a sparse one is due
        flash_mla_with_kvcache(q, mla_cute.quantize_kv_cache(cache), None, None, 512, plan, splits, indices=indices)


def test_a_metadata_object_still_refuses_num_splits():
    q, cache, table, lengths = _case(2)
    with pytest.raises(ValueError, match="num_splits must be None with a FlashMLASchedMeta"):
        flash_mla_with_kvcache(q, cache, table, lengths, 512, get_mla_metadata()[0], 3)


def _sparse_case(b, h_q=16, s_q=1, topk=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s_q, h_q, 576, generator=g).bfloat16()
    cache = mla_cute.quantize_kv_cache((torch.randn(6, 64, 1, 576, generator=g) * 0.3).bfloat16())
    indices = torch.randint(-1, 6 * 64, (b, s_q, topk), generator=g, dtype=torch.int32)
    return q, cache, indices


def test_sparse_plan_buffers_refreshed_as_an_engine_does():
    """SGLang's V3.2 decode over the FP8 cache: plan buffers from the largest batch, refreshed and sliced."""
    max_bs, h_q, s_q, topk = 8, 16, 2, 128
    rows = s_q * h_q
    plan_buf, splits_buf = get_mla_decoding_metadata(torch.ones(max_bs, dtype=torch.int32), rows, 1, h_q, True, topk)
    for step, bs in enumerate((8, 3)):
        q, cache, indices = _sparse_case(bs, h_q, s_q, topk, seed=step)
        lengths = torch.full((bs,), 500, dtype=torch.int32)
        plan, splits = get_mla_decoding_metadata(lengths, rows, 1, h_q, True, topk)
        assert plan.shape == plan_buf.shape
        plan_buf.copy_(plan)
        splits_buf[: bs + 1].copy_(splits)
        table = torch.zeros(bs, 0, dtype=torch.int32)  # as SGLang passes it: no blocks
        got = flash_mla_with_kvcache(q, cache, table, lengths, 512, plan_buf, splits_buf[: bs + 1], None, False,
                                     True, indices)
        want = flash_mla_with_kvcache(q, cache, None, None, 512, get_mla_metadata()[0], is_fp8_kvcache=True,
                                      indices=indices)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_the_sparse_plan_is_the_one_its_first_call_makes():
    from mla_cute.schedules import DEFAULT_SPARSE_SCHEDULE, resolve_sparse, sparse_tensor_plan

    for b, s_q, h_q, topk in ((2, 1, 128, 2048), (64, 2, 64, 2048), (4, 1, 16, 128), (300, 1, 128, 512)):
        call = resolve_sparse(DEFAULT_SPARSE_SCHEDULE, b=b, s_q=s_q, h_q=h_q, topk=topk, has_sink=True,
                              has_topk_length=True, capturing=True, kv_format="V4")
        assert sparse_tensor_plan(DEFAULT_SPARSE_SCHEDULE, b=b, s_q=s_q, h_q=h_q, topk=topk) == (call.parts,
                                                                                               call.scheduler)


def test_a_sparse_plan_for_another_topk_or_two_caches_is_refused():
    q, cache, indices = _sparse_case(3)
    lengths = torch.ones(3, dtype=torch.int32)
    other = get_mla_decoding_metadata(lengths, 16, 1, 16, True, 4096)
    with pytest.raises(ValueError, match="another plan"):
        flash_mla_with_kvcache(q, cache, None, None, 512, *other, is_fp8_kvcache=True, indices=indices)
    plan = get_mla_decoding_metadata(lengths, 16, 1, 16, True, 128)
    with pytest.raises(TypeError, match="two caches plans on its first call"):
        flash_mla_with_kvcache(q, cache, None, None, 512, *plan, is_fp8_kvcache=True, indices=indices,
                               extra_k_cache=cache, extra_indices_in_kvcache=indices)
    sink, topk_length = torch.randn(16), torch.tensor([128, 5, 0], dtype=torch.int32)
    got = flash_mla_with_kvcache(q, cache, None, None, 512, *plan, is_fp8_kvcache=True, indices=indices,
                                 attn_sink=sink, topk_length=topk_length)
    want = flash_mla_with_kvcache(q, cache, None, None, 512, get_mla_metadata()[0], is_fp8_kvcache=True,
                                  indices=indices, attn_sink=sink, topk_length=topk_length)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_the_reference_checks_the_lengths_of_a_given_plan_call():
    """As a first call with a metadata object: lengths past the block table are refused, naming cache_seqlens."""
    q, cache, table, lengths = _case(2)
    long = torch.tensor([300, 1000], dtype=torch.int32)
    plan, splits = get_mla_decoding_metadata(long, 16, 1)
    with pytest.raises(ValueError, match="cache_seqlens has a length of 1000"):
        flash_mla_with_kvcache(q, cache, table, long, 512, plan, splits)


def test_dense_fp8_plans_as_bf16_on_the_reference_and_is_refused_on_cute(monkeypatch):
    """The per-tensor FP8 cache's plan is the bf16 one (the reference runs it); the cute backend has no kernel for
    it yet and says so before planning."""
    import mla_cute.api as api

    lengths = torch.tensor([5, 700, 0], dtype=torch.int32)
    fp8 = get_mla_decoding_metadata(lengths, 16, 1, 16, True)
    bf16 = get_mla_decoding_metadata(lengths, 16, 1, 16, False)
    assert torch.equal(fp8[0], bf16[0]) and torch.equal(fp8[1], bf16[1])
    monkeypatch.setattr(api, "select_backend", lambda device, backend=None: "cute")
    with pytest.raises(NotImplementedError, match="is_fp8_kvcache=True"):
        get_mla_decoding_metadata(lengths, 16, 1, 16, True)
