"""Every bad input is rejected before any work, with an error that names the argument.

A wrong CUDA device cannot be produced on a CPU-only machine; devices with no backend are covered with
``meta`` tensors.
"""

import math

import numpy as np
import pytest
import torch

import mla_cute

D_QK, D_V = 576, 512


# ----------------------------------------------------------------------------- valid baselines

_META = "q is on device meta, which mla-cute does not support: use CPU tensors"


def _on_meta(args, *names):
    """The tensors `names` of a call moved to the meta device (no backend), and the default backend choice."""
    return {**{n: args[n].to("meta") for n in names}, "backend": None}


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
    "q_512_cache_576": (lambda a: dict(q=a["q"][..., :512]), ValueError, "k_cache must have q's head_dim 512"),
    "q_last_dim_520": (lambda a: dict(q=a["q"][..., :520]), ValueError, "q must have head_dim 576 .* or 512"),
    "k_cache_last_dim_512": (lambda a: dict(k_cache=a["k_cache"][..., :512]), ValueError, "k_cache must have q.s head_dim 576"),
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
    "s_q_0": (lambda a: dict(q=a["q"][:, :0]), ValueError, "q must have batch, s_q and h_q >= 1"),
    "h_q_0": (lambda a: dict(q=a["q"][:, :, :0]), ValueError, "q must have batch, s_q and h_q >= 1"),
    "k_cache_0_blocks": (lambda a: dict(k_cache=a["k_cache"][:0]), ValueError, "k_cache must have num_blocks >= 1"),
    "q_on_meta": (lambda a: _on_meta(a, "q", "k_cache", "block_table", "cache_seqlens"), ValueError, _META),
    "softmax_scale_zero": (lambda a: dict(softmax_scale=0.0), ValueError, "softmax_scale"),
    "softmax_scale_negative": (lambda a: dict(softmax_scale=-0.1), ValueError, "softmax_scale"),
    **{f"softmax_scale_{k}": (lambda a, v=v: dict(softmax_scale=v), e, "softmax_scale") for k, (v, e) in {
        "inf": (math.inf, ValueError), "nan": (math.nan, ValueError), "np_inf": (np.float32("inf"), ValueError),
        "tensor_nan": (torch.tensor(math.nan), ValueError), "true": (True, TypeError),
        "np_bool": (np.bool_(True), TypeError), "str": ("0.1", TypeError),
        "tensor_1d": (torch.tensor([0.1]), TypeError), "bool_tensor": (torch.tensor(True), TypeError),
    }.items()},
    "causal_not_bool": (lambda a: dict(causal=1), TypeError, "causal must be a bool"),
    "causal_numpy_int": (lambda a: dict(causal=np.int64(1)), TypeError, "causal must be a bool, got numpy.int64"),
    # arguments that do not belong to the dense path
    "num_splits_given": (lambda a: dict(num_splits=torch.zeros(3, dtype=torch.int32)), ValueError, "num_splits must be None"),
    "attn_sink_on_dense": (lambda a: dict(attn_sink=torch.zeros(4)), ValueError, "attn_sink is only valid"),
    "topk_length_on_dense": (lambda a: dict(topk_length=_lens([1, 1])), ValueError, "topk_length is only valid"),
    "block_table_none": (lambda a: dict(block_table=None), ValueError, "block_table and cache_seqlens are required"),
    "cache_seqlens_none": (lambda a: dict(cache_seqlens=None), ValueError, "block_table and cache_seqlens are required"),
    "extra_k_cache": (lambda a: dict(extra_k_cache=a["k_cache"]), ValueError, "extra_k_cache is only valid for sparse"),
    "extra_indices_in_kvcache": (
        lambda a: dict(extra_indices_in_kvcache=torch.zeros(2, 1, 8, dtype=torch.int32)),
        ValueError, "extra_indices_in_kvcache is only valid for sparse",
    ),
    "extra_topk_length": (lambda a: dict(extra_topk_length=_lens([1, 1])), ValueError, "extra_topk_length is only"),
    "kv_format_on_dense": (lambda a: dict(kv_format="V4"), ValueError, "kv_format is only valid for sparse"),
    "metadata_not_schedmeta": (lambda a: dict(tile_scheduler_metadata=None), TypeError, "tile_scheduler_metadata must be a FlashMLASchedMeta"),
    "metadata_raw_tensor": (
        lambda a: dict(tile_scheduler_metadata=torch.zeros(132, 8, dtype=torch.int32)),
        TypeError, "num_splits must be a tensor beside the other one",
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
    "extra_k_cache_alone": (lambda a: dict(extra_k_cache=a["k_cache"]), ValueError,
                            "extra_k_cache and extra_indices_in_kvcache must be given together"),
    "extra_topk_length_alone": (lambda a: dict(extra_topk_length=_lens([1, 1])), ValueError, "must be given together"),
    "extra_indices_shape": (lambda a: dict(extra_k_cache=a["k_cache"], extra_indices_in_kvcache=a["indices"][:1]),
                            ValueError, "extra_indices_in_kvcache must have shape"),
    "extra_topk_length_shape": (lambda a: dict(extra_k_cache=a["k_cache"], extra_indices_in_kvcache=a["indices"],
                                               extra_topk_length=_lens([1])), ValueError, "extra_topk_length must have"),
    "extra_fp4_beside_v32": (lambda a: dict(extra_k_cache=torch.zeros(2, 64, 1, 288, dtype=torch.uint8),
                                            extra_indices_in_kvcache=a["indices"]), ValueError, "V41_FP4 needs a V41"),
    "extra_other_head_dim": (lambda a: dict(extra_k_cache=torch.zeros(2, 64, 1, 584, dtype=torch.uint8),
                                            extra_indices_in_kvcache=a["indices"]), ValueError, "must hold q's head_dim"),
    "kv_format_unknown": (lambda a: dict(kv_format="V5"), ValueError, "kv_format must be one of"),
    "kv_format_wrong_bytes": (lambda a: dict(kv_format="V4"), ValueError, r"k_cache must have shape .*584"),
    "kv_format_q_head_dim": (lambda a: dict(k_cache=torch.zeros(2, 64, 1, 528, dtype=torch.uint8)), ValueError,
                             "q must have head_dim 512 with a V41 cache"),
    "fp4_as_main": (lambda a: dict(k_cache=torch.zeros(2, 64, 1, 288, dtype=torch.uint8)), ValueError,
                    "V41_FP4 is only valid for extra_k_cache"),
    "v4_on_cute": (lambda a: dict(q=a["q"][..., :512], k_cache=torch.zeros(2, 64, 1, 584, dtype=torch.uint8),
                                  backend="cute"), ValueError, "'cute' backend needs CUDA tensors"),
    "metadata_not_schedmeta": (lambda a: dict(tile_scheduler_metadata=object()), TypeError, "tile_scheduler_metadata"),
    "backend_unknown": (lambda a: dict(backend="torch"), ValueError, "backend must be one of"),
    # empty shapes (each reached the planner or torch before)
    "empty_batch": (lambda a: dict(q=a["q"][:0], indices=a["indices"][:0]), ValueError, "q must have batch"),
    "s_q_0": (lambda a: dict(q=a["q"][:, :0], indices=a["indices"][:, :0]), ValueError, "q must have batch, s_q"),
    "h_q_0": (lambda a: dict(q=a["q"][:, :, :0]), ValueError, "q must have batch, s_q and h_q >= 1"),
    "k_cache_0_blocks": (lambda a: dict(k_cache=a["k_cache"][:0]), ValueError, "k_cache must have num_blocks >= 1"),
    "page_block_size_0": (lambda a: dict(k_cache=a["k_cache"][:, :0]), ValueError, "page_block_size >= 1"),
    "q_on_meta": (lambda a: _on_meta(a, "q", "k_cache", "indices"), ValueError, _META),
    "softmax_scale_inf": (lambda a: dict(softmax_scale=math.inf), ValueError, "softmax_scale"),
    "softmax_scale_nan": (lambda a: dict(softmax_scale=math.nan), ValueError, "softmax_scale"),
    "softmax_scale_false": (lambda a: dict(softmax_scale=False), TypeError, "softmax_scale"),
    "causal_str": (lambda a: dict(causal="no"), TypeError, "causal must be a bool, got str"),
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
    "q_last_dim": (lambda a: dict(q=a["q"][..., :511]), ValueError, "q must have head_dim"),
    "kv_two_heads": (lambda a: dict(kv=a["kv"].repeat(1, 2, 1)), ValueError, "kv must have shape"),
    "kv_last_dim": (lambda a: dict(kv=a["kv"][..., :512]), ValueError, "kv must have shape"),
    "kv_576_with_q_512": (lambda a: dict(q=a["q"][..., :512]), ValueError, r"kv must have shape \[s_kv, 1, 512\]"),
    "kv_rank2": (lambda a: dict(kv=a["kv"][:, 0]), ValueError, "kv must have 3 dimensions"),
    "kv_fp16": (lambda a: dict(kv=a["kv"].to(fp16)), TypeError, "kv must have dtype"),
    "indices_int64": (lambda a: dict(indices=a["indices"].long()), TypeError, "indices must have dtype"),
    "indices_rank2": (lambda a: dict(indices=a["indices"][:, 0]), ValueError, "indices must have 3"),
    "indices_wrong_s_q": (lambda a: dict(indices=a["indices"][:2]), ValueError, "indices must have shape"),
    "indices_two_heads": (lambda a: dict(indices=a["indices"].repeat(1, 2, 1)), ValueError, "indices must have shape"),
    "d_v_576": (lambda a: dict(d_v=576), ValueError, "d_v must be 512"),
    "s_q_0": (lambda a: dict(q=a["q"][:0], indices=a["indices"][:0]), ValueError, "q must have s_q and h_q >= 1"),
    "h_q_0": (lambda a: dict(q=a["q"][:, :0]), ValueError, "q must have s_q and h_q >= 1"),
    "s_kv_0": (lambda a: dict(kv=a["kv"][:0]), ValueError, "kv must have s_kv >= 1"),
    "q_on_meta": (lambda a: _on_meta(a, "q", "kv", "indices"), ValueError, _META),
    "q_on_meta_reference": (lambda a: {**_on_meta(a, "q", "kv", "indices"), "backend": "reference"}, ValueError, _META),
    "sm_scale_zero": (lambda a: dict(sm_scale=0.0), ValueError, "sm_scale"),
    "sm_scale_negative": (lambda a: dict(sm_scale=-1), ValueError, "sm_scale"),
    "sm_scale_inf": (lambda a: dict(sm_scale=math.inf), ValueError, "sm_scale"),
    "sm_scale_nan": (lambda a: dict(sm_scale=np.float64("nan")), ValueError, "sm_scale"),
    "sm_scale_true": (lambda a: dict(sm_scale=True), TypeError, "sm_scale"),
    "sm_scale_none": (lambda a: dict(sm_scale=None), TypeError, "sm_scale"),
    "topk_length_wrong_shape": (lambda a: dict(topk_length=_lens([1, 2])), ValueError, "topk_length must have shape"),
    "topk_length_int64": (lambda a: dict(topk_length=_lens([1, 2, 3], torch.int64)), TypeError, "topk_length"),
    "attn_sink_wrong_shape": (lambda a: dict(attn_sink=torch.zeros(3)), ValueError, "attn_sink must have shape"),
    "attn_sink_float64": (lambda a: dict(attn_sink=torch.zeros(8, dtype=torch.float64)), TypeError, "attn_sink"),
    "backend_unknown": (lambda a: dict(backend="cuda"), ValueError, "backend must be one of"),
    "backend_cute_on_cpu": (lambda a: dict(backend="cute"), ValueError, "'cute' backend needs CUDA tensors"),
}


