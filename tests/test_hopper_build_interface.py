"""FlashMLA's Hopper build's interface (sgl-flash-mla): its extra arguments in its positional order, its
``is_fp8_kvcache=None`` rule, ``return_log2_lse``, and ``mla_cute.flash_mla`` as the module engines import."""

from __future__ import annotations

import math

import pytest
import torch

import mla_cute


def _sparse_case(b=2, s_q=1, h_q=16, topk=64):
    from mla_cute import quantize_kv_cache

    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, s_q, h_q, 576, generator=g).bfloat16()
    cache = quantize_kv_cache((torch.randn(4, 64, 1, 576, generator=g) * 0.1).bfloat16())
    indices = torch.randint(-1, 256, (b, s_q, topk), generator=g, dtype=torch.int32)
    sink = torch.randn(h_q, generator=g)
    return q, cache, indices, sink


def test_decode_takes_the_hopper_builds_arguments_in_its_positional_order():
    q, cache, indices, sink = _sparse_case()
    meta = mla_cute.get_mla_metadata()[0]
    # q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits, softmax_scale,
    # causal, is_fp8_kvcache, indices, attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length,
    # extra_topk_length, enable_batch_invariant, use_legacy, kv_format, descale_q, descale_k
    out, lse = mla_cute.flash_mla_with_kvcache(q, cache, None, None, 512, meta, None, 0.07, False, None, indices,
                                               sink, None, None, None, None, False, True, "V32", None, None)
    ref_out, ref_lse = mla_cute.flash_mla_with_kvcache(q, cache, None, None, 512, mla_cute.get_mla_metadata()[0],
                                                       softmax_scale=0.07, is_fp8_kvcache=True, indices=indices,
                                                       attn_sink=sink)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def test_is_fp8_kvcache_none_follows_indices():
    q = torch.randn(1, 1, 16, 576).bfloat16()
    k = torch.randn(1, 64, 1, 576).bfloat16()
    table = torch.zeros(1, 1, dtype=torch.int32)
    lens = torch.tensor([40], dtype=torch.int32)
    out, _ = mla_cute.flash_mla_with_kvcache(q, k, table, lens, 512, mla_cute.get_mla_metadata()[0])  # dense
    ref, _ = mla_cute.flash_mla_with_kvcache(q, k, table, lens, 512, mla_cute.get_mla_metadata()[0],
                                             is_fp8_kvcache=False)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("kw,error,match", [
    (dict(enable_batch_invariant=1), TypeError, "enable_batch_invariant must be a bool"),
    (dict(use_legacy=1), TypeError, "use_legacy must be a bool"),
    (dict(descale_q=torch.ones(1)), ValueError, "descale_q applies to dense decode"),
    (dict(descale_k=torch.ones(1)), ValueError, "descale_k applies to dense decode"),
])
def test_decode_refuses_what_is_not_built_naming_the_argument(kw, error, match):
    q, cache, indices, sink = _sparse_case()
    meta = mla_cute.get_mla_metadata()[0]
    with pytest.raises(error, match=match):
        mla_cute.flash_mla_with_kvcache(q, cache, None, None, 512, meta, indices=indices, **kw)
    assert not meta.have_initialized  # refused before any work


def _prefill_case(s_q=3, h_q=16, s_kv=80, topk=64):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(s_q, h_q, 576, generator=g).bfloat16()
    kv = torch.randn(s_kv, 1, 576, generator=g).bfloat16()
    indices = torch.randint(-1, s_kv, (s_q, 1, topk), generator=g, dtype=torch.int32)
    indices[0] = -1  # nothing to attend: max_logits -inf, lse +inf
    return q, kv, indices


def test_prefill_return_log2_lse():
    q, kv, indices = _prefill_case()
    out, max_logits, lse = mla_cute.flash_mla_sparse_fwd(q, kv, indices, 0.1)
    out2, m2, l2 = mla_cute.flash_mla_sparse_fwd(q, kv, indices, 0.1, 512, None, None, True, True)
    assert torch.equal(out, out2)
    assert torch.allclose(m2[1:], max_logits[1:] * math.log2(math.e)) and torch.allclose(l2[1:], lse[1:] * math.log2(math.e))
    assert torch.all(torch.isneginf(m2[0])) and torch.all(torch.isposinf(l2[0]))
    out3, m3, l3 = mla_cute.flash_mla_sparse_fwd(q, kv, indices, 0.1, return_log2_lse=False)
    assert torch.equal(out, out3) and m3 is None and l3 is None
    with pytest.raises(TypeError, match="return_log2_lse"):
        mla_cute.flash_mla_sparse_fwd(q, kv, indices, 0.1, return_log2_lse=1)
    with pytest.raises(TypeError, match="use_legacy"):
        mla_cute.flash_mla_sparse_fwd(q, kv, indices, 0.1, use_legacy="yes")


