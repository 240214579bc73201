"""Dense decode over the 656-byte FP8 cache on the ``cute`` backend: the sparse kernel over every position of each
request (``backends.cute.dense_positions``).  On the CPU: the positions make the reference's sparse decode equal its
dense decode over the dequantized cache, and the host code hands the sparse kernel what it reads."""

from __future__ import annotations

import pytest
import torch

import mla_cute
from mla_cute.backends import cute, reference
from mla_cute.kv_formats import dequantize_kv_cache, quantize_kv_cache


def _case(b=3, s_q=2, h_q=16, page=64, blocks=3, lengths=(150, 0, 192), seed=0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = b * blocks + 2
    rows = (torch.randn(num_blocks, page, 1, 576, generator=g) * 0.1).bfloat16()
    cache = quantize_kv_cache(rows)
    table = torch.randperm(num_blocks, generator=g)[: b * blocks].int().view(b, blocks)
    q = (torch.randn(b, s_q, h_q, 576, generator=g) * 0.1).bfloat16()
    return q, cache, table, torch.tensor(lengths, dtype=torch.int32)


@pytest.mark.parametrize("s_q,causal,page,lengths", [(1, False, 64, (150, 0, 192)), (2, True, 64, (150, 1, 192)),
                                                     (3, True, 128, (300, 2, 5)), (2, False, 128, (0, 384, 129))])
def test_positions_make_sparse_decode_the_dense_one(s_q, causal, page, lengths):
    q, cache, table, lens = _case(s_q=s_q, page=page, lengths=lengths)
    indices, topk_length = cute.dense_positions(table, lens, cache.shape[0], page, s_q, causal)
    assert indices.shape == (3, s_q, 3 * page) and indices.dtype == topk_length.dtype == torch.int32
    assert topk_length.tolist() == list(lengths)
    scale = 576 ** -0.5
    got = reference.sparse_decode_fp8(q, cache, indices, scale, topk_length, None, 512, "V32", None)
    want = reference.dense_decode(q, dequantize_kv_cache(cache), table, lens, scale, causal and s_q > 1)
    torch.testing.assert_close(got[0].float(), want[0].float(), atol=2e-3, rtol=1e-2)
    finite = torch.isfinite(want[1])
    assert torch.equal(finite, torch.isfinite(got[1]))
    torch.testing.assert_close(got[1][finite], want[1][finite], atol=1e-4, rtol=1e-5)


def test_positions_skip_block_ids_outside_the_cache_and_lengths_past_the_row():
    q, cache, table, lens = _case(lengths=(150, 0, 10000))
    table[0, 1] = -7
    table[2, 0] = cache.shape[0]
    indices, topk_length = cute.dense_positions(table, lens, cache.shape[0], 64, 2, False)
    assert (indices[0, :, 64:128] == -1).all() and (indices[2, :, :64] == -1).all()
    assert topk_length.tolist() == [150, 0, 192]  # within the 3 blocks a row covers
    assert int(indices[0, 0, 130]) == int(table[0, 2]) * 64 + 2


def test_cute_call_runs_the_sparse_kernel_over_the_positions(monkeypatch):
    """The host code on the CPU (kernels replaced): the V32 sparse step, the positions as indices, the lengths as
    topk_length, no sink; metadata reused by a second call."""
    import mla_cute.api as api
    import mla_cute.kernels.build as build

    runs, compiled = [], []

    def compile_sparse(config, options=""):
        compiled.append(config)
        return lambda *args: runs.append(args)

    monkeypatch.setattr(build, "compile_sparse", compile_sparse)
    monkeypatch.setattr(build, "compile_scheduler", lambda config, options="": lambda *args: None)
    monkeypatch.setattr(api, "select_backend", lambda device, backend=None: "cute")
    q, cache, table, lens = _case()
    meta = mla_cute.get_mla_metadata()[0]
    for _ in range(2):
        mla_cute.flash_mla_with_kvcache(q, cache, table, lens, 512, meta, causal=True, is_fp8_kvcache=True)
    assert all(c.split.kv_format == "V32" and not c.split.has_sink and c.split.has_topk_length for c in compiled)
    q_arg, words, indices, topk_length, *_ = runs[-1]
    want, want_lengths = cute.dense_positions(table, lens, cache.shape[0], 64, 2, True)
    assert torch.equal(indices, want) and torch.equal(topk_length, want_lengths) and len(runs) == 2
    assert meta.config.is_fp8_kvcache and meta.config.topk is None


def test_cute_refuses_a_tensor_plan_and_the_per_tensor_cache(monkeypatch):
    import mla_cute.api as api

    monkeypatch.setattr(api, "select_backend", lambda device, backend=None: "cute")
    q, cache, table, lens = _case()
    records = torch.zeros(cute.dense_tensor_plan(mla_cute.schedules.DEFAULT_DENSE_SCHEDULE, rows=32, h_kv=1)[0], 8,
                          dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="pass a FlashMLASchedMeta"):
        mla_cute.flash_mla_with_kvcache(q, cache, table, lens, 512, records, torch.zeros(4, dtype=torch.int32),
                                        is_fp8_kvcache=True)
    per_tensor = torch.zeros(11, 64, 1, 576, dtype=torch.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match="per-tensor FP8 cache"):
        mla_cute.flash_mla_with_kvcache(q, per_tensor, table, lens, 512, mla_cute.get_mla_metadata()[0],
                                        is_fp8_kvcache=True, descale_k=torch.ones(1))


def test_reference_metadata_is_the_sparse_kernels_plan_and_the_schedule_a_sparse_one():
    """Over the 656-byte cache the reference fills the metadata as the cute backend plans it (the sparse kernel's
    plan over the lengths, batch-invariant too), and takes a SparseDecodeSchedule; a DenseDecodeSchedule there is a
    TypeError naming the call."""
    from mla_cute.schedules import (DEFAULT_SPARSE_SCHEDULE, DenseDecodeSchedule, invariant_plan, plan_splits,
                                    resolve_sparse, sparse_lengths)

    q, cache, table, lens = _case(lengths=(150, 0, 192))
    meta = mla_cute.get_mla_metadata()[0]
    mla_cute.flash_mla_with_kvcache(q, cache, table, lens, 512, meta, is_fp8_kvcache=True)
    call = resolve_sparse(DEFAULT_SPARSE_SCHEDULE, b=3, s_q=2, h_q=16, topk=192, has_sink=False,
                          has_topk_length=True)
    want = plan_splits(sparse_lengths(192, lens, 3), call.parts, 64, *call.scheduler.policy())
    assert torch.equal(meta.tile_scheduler_metadata, want[0]) and torch.equal(meta.num_splits, want[1])
    meta = mla_cute.get_mla_metadata()[0]
    mla_cute.flash_mla_with_kvcache(q, cache, table, lens, 512, meta, is_fp8_kvcache=True,
                                    enable_batch_invariant=True)
    records, splits = invariant_plan(lens.clamp(min=1), 8, 4, 1)  # 192 tokens: 3 tiles, one piece
    assert torch.equal(meta.tile_scheduler_metadata, records) and torch.equal(meta.num_splits, splits)
    with pytest.raises(TypeError, match="dense decode over the 656-byte cache"):
        mla_cute.flash_mla_with_kvcache(q, cache, table, lens, 512, mla_cute.get_mla_metadata()[0],
                                        is_fp8_kvcache=True, schedule=DenseDecodeSchedule())