def _fp8_kv(a):
    return mla_cute.quantize_kv_cache(torch.randn(2, 32, 1, D_QK).bfloat16())


PREFILL_CASES.update({
    "fp8_kv_q_512": (lambda a: dict(q=a["q"][..., :512], kv=_fp8_kv(a)), ValueError, "q must have head_dim 576 with"),
    "fp8_kv_row_bytes": (lambda a: dict(kv=_fp8_kv(a)[..., :640]), ValueError, "kv as the FP8 cache must have shape"),
    "fp8_kv_two_heads": (lambda a: dict(kv=_fp8_kv(a).repeat(1, 1, 2, 1)), ValueError, "kv as the FP8 cache"),
    "fp8_kv_bf16_rank4": (lambda a: dict(kv=a["kv"][None]), TypeError, "kv must have dtype torch.float8_e4m3fn"),
    "fp8_kv_no_blocks": (lambda a: dict(kv=_fp8_kv(a)[:0]), ValueError, "kv must have num_blocks >= 1"),
    "fp8_kv_indices_shape": (lambda a: dict(kv=_fp8_kv(a), indices=a["indices"][:1]), ValueError,
                             "indices must have shape"),
    "fp8_kv_cute_on_cpu": (lambda a: dict(kv=_fp8_kv(a), backend="cute"), ValueError,
                           "'cute' backend needs CUDA tensors"),
})


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


