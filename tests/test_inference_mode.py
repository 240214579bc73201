"""Every public call under ``torch.inference_mode()`` and ``torch.no_grad()`` (as inference engines run them),
with tensors made inside or outside the mode, on the first call and on metadata reuse: the reference backend
on the CPU.  The cute backend's host path under the same modes is in ``test_cute_backend_glue.py``."""

import pytest
import torch

import mla_cute
from mla_cute import get_mla_metadata

MODES = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad}


def _dense_inputs(gen):
    q = torch.randn(2, 2, 16, 576, generator=gen).to(torch.bfloat16)
    k_cache = torch.randn(4, 64, 1, 576, generator=gen).to(torch.bfloat16)
    block_table = torch.tensor([[0, 2], [3, 1]], dtype=torch.int32)
    seqlens = torch.tensor([100, 70], dtype=torch.int32)
    return q, k_cache, block_table, seqlens


def _sparse_inputs(gen):
    q = torch.randn(2, 1, 64, 576, generator=gen).to(torch.bfloat16)
    k_cache = mla_cute.quantize_kv_cache(torch.randn(3, 64, 1, 576, generator=gen).to(torch.bfloat16))
    indices = torch.randint(-1, 3 * 64, (2, 1, 96), generator=gen, dtype=torch.int32)
    topk_length = torch.tensor([96, 40], dtype=torch.int32)
    return q, k_cache, indices, topk_length


def _dense(inputs, meta, **kw):
    q, k_cache, block_table, seqlens = inputs
    return mla_cute.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, meta, causal=True, **kw)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("made_inside", [True, False])
def test_dense_decode_first_call_and_reuse(mode, made_inside):
    gen = torch.Generator().manual_seed(1)
    if not made_inside:
        inputs = _dense_inputs(gen)
    with MODES[mode]():
        if made_inside:
            inputs = _dense_inputs(gen)
        meta = get_mla_metadata()[0]
        first = _dense(inputs, meta)
        again = _dense(inputs, meta)  # the metadata reused, as the layers of one decode step do
        assert meta.have_initialized
        # Another lengths tensor with other values is still caught (its values are compared).
        other = inputs[3].clone()
        other[0] -= 1
        with pytest.raises(ValueError, match="cache_seqlens/topk_length values"):
            _dense(inputs[:3] + (other,), meta)
    expect = _dense(inputs, get_mla_metadata()[0])  # outside the mode: the same numbers
    for a, b in ((first, expect), (again, expect)):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_dense_lengths_made_outside_and_written_inside_are_seen():
    """A normal tensor keeps its version counter inside inference mode: an in-place write there is caught."""
    inputs = _dense_inputs(torch.Generator().manual_seed(2))
    meta = get_mla_metadata()[0]
    with torch.inference_mode():
        _dense(inputs, meta)
        inputs[3][1] += 1
        with pytest.raises(ValueError, match="cache_seqlens/topk_length values"):
            _dense(inputs, meta)


@pytest.mark.parametrize("mode", MODES)
def test_sparse_decode_and_prefill(mode):
    gen = torch.Generator().manual_seed(3)
    with MODES[mode]():
        q, k_cache, indices, topk_length = _sparse_inputs(gen)
        sink = torch.randn(64, generator=gen)
        meta = get_mla_metadata()[0]
        kw = dict(is_fp8_kvcache=True, indices=indices, topk_length=topk_length, attn_sink=sink)
        out, lse = mla_cute.flash_mla_with_kvcache(q, k_cache, None, None, 512, meta, **kw)
        out2, lse2 = mla_cute.flash_mla_with_kvcache(q, k_cache, None, None, 512, meta, **kw)
        assert torch.equal(out, out2) and torch.equal(lse, lse2)
        kv = torch.randn(200, 1, 576, generator=gen).to(torch.bfloat16)
        idx = torch.randint(-1, 200, (5, 1, 64), generator=gen, dtype=torch.int32)
        qp = torch.randn(5, 16, 576, generator=gen).to(torch.bfloat16)
        p_out, p_max, p_lse = mla_cute.flash_mla_sparse_fwd(qp, kv, idx, 0.05)
        round_trip = mla_cute.dequantize_kv_cache(mla_cute.quantize_kv_cache(kv.view(200, 1, 1, 576)))
    assert out.shape == (2, 1, 64, 512) and p_out.shape == (5, 16, 512) and round_trip.shape == (200, 1, 1, 576)
    expect = mla_cute.flash_mla_with_kvcache(q, k_cache, None, None, 512, get_mla_metadata()[0], **kw)
    assert torch.equal(out, expect[0]) and torch.equal(lse, expect[1])
    assert torch.equal(p_lse, mla_cute.flash_mla_sparse_fwd(qp, kv, idx, 0.05)[2])
