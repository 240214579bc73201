"""Every bad input is rejected before any work, with an error that names the argument.

Wrong device cannot be produced on a CPU-only machine, so it is not covered here.
"""

import pytest
import torch

import mla_cute

D_QK, D_V = 576, 512


# ----------------------------------------------------------------------------- valid baselines


def dense_args(**over):
    """A valid dense call (b=2, s_q=1, h_q=4, h_kv=1, page 64, lengths [10, 100]); `over` replaces arguments."""
    gen = torch.Generator().manual_seed(0)
    args = dict(
        q=torch.randn(2, 1, 4, D_QK, generator=gen).bfloat16(),
        k_cache=torch.randn(4, 64, 1, D_QK, generator=gen).bfloat16(),
        block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        cache_seqlens=torch.tensor([10, 100], dtype=torch.int32),
        head_dim_v=D_V,
        tile_scheduler_metadata=mla_cute.get_mla_metadata()[0],
        backend="reference",
    )
    args.update(over)
    return args


def sparse_args(**over):
    """A valid sparse FP8 decode call (b=2, s_q=1, h_q=16, topk=32, two 64-token pages)."""
    gen = torch.Generator().manual_seed(1)
    cache = mla_cute.quantize_kv_cache(torch.randn(2, 64, 1, D_QK, generator=gen).bfloat16())
    args = dict(
        q=torch.randn(2, 1, 16, D_QK, generator=gen).bfloat16(),
        k_cache=cache,
        block_table=None,
        cache_seqlens=None,
        head_dim_v=D_V,
        tile_scheduler_metadata=mla_cute.get_mla_metadata()[0],
        is_fp8_kvcache=True,
        indices=torch.randint(0, 128, (2, 1, 32), generator=gen, dtype=torch.int32),
        backend="reference",
    )
    args.update(over)
    return args


def prefill_args(**over):
    """A valid sparse prefill call (s_q=3, h_q=8, s_kv=50, topk=16)."""
    gen = torch.Generator().manual_seed(2)
    args = dict(
        q=torch.randn(3, 8, D_QK, generator=gen).bfloat16(),
        kv=torch.randn(50, 1, D_QK, generator=gen).bfloat16(),
        indices=torch.randint(0, 50, (3, 1, 16), generator=gen, dtype=torch.int32),
        sm_scale=D_QK**-0.5,
        backend="reference",
    )
    args.update(over)
    return args


def test_baselines_are_valid():
    out, lse = mla_cute.flash_mla_with_kvcache(**dense_args())
    assert out.shape == (2, 1, 4, D_V) and lse.shape == (2, 4, 1)
    out, lse = mla_cute.flash_mla_with_kvcache(**sparse_args())
    assert out.shape == (2, 1, 16, D_V) and lse.shape == (2, 16, 1)
    out, mx, lse = mla_cute.flash_mla_sparse_fwd(**prefill_args())
    assert out.shape == (3, 8, D_V) and mx.shape == lse.shape == (3, 8)


# ----------------------------------------------------------------------------- dense decode

bf16, fp16 = torch.bfloat16, torch.float16


def _bt(rows):
    return torch.tensor(rows, dtype=torch.int32)


def _lens(vals, dtype=torch.int32):
    return torch.tensor(vals, dtype=dtype)


