"""Dense decode over the 656-byte FP8 cache on the GPU (the sparse kernel over every position of each request)
against the reference (dense decode over the dequantized cache): varlen with empty requests, causal s_q > 1, head
counts, page sizes, unused tokens' bytes poisoned, a CUDA graph replayed with new lengths."""

from __future__ import annotations

import pytest
import torch

from gpu_cases import assert_close_flashmla, poison_allocator
from test_sparse_decode_gpu import LSE_ABS, LSE_REL, OUT_ABS, OUT_COS, OUT_REL

pytestmark = pytest.mark.gpu


def _case(b, s_q, h_q, lengths, page=64, seed=0):
    """A 656-byte cache whose tokens past each length (and unused blocks) hold 0xFF bytes (NaN e4m3 codes and
    scales), a block table of distinct blocks in random order."""
    from mla_cute.kv_formats import quantize_kv_cache

    g = torch.Generator().manual_seed(seed)
    blocks = -(-max(max(lengths), 1) // page)
    num_blocks = b * blocks + 3
    cache = quantize_kv_cache((torch.randn(num_blocks, page, 1, 576, generator=g) * 0.1).clamp(-1, 1).bfloat16())
    table = torch.randperm(num_blocks, generator=g)[: b * blocks].int().view(b, blocks)
    used = torch.zeros(num_blocks * page, dtype=torch.bool)
    for i, n in enumerate(lengths):
        for t in range(n):
            used[int(table[i, t // page]) * page + t % page] = True
    cache.view(torch.uint8).view(num_blocks * page, 656)[~used] = 0xFF
    q = (torch.randn(b, s_q, h_q, 576, generator=g) * 0.1).clamp(-1, 1).bfloat16()
    return dict(q=q.cuda(), k_cache=cache.cuda(), block_table=table.cuda(),
                cache_seqlens=torch.tensor(lengths, dtype=torch.int32).cuda())


def _run(case, causal, backend="cute", meta=None):
    import mla_cute

    return mla_cute.flash_mla_with_kvcache(**case, head_dim_v=512, causal=causal, is_fp8_kvcache=True,
                                           tile_scheduler_metadata=meta or mla_cute.get_mla_metadata()[0],
                                           backend=backend)


def _check(got, want):
    assert_close_flashmla("out", got[0], want[0], OUT_ABS, OUT_REL, OUT_COS)
    assert_close_flashmla("lse", got[1], want[1], LSE_ABS, LSE_REL)


@pytest.mark.parametrize("b,s_q,h_q,causal,page,lengths", [
    (4, 1, 128, False, 64, [4096, 0, 1, 3000]),
    (4, 2, 128, True, 64, [2048, 65, 0, 777]),
    (3, 2, 64, True, 128, [5000, 2, 300]),
    (2, 1, 16, False, 64, [64, 10000]),
    (1, 3, 128, True, 64, [129]),
])
def test_dense_over_the_656_byte_cache(b, s_q, h_q, causal, page, lengths):
    import mla_cute

    case = _case(b, s_q, h_q, lengths, page)
    want = _run(case, causal, "reference")
    meta = mla_cute.get_mla_metadata()[0]
    for _ in range(2):  # the first call plans, the second reuses the metadata
        poison_allocator()
        got = _run(case, causal, meta=meta)
        torch.cuda.synchronize()
        _check(got, want)


def test_dense_over_the_656_byte_cache_in_a_cuda_graph():
    """Captured once, replayed after the lengths change in place (shorter: the poison stays past them)."""
    import mla_cute

    case = _case(4, 2, 128, [3000, 0, 700, 64])
    lens = case["cache_seqlens"]
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode():
        static = lens.clone()
        with torch.cuda.graph(graph):
            out, lse = _run(dict(case, cache_seqlens=static), True, meta=mla_cute.get_mla_metadata()[0])
        for new in ([3000, 0, 700, 64], [5, 0, 1, 64], [2999, 0, 0, 63]):
            static.copy_(torch.tensor(new, dtype=torch.int32))
            graph.replay()
            torch.cuda.synchronize()
            _check((out, lse), _run(dict(case, cache_seqlens=static.clone()), True, "reference"))
