"""Values no check sees, on the reference backend: read as the kernels read them (docs/engines.md, "Values no
check sees"; ``mla_cute.validation``'s rule), so both backends give one result for the same values.

A dense call with a fresh metadata object checks its block table and lengths on the host; a later call with
that object does not (a new block table or cache, lengths written where the version counter does not see
it).  There the reference takes each length within what the table covers and reads a used block outside the
cache as zeros (over an FP8 cache: skips its tokens), as the kernels do, instead of wrapping a negative id or
raising an IndexError.
"""

import pytest
import torch

import mla_cute
from mla_cute import validation as V

D_QK, D_V = 576, 512
PAGE = 64


def _case(s_q=1, fp8=False):
    """b=2, h_q=4, h_kv=1, page 64, 4 blocks; request 0 uses blocks 0 (10 tokens), request 1 blocks 2, 3
    (100 tokens)."""
    gen = torch.Generator().manual_seed(7)
    cache = torch.randn(4, PAGE, 1, D_QK, generator=gen).bfloat16()
    return dict(
        q=torch.randn(2, s_q, 4, D_QK, generator=gen).bfloat16(),
        k_cache=mla_cute.quantize_kv_cache(cache) if fp8 else cache,
        block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        cache_seqlens=torch.tensor([10, 100], dtype=torch.int32),
        head_dim_v=D_V,
        is_fp8_kvcache=fp8,
        backend="reference",
    )


def _call(args, meta=None, causal=False):
    return mla_cute.flash_mla_with_kvcache(
        **args, tile_scheduler_metadata=meta or mla_cute.get_mla_metadata()[0], causal=causal)


def _zero_block(k_cache):
    """One block of zeros in the cache's layout (an FP8 cache: the quantized zeros, which read back as 0)."""
    if k_cache.dtype == torch.bfloat16:
        return torch.zeros_like(k_cache[:1])
    return mla_cute.quantize_kv_cache(torch.zeros(1, k_cache.shape[1], 1, D_QK, dtype=torch.bfloat16))


def _same(got, want):
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)


BAD_IDS = {"-1": -1, "-5": -5, "num_blocks": 4, "max int": 2**31 - 1}