DENSE_CASES = {
    # dtypes
    "q_float32": (lambda a: dict(q=a["q"].float(), k_cache=a["k_cache"].float()), TypeError, "q must have dtype"),
    "k_cache_dtype_differs": (lambda a: dict(q=a["q"].to(fp16)), TypeError, "k_cache must have the dtype of q"),
    "block_table_int64": (lambda a: dict(block_table=a["block_table"].long()), TypeError, "block_table"),
    "cache_seqlens_int64": (lambda a: dict(cache_seqlens=a["cache_seqlens"].long()), TypeError, "cache_seqlens"),
    "fp8_cache_with_fp16_q": (
        lambda a: dict(q=a["q"].to(fp16), k_cache=mla_cute.quantize_kv_cache(a["k_cache"]), is_fp8_kvcache=True),
        TypeError, "q must be torch.bfloat16",
    ),
    "fp8_flag_with_bf16_cache": (lambda a: dict(is_fp8_kvcache=True), TypeError, "k_cache"),
    "q_not_tensor": (lambda a: dict(q=a["q"].tolist()), TypeError, "q must be a torch.Tensor"),
    # ranks
    "q_rank3": (lambda a: dict(q=a["q"][0]), ValueError, "q must have 4 dimensions"),
    "q_rank5": (lambda a: dict(q=a["q"][None]), ValueError, "q must have 4 dimensions"),
    "k_cache_rank3": (lambda a: dict(k_cache=a["k_cache"][:, :, 0]), ValueError, "k_cache must have 4 dimensions"),
    "block_table_rank1": (lambda a: dict(block_table=a["block_table"].flatten()), ValueError, "block_table must have 2"),
    "block_table_rank3": (lambda a: dict(block_table=a["block_table"][None]), ValueError, "block_table must have 2"),
    "cache_seqlens_rank0": (lambda a: dict(cache_seqlens=_lens(10)), ValueError, "cache_seqlens must have 1"),
    "cache_seqlens_rank2": (lambda a: dict(cache_seqlens=a["cache_seqlens"][None]), ValueError, "cache_seqlens must have 1"),
    # shapes
    "q_last_dim_512": (lambda a: dict(q=a["q"][..., :512]), ValueError, "q must have head_dim 576"),
    "k_cache_last_dim_512": (lambda a: dict(k_cache=a["k_cache"][..., :512]), ValueError, "k_cache must have head_dim"),
    "fp8_cache_wrong_row_bytes": (
        lambda a: dict(k_cache=mla_cute.quantize_kv_cache(a["k_cache"])[..., :600], is_fp8_kvcache=True),
        ValueError, "k_cache must have shape",
    ),
    "head_dim_v_576": (lambda a: dict(head_dim_v=576), ValueError, "head_dim_v must be 512"),
    "head_dim_v_256": (lambda a: dict(head_dim_v=256), ValueError, "head_dim_v must be 512"),
    "h_q_not_multiple_of_h_kv": (
        lambda a: dict(k_cache=a["k_cache"].expand(-1, -1, 3, -1)),
        ValueError, r"h_q \(4",
    ),
    "empty_batch": (
        lambda a: dict(q=a["q"][:0], block_table=a["block_table"][:0], cache_seqlens=a["cache_seqlens"][:0]),
        ValueError, "q must have batch",
    ),
    "block_table_wrong_batch": (lambda a: dict(block_table=_bt([[0, 1]])), ValueError, "block_table must have shape"),
    "cache_seqlens_wrong_length": (lambda a: dict(cache_seqlens=_lens([10, 100, 5])), ValueError, "cache_seqlens must have shape"),
    # values
    "cache_seqlens_beyond_block_table": (lambda a: dict(cache_seqlens=_lens([10, 129])), ValueError, "cache_seqlens has a length of 129"),
    "cache_seqlens_negative": (lambda a: dict(cache_seqlens=_lens([-1, 100])), ValueError, "cache_seqlens must be >= 0"),
    "block_id_past_num_blocks": (lambda a: dict(block_table=_bt([[0, 1], [4, 3]])), ValueError, r"block_table\[1, 0\] = 4"),
    "block_id_negative": (lambda a: dict(block_table=_bt([[-1, 1], [2, 3]])), ValueError, r"block_table\[0, 0\] = -1"),
    "block_id_huge_in_used_entry": (lambda a: dict(block_table=_bt([[0, 1], [2, 2147480000]])), ValueError, r"block_table\[1, 1\]"),
    "softmax_scale_zero": (lambda a: dict(softmax_scale=0.0), ValueError, "softmax_scale"),
    "softmax_scale_negative": (lambda a: dict(softmax_scale=-0.1), ValueError, "softmax_scale"),
    "causal_not_bool": (lambda a: dict(causal=1), TypeError, "causal must be a bool"),
    # arguments that do not belong to the dense path
    "num_splits_given": (lambda a: dict(num_splits=torch.zeros(3, dtype=torch.int32)), ValueError, "num_splits must be None"),
    "attn_sink_on_dense": (lambda a: dict(attn_sink=torch.zeros(4)), ValueError, "attn_sink is only valid"),
    "topk_length_on_dense": (lambda a: dict(topk_length=_lens([1, 1])), ValueError, "topk_length is only valid"),
    "block_table_none": (lambda a: dict(block_table=None), ValueError, "block_table and cache_seqlens are required"),
    "cache_seqlens_none": (lambda a: dict(cache_seqlens=None), ValueError, "block_table and cache_seqlens are required"),
    "extra_k_cache": (lambda a: dict(extra_k_cache=a["k_cache"]), NotImplementedError, "extra_k_cache"),
    "extra_indices_in_kvcache": (
        lambda a: dict(extra_indices_in_kvcache=torch.zeros(2, 1, 8, dtype=torch.int32)),
        NotImplementedError, "extra_indices_in_kvcache",
    ),
    "extra_topk_length": (lambda a: dict(extra_topk_length=_lens([1, 1])), NotImplementedError, "extra_topk_length"),
    "metadata_not_schedmeta": (lambda a: dict(tile_scheduler_metadata=None), TypeError, "tile_scheduler_metadata must be a FlashMLASchedMeta"),
    "metadata_raw_tensor": (
        lambda a: dict(tile_scheduler_metadata=torch.zeros(132, 8, dtype=torch.int32)),
        TypeError, "tile_scheduler_metadata must be a FlashMLASchedMeta",
    ),
    # backend choice
    "backend_unknown": (lambda a: dict(backend="triton"), ValueError, "backend must be one of"),
    "backend_cute_on_cpu": (lambda a: dict(backend="cute"), ValueError, "'cute' backend needs CUDA tensors"),
}