# ----------------------------------------------------------------------------- scales and causal FlashMLA accepts

SCALES = {
    "np_float32": np.float32(0.25), "np_float64": np.float64(0.3), "tensor": torch.tensor(0.2),
    "tensor_float64": torch.tensor(0.15, dtype=torch.float64), "int": 1, "np_int": np.int32(1),
}


@pytest.mark.parametrize("path", ["dense", "sparse", "prefill"])
@pytest.mark.parametrize("kind", list(SCALES))
def test_scale_accepted_as_float(path, kind):
    """A numpy number or a 0-dim tensor counts as the float it holds (FlashMLA reads one with float())."""
    scale = SCALES[kind]
    if path == "prefill":
        got, want = (mla_cute.flash_mla_sparse_fwd(**prefill_args(sm_scale=s)) for s in (scale, float(scale)))
    else:
        make = dense_args if path == "dense" else sparse_args
        got, want = (mla_cute.flash_mla_with_kvcache(**make(softmax_scale=s)) for s in (scale, float(scale)))
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("value", [True, False])
def test_causal_numpy_bool_is_a_bool(value):
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 2, 4, D_QK, generator=gen).bfloat16()  # s_q = 2: causal matters
    got = mla_cute.flash_mla_with_kvcache(**dense_args(q=q, causal=np.bool_(value)))
    want = mla_cute.flash_mla_with_kvcache(**dense_args(q=q, causal=value))
    assert all(torch.equal(g, w) for g, w in zip(got, want))


