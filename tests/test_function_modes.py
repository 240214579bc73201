"""The public calls under torch's function modes (``torch.set_default_device``, ``set_default_dtype``, a
``TorchFunctionMode``), as FlashMLA's own tests and some engines run them: the modes see none of the calls'
internal torch operations (they cost host time, as every tensor mla-cute makes names its device and dtype), and the
results are those of a call made without them.  The reference backend on the CPU."""

import torch
from torch.overrides import TorchFunctionMode

import mla_cute
from mla_cute import get_mla_metadata


class Counting(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _sparse_inputs():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 1, 16, 576, generator=g).bfloat16()
    cache = mla_cute.quantize_kv_cache((torch.randn(3, 64, 1, 576, generator=g) * 0.3).bfloat16())
    indices = torch.randint(-1, 3 * 64, (2, 1, 64), generator=g, dtype=torch.int32)
    sink = torch.randn(16, generator=g)
    return q, cache, indices, sink


def _sparse(inputs, meta):
    q, cache, indices, sink = inputs
    return mla_cute.flash_mla_with_kvcache(q, cache, None, None, 512, meta, indices=indices, attn_sink=sink)


def test_a_function_mode_sees_none_of_a_calls_operations():
    inputs = _sparse_inputs()
    meta = get_mla_metadata()[0]
    with Counting() as mode:
        first = _sparse(inputs, meta)
        again = _sparse(inputs, meta)
    assert mode.calls == 0
    want = _sparse(inputs, get_mla_metadata()[0])
    for got in (first, again):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_the_calls_match_under_a_default_device_and_dtype():
    inputs = _sparse_inputs()
    want = _sparse(inputs, get_mla_metadata()[0])
    fp4_rows = (torch.randn(2, 64, 1, 512, generator=torch.Generator().manual_seed(4)) * 2).bfloat16()
    want_fp4 = mla_cute.dequantize_kv_cache(mla_cute.quantize_kv_cache(fp4_rows, "V41_FP4"), "V41_FP4")
    dtype, device = torch.get_default_dtype(), torch.get_default_device()
    try:
        torch.set_default_dtype(torch.bfloat16)
        torch.set_default_device("meta")  # a tensor made without its device would be a meta tensor
        meta = get_mla_metadata()[0]
        got = _sparse(inputs, meta), _sparse(inputs, meta)
        got_fp4 = mla_cute.dequantize_kv_cache(mla_cute.quantize_kv_cache(fp4_rows, "V41_FP4"), "V41_FP4")
    finally:
        torch.set_default_device(device)
        torch.set_default_dtype(dtype)
    for out, lse in got:
        assert out.device.type == "cpu" and torch.equal(out, want[0]) and torch.equal(lse, want[1])
    assert torch.equal(got_fp4, want_fp4)