@pytest.mark.parametrize("case", list(DENSE_CASES))
def test_dense_rejects(case):
    make, exc, match = DENSE_CASES[case]
    base = dense_args()
    with pytest.raises(exc, match=match):
        mla_cute.flash_mla_with_kvcache(**{**base, **make(base)})


def test_unused_block_table_entries_are_not_checked():
    # FlashMLA poisons entries past each length; only the used ones must be valid block ids.
    args = dense_args(block_table=_bt([[0, 2147480000, -5], [2, 3, 2147480000]]))
    mla_cute.flash_mla_with_kvcache(**args)


def test_length_exactly_covered_by_block_table():
    mla_cute.flash_mla_with_kvcache(**dense_args(cache_seqlens=_lens([128, 0])))


# ----------------------------------------------------------------------------- backend selection


def test_env_backend_bad_value(monkeypatch):
    monkeypatch.setenv("MLA_CUTE_BACKEND", "fast")
    with pytest.raises(ValueError, match="MLA_CUTE_BACKEND must be one of"):
        mla_cute.flash_mla_with_kvcache(**dense_args(backend=None))


def test_env_backend_cute_on_cpu(monkeypatch):
    monkeypatch.setenv("MLA_CUTE_BACKEND", "cute")
    with pytest.raises(ValueError, match="'cute' backend needs CUDA tensors"):
        mla_cute.flash_mla_with_kvcache(**dense_args(backend=None))


def test_explicit_backend_overrides_env(monkeypatch):
    monkeypatch.setenv("MLA_CUTE_BACKEND", "fast")
    mla_cute.flash_mla_with_kvcache(**dense_args(backend="reference"))


def test_cpu_defaults_to_reference(monkeypatch):
    monkeypatch.delenv("MLA_CUTE_BACKEND", raising=False)
    assert mla_cute.select_backend(torch.device("cpu")) == "reference"
    mla_cute.flash_mla_with_kvcache(**dense_args(backend=None))


# ----------------------------------------------------------------------------- metadata reuse


def _first_then(second_over, first_over=None):
    """Call once with a fresh metadata object, then again with the same object and `second_over`."""
    meta = mla_cute.get_mla_metadata()[0]
    mla_cute.flash_mla_with_kvcache(**dense_args(tile_scheduler_metadata=meta, **(first_over or {})))
    return dense_args(tile_scheduler_metadata=meta, **second_over)


def _batch3():
    gen = torch.Generator().manual_seed(3)
    return dict(
        q=torch.randn(3, 1, 4, D_QK, generator=gen).bfloat16(),
        block_table=_bt([[0, 1], [2, 3], [0, 1]]),
        cache_seqlens=_lens([10, 100, 5]),
    )