def test_flash_mla_module_serves_flashmlas_names():
    import mla_cute.flash_mla as flash_mla

    assert flash_mla.flash_mla_with_kvcache is mla_cute.flash_mla_with_kvcache
    assert flash_mla.flash_mla_sparse_fwd is mla_cute.flash_mla_sparse_fwd
    meta, none = flash_mla.get_mla_metadata()
    assert isinstance(meta, flash_mla.FlashMLASchedMeta) and none is None


def test_out_on_the_reference_backend_decode_and_prefill():
    q, cache, indices, sink = _sparse_case()
    ref, lse = mla_cute.flash_mla_with_kvcache(q, cache, None, None, 512, mla_cute.get_mla_metadata()[0],
                                               indices=indices, attn_sink=sink)
    mine = torch.full_like(ref, float("nan"))
    out, lse2 = mla_cute.flash_mla_with_kvcache(q, cache, None, None, 512, mla_cute.get_mla_metadata()[0],
                                                indices=indices, attn_sink=sink, out=mine)
    assert out is mine and torch.equal(out, ref) and torch.equal(lse, lse2)
    pq, kv, pidx = _prefill_case()
    pref = mla_cute.flash_mla_sparse_fwd(pq, kv, pidx, 0.1)
    pmine = torch.full_like(pref[0], float("nan"))
    pout = mla_cute.flash_mla_sparse_fwd(pq, kv, pidx, 0.1, out=pmine)
    assert pout[0] is pmine and torch.equal(pmine, pref[0]) and torch.equal(pout[2], pref[2])
    with pytest.raises(ValueError, match="out must be"):
        mla_cute.flash_mla_sparse_fwd(pq, kv, pidx, 0.1, out=pmine[:, :8])


def test_api_reference_covers_every_public_name_and_argument():
    """docs/api.md names every public function of the package and every argument of the two attention calls."""
    import inspect
    import pathlib

    text = (pathlib.Path(__file__).parent.parent / "docs" / "api.md").read_text()
    for name in mla_cute.__all__:
        assert f"`{name}" in text, name
    for fn in (mla_cute.flash_mla_with_kvcache, mla_cute.flash_mla_sparse_fwd):
        for arg in inspect.signature(fn).parameters:
            assert f"`{arg}`" in text, (fn.__name__, arg)


@pytest.mark.parametrize("field", ["tile_scheduler_metadata", "num_splits"])
def test_metadata_tensors_put_on_an_empty_object_are_refused(field):
    """An engine that fills an empty object's tensors itself (vLLM's batch-invariant mode) gets an error, not a plan
    of mla-cute's in their place."""
    q, cache, indices, sink = _sparse_case()
    meta = mla_cute.get_mla_metadata()[0]
    setattr(meta, field, torch.zeros(1, 8, dtype=torch.int32) if field == "tile_scheduler_metadata"
            else torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="made outside mla-cute"):
        mla_cute.flash_mla_with_kvcache(q, cache, None, None, 512, meta, indices=indices)
    assert not meta.have_initialized


def test_metadata_planned_inside_a_capture_is_refused_outside_it():
    """A metadata object whose first call ran inside a CUDA graph capture is planned again only by that graph's
    replays: a call outside the graph is refused before any work (the flag stands in for the capture, which needs
    a GPU; the GPU tests capture for real)."""
    q, cache, indices, sink = _sparse_case()
    meta = mla_cute.get_mla_metadata()[0]
    mla_cute.flash_mla_with_kvcache(q, cache, None, None, 512, meta, indices=indices)
    meta._in_capture = True
    with pytest.raises(ValueError, match="computed inside a CUDA graph capture"):
        mla_cute.flash_mla_with_kvcache(q, cache, None, None, 512, meta, indices=indices)


def test_metadata_planned_in_one_capture_is_refused_in_another(monkeypatch):
    """The scheduler kernel of a metadata object planned inside a capture is in that graph only: a call inside a
    second capture is refused before any work, a later call of the same capture is not (the capture state and
    the driver's capture id are stood in for; the GPU tests capture for real)."""
    import mla_cute.api as api

    q, cache, indices, sink = _sparse_case()
    current = {"id": 7}
    monkeypatch.setattr(api, "_capturing", lambda q: True)
    monkeypatch.setattr(api, "capture_id", lambda device: current["id"])
    meta = mla_cute.get_mla_metadata()[0]
    first = mla_cute.flash_mla_with_kvcache(q, cache, None, None, 512, meta, indices=indices)
    again = mla_cute.flash_mla_with_kvcache(q, cache, None, None, 512, meta, indices=indices)  # the next layer
    assert torch.equal(first[0], again[0]) and meta._capture_id == 7
    current["id"] = 8
    with pytest.raises(ValueError, match="computed inside another CUDA graph capture"):
        mla_cute.flash_mla_with_kvcache(q, cache, None, None, 512, meta, indices=indices)