META_CALLS = {
    "dense": (mla_cute.flash_mla_with_kvcache, dense_args, ("q", "k_cache", "block_table", "cache_seqlens")),
    "sparse": (mla_cute.flash_mla_with_kvcache, sparse_args, ("q", "k_cache", "indices")),
    "prefill": (mla_cute.flash_mla_sparse_fwd, prefill_args, ("q", "kv", "indices")),
}


@pytest.mark.parametrize("path", list(META_CALLS))
def test_device_checked_before_backend_selection(path, monkeypatch):
    """A device with no backend is named with the supported ones, before backend selection (whose torch.cuda
    queries raised "Torch not compiled with CUDA enabled")."""
    import mla_cute.api as api

    def select(*a, **k):
        raise AssertionError("backend selection ran before the device check")

    monkeypatch.setattr(api, "select_backend", select)
    call, make, names = META_CALLS[path]
    base = make()
    with pytest.raises(ValueError, match=_META + r".*CUDA tensors \(the 'cute' kernels on an SM90 GPU"):
        call(**{**base, **_on_meta(base, *names)})
    other = names[1]  # q on the CPU, another tensor on meta
    with pytest.raises(ValueError, match=f"{other} must be on the same device as q"):
        call(**{**base, other: base[other].to("meta")})


# ----------------------------------------------------------------------------- metadata after a rejected call

BAD_SPARSE_CALLS = {name: SPARSE_CASES[name] for name in (
    "empty_batch", "s_q_0", "h_q_0", "k_cache_0_blocks", "page_block_size_0", "q_on_meta", "softmax_scale_inf",
    "indices_topk_0", "causal_str")}
BAD_DENSE_CALLS = {name: DENSE_CASES[name] for name in (
    "empty_batch", "s_q_0", "h_q_0", "k_cache_0_blocks", "q_on_meta", "softmax_scale_inf", "softmax_scale_nan",
    "causal_numpy_int")}
BAD_CALLS = {**{("sparse", k): (sparse_args, v) for k, v in BAD_SPARSE_CALLS.items()},
             **{("dense", k): (dense_args, v) for k, v in BAD_DENSE_CALLS.items()}}


@pytest.mark.parametrize("key", list(BAD_CALLS), ids="-".join)
def test_rejected_first_call_leaves_metadata_empty(key):
    """A first call that fails its checks does not bind the metadata (a b=0 sparse call used to bind it to b=0)."""
    make_args, (bad, exc, match) = BAD_CALLS[key]
    meta = mla_cute.get_mla_metadata()[0]
    base = make_args(tile_scheduler_metadata=meta)
    with pytest.raises(exc, match=match):
        mla_cute.flash_mla_with_kvcache(**{**base, **bad(base)})
    assert not meta.have_initialized and meta.config is None
    out, lse = mla_cute.flash_mla_with_kvcache(**make_args(tile_scheduler_metadata=meta))
    assert meta.config.b == out.shape[0] == 2 and meta.tile_scheduler_metadata is not None