META_CONFIG_CHANGES = {
    "causal": dict(causal=True),
    "batch": _batch3(),
    "s_q": dict(q=torch.zeros(2, 2, 4, D_QK, dtype=bf16)),
    "h_q": dict(q=torch.zeros(2, 1, 8, D_QK, dtype=bf16)),
    "page_size": dict(k_cache=torch.zeros(8, 32, 1, D_QK, dtype=bf16), block_table=_bt([[0, 1, 2, 3], [4, 5, 6, 7]])),
    "h_kv": dict(k_cache=torch.zeros(4, 64, 2, D_QK, dtype=bf16)),
}


@pytest.mark.parametrize("change", list(META_CONFIG_CHANGES))
def test_metadata_reused_with_other_config(change):
    args = _first_then(META_CONFIG_CHANGES[change])
    with pytest.raises(ValueError, match="tile_scheduler_metadata was computed for another configuration"):
        mla_cute.flash_mla_with_kvcache(**args)


def test_metadata_reused_with_other_lengths_tensor():
    args = _first_then(dict(cache_seqlens=_lens([11, 100])))
    with pytest.raises(ValueError, match="cache_seqlens/topk_length values"):
        mla_cute.flash_mla_with_kvcache(**args)


def test_metadata_reused_after_in_place_change():
    lens = _lens([10, 100])
    args = _first_then(dict(cache_seqlens=lens), dict(cache_seqlens=lens))
    lens[0] += 1  # same tensor object, new values: the usual decode-loop mistake
    with pytest.raises(ValueError, match="cache_seqlens/topk_length values"):
        mla_cute.flash_mla_with_kvcache(**args)


def test_metadata_reused_with_equal_values_is_fine():
    lens = _lens([10, 100])
    args = _first_then(dict(cache_seqlens=lens.clone()), dict(cache_seqlens=lens))
    mla_cute.flash_mla_with_kvcache(**args)
    lens[0] = 10  # an in-place write that keeps the values
    mla_cute.flash_mla_with_kvcache(**dense_args(tile_scheduler_metadata=args["tile_scheduler_metadata"], cache_seqlens=lens))


def test_sparse_metadata_reused_with_other_topk_length():
    meta = mla_cute.get_mla_metadata()[0]
    mla_cute.flash_mla_with_kvcache(**sparse_args(tile_scheduler_metadata=meta, topk_length=_lens([5, 32])))
    with pytest.raises(ValueError, match="cache_seqlens/topk_length values"):
        mla_cute.flash_mla_with_kvcache(**sparse_args(tile_scheduler_metadata=meta, topk_length=_lens([6, 32])))


def test_sparse_metadata_reused_with_other_topk():
    meta = mla_cute.get_mla_metadata()[0]
    mla_cute.flash_mla_with_kvcache(**sparse_args(tile_scheduler_metadata=meta))
    indices = torch.zeros(2, 1, 64, dtype=torch.int32)
    with pytest.raises(ValueError, match="another configuration.*topk"):
        mla_cute.flash_mla_with_kvcache(**sparse_args(tile_scheduler_metadata=meta, indices=indices))


def test_dense_metadata_reused_for_sparse():
    meta = mla_cute.get_mla_metadata()[0]
    mla_cute.flash_mla_with_kvcache(**dense_args(tile_scheduler_metadata=meta))
    with pytest.raises(ValueError, match="another configuration"):
        mla_cute.flash_mla_with_kvcache(**sparse_args(tile_scheduler_metadata=meta, q=torch.zeros(2, 1, 4, D_QK, dtype=bf16)))


def test_metadata_usable_after_rejected_call_with_other_lengths():
    meta = mla_cute.get_mla_metadata()[0]
    with pytest.raises(ValueError):
        mla_cute.flash_mla_with_kvcache(**dense_args(tile_scheduler_metadata=meta, cache_seqlens=_lens([-1, 100])))
    mla_cute.flash_mla_with_kvcache(**dense_args(tile_scheduler_metadata=meta))