def _sparse_over_positions(args, skipped_block, causal):
    """Sparse decode (reference) over every position each request's block-table row uses, written out here: index
    ``block * page + offset``, -1 for the tokens of ``skipped_block`` (request, table column) and, causal with
    s_q > 1, past each query's end; lengths as ``topk_length``."""
    q, table, lens = args["q"], args["block_table"], args["cache_seqlens"]
    b, s_q = q.shape[:2]
    covered = table.shape[1] * PAGE
    idx = torch.full((b, s_q, covered), -1, dtype=torch.int32)
    for i in range(b):
        n = int(lens[i])
        for t in range(s_q):
            end = n - (s_q - 1 - t) if causal and s_q > 1 else n
            for p in range(max(end, 0)):
                if (i, p // PAGE) != skipped_block:
                    idx[i, t, p] = int(table[i, p // PAGE]) * PAGE + p % PAGE
    return mla_cute.flash_mla_with_kvcache(q, args["k_cache"], None, None, D_V, mla_cute.get_mla_metadata()[0],
                                           indices=idx, topk_length=lens.clamp(0, covered), backend="reference")


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("s_q,causal", [(1, False), (2, True)])
@pytest.mark.parametrize("bad", list(BAD_IDS))
def test_reused_metadata_reads_a_block_outside_the_cache_as_zeros_or_skips_it(bad, s_q, causal, fp8):
    """A 16-bit cache reads the block as zeros (as the TMA does); an FP8 cache skips its tokens (as the sparse
    kernel over every position does)."""
    args = _case(s_q, fp8)
    meta = mla_cute.get_mla_metadata()[0]
    _call(args, meta, causal)
    table = args["block_table"].clone()
    table[1, 0] = BAD_IDS[bad]  # a block request 1 uses: never checked again with this metadata
    got = _call(dict(args, block_table=table), meta, causal)
    if fp8:  # the oracle: sparse decode over request 1's tokens past its first block (another summation order)
        want = _sparse_over_positions(args, skipped_block=(1, 0), causal=causal)
        torch.testing.assert_close(got[0].float(), want[0].float(), rtol=0, atol=8e-3)  # a bf16 step near 1
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-5)
    else:  # the oracle: a valid call whose block there holds zeros
        zeros = dict(args, k_cache=torch.cat([args["k_cache"], _zero_block(args["k_cache"])]),
                     block_table=torch.tensor([[0, 1], [4, 3]], dtype=torch.int32))
        _same(got, _call(zeros, causal=causal))
    with pytest.raises(ValueError, match=r"block_table\[1, 0\]"):  # a fresh metadata object checks it
        _call(dict(args, block_table=table), causal=causal)


def test_reused_metadata_with_a_smaller_cache_reads_the_missing_blocks_as_zeros():
    args = _case()
    meta = mla_cute.get_mla_metadata()[0]
    _call(args, meta)
    got = _call(dict(args, k_cache=args["k_cache"][:3]), meta)  # block 3, which request 1 uses, is gone
    zeros = dict(args, k_cache=torch.cat([args["k_cache"][:3], _zero_block(args["k_cache"])]))
    _same(got, _call(zeros))


@pytest.mark.parametrize("s_q,causal", [(1, False), (2, True)])
def test_reused_metadata_with_a_narrower_block_table_takes_the_lengths_it_covers(s_q, causal):
    args = _case(s_q)
    meta = mla_cute.get_mla_metadata()[0]
    _call(args, meta, causal)
    narrow = args["block_table"][:, :1].contiguous()  # covers 64 tokens; request 1 has 100
    got = _call(dict(args, block_table=narrow), meta, causal)
    want = _call(dict(args, block_table=narrow, cache_seqlens=torch.tensor([10, 64], dtype=torch.int32)),
                 causal=causal)
    _same(got, want)


@pytest.mark.parametrize("length,taken", [(1000, 128), (2**31 - 1, 128), (-7, 0), (-(2**31), 0)])
def test_lengths_written_behind_the_checks_are_taken_within_the_table(length, taken):
    """An inference tensor keeps no version counter: a reuse with it is trusted without reading it."""
    args = _case()
    meta = mla_cute.get_mla_metadata()[0]
    with torch.inference_mode():
        lens = args["cache_seqlens"].clone()
        _call(dict(args, cache_seqlens=lens), meta)
        lens[1] = length
        got = _call(dict(args, cache_seqlens=lens), meta)
    want = _call(dict(args, cache_seqlens=torch.tensor([10, taken], dtype=torch.int32)))
    _same(got, want)
    if taken == 0:
        assert not got[0][1].any() and torch.isinf(got[1][1]).all()


def test_reference_dense_decode_alone_follows_the_rule():
    """The reference function itself (no API checks in front of it): -1 is not the last block."""
    from mla_cute.backends import reference

    args = _case()
    table = torch.tensor([[0, 1], [-1, 3]], dtype=torch.int32)
    got = reference.dense_decode(args["q"], args["k_cache"], table, args["cache_seqlens"], D_QK**-0.5, False)
    cache = args["k_cache"].clone()
    cache[2] = 0
    want = reference.dense_decode(args["q"], cache, args["block_table"], args["cache_seqlens"], D_QK**-0.5, False)
    _same(got, want)


# ----------------------------------------------------------------------------- topk_length: clamped, never refused

def _sparse_case(topk_length=None):
    gen = torch.Generator().manual_seed(8)
    cache = mla_cute.quantize_kv_cache(torch.randn(2, PAGE, 1, D_QK, generator=gen).bfloat16())
    return dict(
        q=torch.randn(2, 1, 16, D_QK, generator=gen).bfloat16(), k_cache=cache, block_table=None,
        cache_seqlens=None, head_dim_v=D_V, is_fp8_kvcache=True,
        indices=torch.randint(0, 2 * PAGE, (2, 1, 32), generator=gen, dtype=torch.int32),
        topk_length=topk_length, backend="reference",
    )


@pytest.mark.parametrize("given,taken", [(-1, 0), (-(2**31), 0), (33, 32), (2**31 - 1, 32)])
def test_sparse_decode_takes_topk_length_within_0_and_topk(given, taken):
    got = _call(_sparse_case(torch.tensor([given, 5], dtype=torch.int32)))
    want = _call(_sparse_case(torch.tensor([taken, 5], dtype=torch.int32)))
    _same(got, want)


@pytest.mark.parametrize("given,taken", [(-3, 0), (17, 16)])
def test_sparse_prefill_takes_topk_length_within_0_and_topk(given, taken):
    gen = torch.Generator().manual_seed(9)
    args = dict(q=torch.randn(2, 8, D_QK, generator=gen).bfloat16(), kv=torch.randn(50, 1, D_QK, generator=gen).bfloat16(),
                indices=torch.randint(0, 50, (2, 1, 16), generator=gen, dtype=torch.int32), sm_scale=D_QK**-0.5,
                backend="reference")
    got = mla_cute.flash_mla_sparse_fwd(**args, topk_length=torch.tensor([given, 4], dtype=torch.int32))
    want = mla_cute.flash_mla_sparse_fwd(**args, topk_length=torch.tensor([taken, 4], dtype=torch.int32))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_the_rule_is_documented():
    """The one rule for lengths (checked where read on the host, clamped elsewhere) is where users look."""
    import pathlib

    engines = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "engines.md").read_text()
    section = engines.split("## Values no check sees", 1)[1].split("\n## ", 1)[0]
    assert "`topk_length`" in section and "never refused" in section and "reference backend" in section
    assert "topk_length" in V.__doc__ and "reference backend" in V.__doc__


# ----------------------------------------------------------------------------- attn_sink on every call or on none

def test_sink_presence_is_recorded_by_the_first_call_and_checked_after():
    meta = mla_cute.get_mla_metadata()[0]
    V.check_sink_presence(meta, True, first=True)
    V.check_sink_presence(meta, True, first=False)
    with pytest.raises(ValueError, match="attn_sink must be given on every call with this tile_scheduler_metadata "
                                         r"or on none \(first call: given\)"):
        V.check_sink_presence(meta, False, first=False)
    V.check_sink_presence(meta, False, first=True)  # a metadata object made afresh records again
    with pytest.raises(ValueError, match=r"\(first call: None\)"):
        V.check_sink_presence(meta, True, first=False)


def test_sink_presence_error_is_the_cute_backends():
    """One text for both backends: the cute backend's sparse plan raises the same words."""
    import inspect

    from mla_cute.backends import cute

    words = "attn_sink must be given on every call with this tile_scheduler_metadata or on none"
    assert words in str(V.sink_presence_error(True))
    assert words in inspect.getsource(cute) or "sink_presence_error" in inspect.getsource(cute)


@pytest.mark.parametrize("first_sink", [True, False])
def test_reference_refuses_a_changed_sink_presence(first_sink):
    meta = mla_cute.get_mla_metadata()[0]
    sink = torch.zeros(16)
    _call(dict(_sparse_case(), attn_sink=sink if first_sink else None), meta)
    with pytest.raises(ValueError, match="attn_sink must be given on every call"):
        _call(dict(_sparse_case(), attn_sink=None if first_sink else sink), meta)
