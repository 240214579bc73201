"""Our quantized caches read by FlashMLA's SM90 sparse decode (where its build runs: ``flash_mla``, every call
``use_legacy=True``): V32, V32_NO_ROPE and V4, and V4 with an extra V4 cache of another page size and lengths on
both, against attention over our dequantized rows (the reference backend's)."""

from __future__ import annotations

import pytest
import torch

import mla_cute
from gpu_cases import assert_close_flashmla
from mla_cute.kv_formats import HEAD_DIM

pytestmark = pytest.mark.gpu
flash_mla = pytest.importorskip("flash_mla", reason="FlashMLA's SM90 build is not installed")


@pytest.mark.parametrize("fmt,extra", [("V32", False), ("V32_NO_ROPE", False), ("V4", False), ("V4", True)])
def test_flashmla_reads_our_caches(fmt, extra):
    g = torch.Generator(device="cuda").manual_seed(0)
    b, s_q, h_q, topk, d = 4, 2, 64, 512, HEAD_DIM[fmt]

    def cache(nb, page):
        return mla_cute.quantize_kv_cache((torch.randn(nb, page, 1, d, generator=g, device="cuda") * 0.5).bfloat16(),
                                          kv_format=fmt)

    k_cache = cache(40, 64)
    q = (torch.randn(b, s_q, h_q, d, generator=g, device="cuda") * 0.5).bfloat16()
    idx = torch.randint(0, 40 * 64, (b, s_q, topk), generator=g, device="cuda", dtype=torch.int32)
    idx[..., ::5] = -1
    kw = dict(kv_format=fmt)
    if extra:
        kw.update(extra_k_cache=cache(20, 32),
                  extra_indices_in_kvcache=torch.randint(0, 640, (b, s_q, 128), generator=g, device="cuda",
                                                         dtype=torch.int32),
                  topk_length=torch.tensor([topk, 100, 0, 300], dtype=torch.int32, device="cuda"),
                  extra_topk_length=torch.tensor([128, 0, 64, 17], dtype=torch.int32, device="cuda"))
    out, lse = flash_mla.flash_mla_with_kvcache(q, k_cache, None, None, 512, flash_mla.get_mla_metadata()[0],
                                                is_fp8_kvcache=True, indices=idx, use_legacy=True, **kw)
    ref_out, ref_lse = mla_cute.flash_mla_with_kvcache(q, k_cache, None, None, 512, mla_cute.get_mla_metadata()[0],
                                                       is_fp8_kvcache=True, indices=idx, backend="reference", **kw)
    assert_close_flashmla("out", out, ref_out, 1e-3, 2.01 / 128, 5e-6)
    assert_close_flashmla("lse", lse, ref_lse, 1e-6, 8.01 / 65536)