def test_metadata_filled_after_rejected_call():
    meta = mla_cute.get_mla_metadata()[0]
    with pytest.raises(ValueError):
        mla_cute.flash_mla_with_kvcache(**dense_args(tile_scheduler_metadata=meta, block_table=_bt([[0, 1], [9, 3]])))
    mla_cute.flash_mla_with_kvcache(**dense_args(tile_scheduler_metadata=meta))
    assert meta.tile_scheduler_metadata is not None and meta.num_splits is not None


# ----------------------------------------------------------------------------- sparse decode


SPARSE_CASES = {
    "indices_int64": (lambda a: dict(indices=a["indices"].long()), TypeError, "indices must have dtype"),
    "indices_rank2": (lambda a: dict(indices=a["indices"][:, 0]), ValueError, "indices must have 3 dimensions"),
    "indices_wrong_batch": (lambda a: dict(indices=a["indices"][:1]), ValueError, "indices must have shape"),
    "indices_wrong_s_q": (lambda a: dict(indices=a["indices"].repeat(1, 2, 1)), ValueError, "indices must have shape"),
    "indices_topk_0": (lambda a: dict(indices=a["indices"][..., :0]), ValueError, "indices must have shape"),
    "topk_length_int64": (lambda a: dict(topk_length=_lens([1, 2], torch.int64)), TypeError, "topk_length must have dtype"),
    "topk_length_wrong_shape": (lambda a: dict(topk_length=_lens([1, 2, 3])), ValueError, "topk_length must have shape"),
    "topk_length_rank2": (lambda a: dict(topk_length=_lens([[1, 2]])), ValueError, "topk_length must have 1"),
    "attn_sink_bf16": (lambda a: dict(attn_sink=torch.zeros(16, dtype=bf16)), TypeError, "attn_sink must have dtype"),
    "attn_sink_wrong_shape": (lambda a: dict(attn_sink=torch.zeros(8)), ValueError, "attn_sink must have shape"),
    "attn_sink_rank2": (lambda a: dict(attn_sink=torch.zeros(1, 16)), ValueError, "attn_sink must have 1"),
    "not_fp8": (lambda a: dict(is_fp8_kvcache=False), ValueError, "is_fp8_kvcache must be True"),
    "causal": (lambda a: dict(causal=True), ValueError, "causal must be False"),
    "q_fp16": (lambda a: dict(q=a["q"].to(fp16)), TypeError, "q must have dtype"),
    "q_rank3": (lambda a: dict(q=a["q"][0]), ValueError, "q must have 4"),
    "q_last_dim": (lambda a: dict(q=a["q"][..., :512]), ValueError, "q must have head_dim"),
    "head_dim_v": (lambda a: dict(head_dim_v=576), ValueError, "head_dim_v must be 512"),
    "k_cache_bf16": (lambda a: dict(k_cache=torch.zeros(2, 64, 1, D_QK, dtype=bf16)), TypeError, "k_cache must have dtype"),
    "k_cache_row_bytes": (lambda a: dict(k_cache=a["k_cache"][..., :576]), ValueError, "k_cache must have shape"),
    "k_cache_h_kv_2": (lambda a: dict(k_cache=a["k_cache"].repeat(1, 1, 2, 1)), ValueError, "k_cache must have shape"),
    "block_table_int64": (lambda a: dict(block_table=torch.zeros(2, 2, dtype=torch.int64)), TypeError, "block_table"),
    "cache_seqlens_rank2": (lambda a: dict(cache_seqlens=torch.zeros(2, 1, dtype=torch.int32)), ValueError, "cache_seqlens"),
    "num_splits_given": (lambda a: dict(num_splits=torch.zeros(3, dtype=torch.int32)), ValueError, "num_splits must be None"),
    "extra_k_cache": (lambda a: dict(extra_k_cache=a["k_cache"]), NotImplementedError, "extra_k_cache"),
    "metadata_not_schedmeta": (lambda a: dict(tile_scheduler_metadata=object()), TypeError, "tile_scheduler_metadata"),
    "backend_unknown": (lambda a: dict(backend="torch"), ValueError, "backend must be one of"),
}


@pytest.mark.parametrize("case", list(SPARSE_CASES))
def test_sparse_decode_rejects(case):
    make, exc, match = SPARSE_CASES[case]
    base = sparse_args()
    with pytest.raises(exc, match=match):
        mla_cute.flash_mla_with_kvcache(**{**base, **make(base)})