@pytest.mark.parametrize("key", list(BAD_CALLS), ids="-".join)
def test_rejected_later_call_keeps_metadata(key):
    make_args, (bad, exc, match) = BAD_CALLS[key]
    meta = mla_cute.get_mla_metadata()[0]
    want = mla_cute.flash_mla_with_kvcache(**make_args(tile_scheduler_metadata=meta))
    config, records, splits = meta.config, meta.tile_scheduler_metadata, meta.num_splits
    base = make_args(tile_scheduler_metadata=meta)
    with pytest.raises(exc, match=match):
        mla_cute.flash_mla_with_kvcache(**{**base, **bad(base)})
    assert meta.config == config and meta.tile_scheduler_metadata is records and meta.num_splits is splits
    got = mla_cute.flash_mla_with_kvcache(**make_args(tile_scheduler_metadata=meta))
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("path", ["dense", "sparse"])
def test_first_call_failing_after_its_checks_unbinds_metadata(path, monkeypatch):
    """Work that fails after the binding (a kernel, the planner) leaves the metadata as get_mla_metadata made it."""
    from mla_cute.backends import reference

    name, make_args = ("dense_decode", dense_args) if path == "dense" else ("sparse_decode_fp8", sparse_args)
    real = getattr(reference, name)

    def fail(*a, **k):
        raise RuntimeError("the backend failed")

    monkeypatch.setattr(reference, name, fail)
    meta = mla_cute.get_mla_metadata()[0]
    with pytest.raises(RuntimeError, match="the backend failed"):
        mla_cute.flash_mla_with_kvcache(**make_args(tile_scheduler_metadata=meta))
    assert meta == mla_cute.get_mla_metadata()[0]
    monkeypatch.setattr(reference, name, real)
    args = make_args(tile_scheduler_metadata=meta)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(args["q"].shape[0], 1, 32, D_QK, generator=gen).bfloat16()  # another h_q than the failed call
    mla_cute.flash_mla_with_kvcache(**{**args, "q": q})
    assert meta.config.h_q == 32


# ----------------------------------------------------------------------------- the replay fast path

@pytest.fixture
def on_cute(monkeypatch):
    """The public API on the cute backend over CPU tensors, its kernels replaced by recorders of their
    scale argument (the last one), counting the full path's checks."""
    import mla_cute.api as api
    import mla_cute.kernels.build as build

    calls = {"scales": [], "checks": 0}

    def compile_kernel(*a, **k):
        return lambda *args: calls["scales"].append(args[-1])

    monkeypatch.setattr(build, "compile_dense", compile_kernel)
    monkeypatch.setattr(build, "compile_sparse", compile_kernel)
    monkeypatch.setattr(build, "compile_scheduler", lambda *a, **k: lambda *args: None)
    monkeypatch.setattr(api, "select_backend", lambda device, backend=None: "cute")
    for check in ("check_dense", "check_sparse_decode"):
        def counted(*args, _real=getattr(api.V, check)):
            calls["checks"] += 1
            return _real(*args)

        monkeypatch.setattr(api.V, check, counted)
    return calls


def _cute_args(path):
    """A call the cute backend takes; replays need the same tensors (the lengths above all) on every call."""
    gen = torch.Generator().manual_seed(6)
    meta = mla_cute.get_mla_metadata()[0]
    if path == "dense":
        return dense_args(tile_scheduler_metadata=meta, backend=None)
    q = torch.randn(2, 1, 64, D_QK, generator=gen).bfloat16()
    return sparse_args(q=q, indices=torch.randint(0, 128, (2, 1, 64), generator=gen, dtype=torch.int32),
                       tile_scheduler_metadata=meta, backend=None)


REPLAY_BAD_SCALES = {
    "inf": (math.inf, ValueError), "nan": (math.nan, ValueError), "negative": (-0.5, ValueError),
    "np_inf": (np.float64("inf"), ValueError), "np_nan": (np.float32("nan"), ValueError),
    "tensor_inf": (torch.tensor(math.inf), ValueError), "true": (True, TypeError),
    "np_true": (np.bool_(True), TypeError),
    "tensor_1d": (torch.tensor([0.5]), TypeError), "str": ("0.5", TypeError), "huge_int": (10 ** 400, ValueError),
}


