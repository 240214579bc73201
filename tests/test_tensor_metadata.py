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
    (lambda L: get_mla_decoding_metadata(L, 16, 1, None, 1), TypeError, "is_fp8_kvcache"),
    (lambda L: get_mla_decoding_metadata(L, 16, 1, None, True), NotImplementedError, "is_fp8_kvcache"),
    (lambda L: get_mla_decoding_metadata(L, 16, 1, 16, True, 2048), NotImplementedError, "is_fp8_kvcache"),
    (lambda L: get_mla_decoding_metadata(L, 16, 1, 16, False, 2048), NotImplementedError, "topk"),
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
    with pytest.raises(TypeError, match="sparse decode plans on its first call"):
        flash_mla_with_kvcache(q, mla_cute.quantize_kv_cache(cache), None, None, 512, plan, splits, indices=indices)


def test_a_metadata_object_still_refuses_num_splits():
    q, cache, table, lengths = _case(2)
    with pytest.raises(ValueError, match="num_splits must be None with a FlashMLASchedMeta"):
        flash_mla_with_kvcache(q, cache, table, lengths, 512, get_mla_metadata()[0], 3)