def test_sparse_decode_accepts_uint8_cache():
    mla_cute.flash_mla_with_kvcache(**sparse_args(k_cache=sparse_args()["k_cache"].view(torch.uint8)))


# ----------------------------------------------------------------------------- sparse prefill


PREFILL_CASES = {
    "q_rank4": (lambda a: dict(q=a["q"][None]), ValueError, "q must have 3 dimensions"),
    "q_rank2": (lambda a: dict(q=a["q"][0]), ValueError, "q must have 3 dimensions"),
    "q_fp16": (lambda a: dict(q=a["q"].to(fp16)), TypeError, "q must have dtype"),
    "q_last_dim": (lambda a: dict(q=a["q"][..., :512]), ValueError, "q must have head_dim"),
    "kv_two_heads": (lambda a: dict(kv=a["kv"].repeat(1, 2, 1)), ValueError, "kv must have shape"),
    "kv_last_dim": (lambda a: dict(kv=a["kv"][..., :512]), ValueError, "kv must have shape"),
    "kv_rank2": (lambda a: dict(kv=a["kv"][:, 0]), ValueError, "kv must have 3 dimensions"),
    "kv_fp16": (lambda a: dict(kv=a["kv"].to(fp16)), TypeError, "kv must have dtype"),
    "indices_int64": (lambda a: dict(indices=a["indices"].long()), TypeError, "indices must have dtype"),
    "indices_rank2": (lambda a: dict(indices=a["indices"][:, 0]), ValueError, "indices must have 3"),
    "indices_wrong_s_q": (lambda a: dict(indices=a["indices"][:2]), ValueError, "indices must have shape"),
    "indices_two_heads": (lambda a: dict(indices=a["indices"].repeat(1, 2, 1)), ValueError, "indices must have shape"),
    "d_v_576": (lambda a: dict(d_v=576), ValueError, "d_v must be 512"),
    "sm_scale_zero": (lambda a: dict(sm_scale=0.0), ValueError, "sm_scale"),
    "sm_scale_none": (lambda a: dict(sm_scale=None), ValueError, "sm_scale"),
    "topk_length_wrong_shape": (lambda a: dict(topk_length=_lens([1, 2])), ValueError, "topk_length must have shape"),
    "topk_length_int64": (lambda a: dict(topk_length=_lens([1, 2, 3], torch.int64)), TypeError, "topk_length"),
    "attn_sink_wrong_shape": (lambda a: dict(attn_sink=torch.zeros(3)), ValueError, "attn_sink must have shape"),
    "attn_sink_float64": (lambda a: dict(attn_sink=torch.zeros(8, dtype=torch.float64)), TypeError, "attn_sink"),
    "backend_unknown": (lambda a: dict(backend="cuda"), ValueError, "backend must be one of"),
    "backend_cute_on_cpu": (lambda a: dict(backend="cute"), ValueError, "'cute' backend needs CUDA tensors"),
}


@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_sparse_prefill_rejects(case):
    make, exc, match = PREFILL_CASES[case]
    base = prefill_args()
    with pytest.raises(exc, match=match):
        mla_cute.flash_mla_sparse_fwd(**{**base, **make(base)})


def test_sparse_schedule_argument():
    """Sparse calls take a SparseDecodeSchedule (its split policy shapes the metadata); a dense one is refused."""
    from mla_cute.schedules import DenseDecodeSchedule, SparseDecodeSchedule

    meta = mla_cute.get_mla_metadata()[0]
    mla_cute.flash_mla_with_kvcache(**sparse_args(tile_scheduler_metadata=meta),
                                    schedule=SparseDecodeSchedule(num_sm_parts=3))
    assert meta.tile_scheduler_metadata.shape == (3, 8)
    with pytest.raises(TypeError, match="SparseDecodeSchedule"):
        mla_cute.flash_mla_with_kvcache(**sparse_args(tile_scheduler_metadata=mla_cute.get_mla_metadata()[0]),
                                        schedule=DenseDecodeSchedule())
    with pytest.raises(TypeError, match="DenseDecodeSchedule"):
        mla_cute.flash_mla_with_kvcache(**dense_args(tile_scheduler_metadata=mla_cute.get_mla_metadata()[0]),
                                        schedule=SparseDecodeSchedule())