@pytest.mark.parametrize("path", ["dense", "sparse"])
@pytest.mark.parametrize("kind", list(REPLAY_BAD_SCALES))
def test_replay_never_accepts_a_bad_scale(on_cute, path, kind):
    value, exc = REPLAY_BAD_SCALES[kind]
    args = _cute_args(path)
    mla_cute.flash_mla_with_kvcache(**args)
    mla_cute.flash_mla_with_kvcache(**args)
    assert args["tile_scheduler_metadata"]._replay is not None and on_cute["checks"] == 1, "the second call replays"
    with pytest.raises(exc, match="softmax_scale"):
        mla_cute.flash_mla_with_kvcache(**args, softmax_scale=value)
    assert len(on_cute["scales"]) == 2, "no launch"
    mla_cute.flash_mla_with_kvcache(**args)  # the metadata still replays
    assert len(on_cute["scales"]) == 3 and on_cute["checks"] == 1


@pytest.mark.parametrize("path", ["dense", "sparse"])
@pytest.mark.parametrize("kind", list(SCALES))
def test_replay_converts_scales_as_the_checked_path(on_cute, path, kind):
    value = SCALES[kind]
    args = _cute_args(path)
    mla_cute.flash_mla_with_kvcache(**{**args, "tile_scheduler_metadata": mla_cute.get_mla_metadata()[0]},
                                    softmax_scale=value)  # checked
    mla_cute.flash_mla_with_kvcache(**args)
    mla_cute.flash_mla_with_kvcache(**args, softmax_scale=value)  # replayed
    checked, _, replayed = on_cute["scales"]
    assert on_cute["checks"] == 2 and replayed == checked
    assert math.isclose(replayed, float(value) * math.log2(math.e), rel_tol=1e-12)


@pytest.mark.parametrize("s_q", [1, 2])  # s_q = 1: causal is ignored, and used to keep every call off the replay
def test_replay_takes_numpy_causal(on_cute, s_q):
    args = _cute_args("dense")
    args["q"] = args["q"][:, :1].expand(-1, s_q, -1, -1).contiguous()
    mla_cute.flash_mla_with_kvcache(**args, causal=True)
    mla_cute.flash_mla_with_kvcache(**args, causal=True)
    mla_cute.flash_mla_with_kvcache(**args, causal=np.bool_(True))
    assert on_cute["checks"] == 1 and len(on_cute["scales"]) == 3
    with pytest.raises(TypeError, match="causal must be a bool, got int"):
        mla_cute.flash_mla_with_kvcache(**args, causal=1)
    assert len(on_cute["scales"]) == 3


@pytest.mark.parametrize("fmt", ["V4", "V41_PAGED"])
@pytest.mark.parametrize("which", ["k_cache", "extra_k_cache"])
def test_sparse_decode_refuses_a_page_narrowed_page_blocked_cache(fmt, which):
    """A page-blocked cache narrowed along the page dimension (``c[:, :32]`` of a page-64 cache), as the main or
    the extra cache: a ValueError naming the argument (its scale rows would be read from the wrong place); the same
    call with the whole cache, or a packed copy of it, runs."""
    gen = torch.Generator().manual_seed(7)
    whole = mla_cute.quantize_kv_cache(torch.randn(2, 64, 1, 512, generator=gen).bfloat16(), kv_format=fmt)
    args = sparse_args(q=torch.randn(2, 1, 16, 512, generator=gen).bfloat16(), k_cache=whole, kv_format=fmt,
                       indices=torch.randint(0, 64, (2, 1, 32), generator=gen, dtype=torch.int32))
    extra = dict(extra_indices_in_kvcache=torch.randint(0, 64, (2, 1, 8), generator=gen, dtype=torch.int32))
    for cache, ok in [(whole, True), (whole.clone(), True), (whole[:, :32], False), (whole[:, 32:], False),
                      (whole[:1, :32], False)]:
        call = dict(args, k_cache=cache) if which == "k_cache" else dict(args, extra_k_cache=cache, **extra)
        call["tile_scheduler_metadata"] = mla_cute.get_mla_metadata()[0]
        if ok:
            out, lse = mla_cute.flash_mla_with_kvcache(**call)
            assert torch.isfinite(out.float()).all()
        else:
            with pytest.raises(ValueError, match=f"^{which} must be whole {fmt} pages of its page_block_size 32"):
                mla_cute.flash_mla_with_kvcache(**call)
