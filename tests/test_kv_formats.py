"""The cache formats' quantizers (``mla_cute.kv_formats``): byte layouts, scale rules, round trips."""

from __future__ import annotations

import pytest
import torch

import mla_cute
from mla_cute.backends.operations import last_writes
from mla_cute.kv_formats import BYTES_PER_TOKEN, HEAD_DIM, PAGE_BLOCKED, format_of, page_bytes, v4_page_bytes

FORMATS = list(BYTES_PER_TOKEN)
# Relative error of one round trip on unit-normal rows: e4m3 keeps 3 mantissa bits, e2m1 one.
ROUND_TRIP_ERR = {"V32": 0.04, "V32_NO_ROPE": 0.04, "V4": 0.04, "V41": 0.04, "V41_PAGED": 0.04, "V41_FP4": 0.12}


def _rows(nb, page, fmt, seed=0):
    return torch.randn(nb, page, 1, HEAD_DIM[fmt], generator=torch.Generator().manual_seed(seed)).bfloat16()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("page", [1, 16, 64])
def test_round_trip_is_close_and_a_fixed_point(fmt, page):
    x = _rows(3, page, fmt)
    c = mla_cute.quantize_kv_cache(x, kv_format=fmt)
    assert c.dtype == torch.float8_e4m3fn and c.shape == (3, page, 1, BYTES_PER_TOKEN[fmt])
    y = mla_cute.dequantize_kv_cache(c, kv_format=fmt)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert float((y.float() - x.float()).norm() / x.float().norm()) < ROUND_TRIP_ERR[fmt]
    again = mla_cute.dequantize_kv_cache(mla_cute.quantize_kv_cache(y, kv_format=fmt), kv_format=fmt)
    assert torch.equal(again, y)  # power-of-two (or e4m3) scales: dequantized rows quantize to themselves


@pytest.mark.parametrize("page,stride", [(1, 1152), (2, 1728), (64, 37440), (72, 42048), (256, 149760)])
def test_v4_pages_are_padded_to_576_byte_multiples(page, stride):
    assert v4_page_bytes(page) == stride
    c = mla_cute.quantize_kv_cache(_rows(2, page, "V4"), kv_format="V4")
    assert c.stride() == (stride, 584, 584, 1)


@pytest.mark.parametrize("page", [1, 3, 16, 64])
def test_v41_paged_holds_v41_bytes_in_data_and_scale_rows(page):
    """The page-blocked V4.1 layout: token t's 512 e4m3 bytes at page base + 512 t, its 16 ue8m0 scales at
    512 page + 16 t, each V41's bytes of the token; a page padded to a multiple of 512 bytes."""
    x = _rows(3, page, "V41", seed=page)
    v41 = mla_cute.quantize_kv_cache(x, kv_format="V41").view(torch.uint8)
    c = mla_cute.quantize_kv_cache(x, kv_format="V41_PAGED")
    assert page_bytes("V41_PAGED", page) == 512 * -(-528 * page // 512)
    assert c.stride() == (page_bytes("V41_PAGED", page), 528, 528, 1)
    raw = torch.as_strided(c.view(torch.uint8), (3, page_bytes("V41_PAGED", page)), (c.stride(0), 1))
    for b in range(3):
        for t in range(page):
            assert torch.equal(raw[b, 512 * t: 512 * t + 512], v41[b, t, 0, :512])
            assert torch.equal(raw[b, 512 * page + 16 * t: 512 * page + 16 * t + 16], v41[b, t, 0, 512:])
    assert torch.equal(mla_cute.dequantize_kv_cache(c, kv_format="V41_PAGED"),
                       mla_cute.dequantize_kv_cache(v41.view(torch.float8_e4m3fn), kv_format="V41"))
    assert format_of(c) == "V41"  # 528 bytes name V41 unless the format is said
    assert format_of(c, "V41_PAGED") == "V41_PAGED"


def test_v4_token_bytes_sit_in_data_and_scale_rows():
    """Token t: 448 e4m3 then 64 bf16 RoPE values at page base + 576 t; its 7 ue8m0 scales and a zero pad at
    576 page + 8 t."""
    page = 8
    x = _rows(2, page, "V4", seed=3)
    x[1, 5, 0, 64:128] = 0  # a zero tile: scale 2^-13
    c = mla_cute.quantize_kv_cache(x, kv_format="V4")
    raw = torch.as_strided(c.view(torch.uint8), (2, v4_page_bytes(page)), (c.stride(0), 1))
    for b, t in [(0, 0), (1, 5), (1, 7)]:
        data = raw[b, 576 * t: 576 * t + 576]
        assert torch.equal(data[448:].view(torch.bfloat16), x[b, t, 0, 448:])
        sc = raw[b, 576 * page + 8 * t: 576 * page + 8 * t + 8]
        assert sc[7] == 0
        for tile in range(7):
            vals = x[b, t, 0, 64 * tile: 64 * tile + 64].float()
            amax = float(vals.abs().max())
            e = -13 if amax == 0 else max(-13, int(torch.ceil(torch.log2(torch.tensor(amax / 448)))))
            assert int(sc[tile]) == e + 127
            want = (vals / 2.0**e).to(torch.float8_e4m3fn).view(torch.uint8)
            assert torch.equal(data[64 * tile: 64 * tile + 64], want)
    assert int(raw[1, 576 * page + 8 * 5 + 1]) == 114  # the zero tile's 2^-13


def test_v4_dequantizes_a_view_of_later_blocks():
    c = mla_cute.quantize_kv_cache(_rows(4, 16, "V4"), kv_format="V4")
    whole = mla_cute.dequantize_kv_cache(c)
    assert torch.equal(mla_cute.dequantize_kv_cache(c[2:]), whole[2:])


def test_v32_no_rope_and_v41_rows():
    x = _rows(1, 2, "V41", seed=4)
    x[0, 1, 0, :128] = 0
    v32 = mla_cute.quantize_kv_cache(x, kv_format="V32_NO_ROPE").view(torch.uint8)
    assert v32[0, 1, 0, 512:516].view(torch.float32).item() == 2.0**-13  # zero tile
    v41 = mla_cute.quantize_kv_cache(x, kv_format="V41").view(torch.uint8)
    assert v41[0, 1, 0, 512:516].tolist() == [114] * 4  # 32-value tiles: four zero tiles
    amax = x[0, 0, 0, 480:512].float().abs().max()
    e = max(-13, int(torch.ceil(torch.log2(amax / 448))))
    assert int(v41[0, 0, 0, 512 + 15]) == e + 127  # the RoPE part is quantized too


def test_nan_and_inf_tiles_mark_their_scales():
    x = _rows(1, 2, "V41", seed=5)
    x[0, 0, 0, 3] = float("nan")
    x[0, 1, 0, 40] = float("inf")
    v41 = mla_cute.quantize_kv_cache(x, kv_format="V41").view(torch.uint8)
    assert int(v41[0, 0, 0, 512]) == 255 and int(v41[0, 1, 0, 513]) == 255
    assert int(v41[0, 0, 0, 513]) != 255  # other tiles unaffected
    fp4 = mla_cute.quantize_kv_cache(x, kv_format="V41_FP4").view(torch.uint8)
    assert int(fp4[0, 0, 0, 256]) == 0x7F and int(fp4[0, 1, 0, 256 + 2]) == 0x7F


def test_fp4_rounds_to_nearest_ties_to_even_and_packs_low_nibble_first():
    """A tile of amax 6 has scale 1: the e2m1 codes of the values are their rounded magnitudes."""
    tile = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.0, -1.0, 0.3, 2.9, 4.5, 5.5, -6.0, 0.0])
    want = [7, 0, 2, 2, 4, 4, 6, 6, 8, 8 | 2, 1, 5, 6, 7, 8 | 7, 0]
    x = torch.zeros(1, 1, 1, 512)
    x[0, 0, 0, :16] = tile
    c = mla_cute.quantize_kv_cache(x, kv_format="V41_FP4").view(torch.uint8)[0, 0, 0]
    codes = [int(c[j // 2]) >> (4 * (j % 2)) & 15 for j in range(16)]
    assert codes == want
    assert c[256].view(torch.float8_e4m3fn).float().item() == 1.0
    assert int(c[257]) == 0x01  # an all-zero tile: the smallest scale, 2^-9


def test_fp4_scales_at_the_e4m3_limit():
    x = torch.zeros(1, 1, 1, 512)
    x[0, 0, 0, :16] = 3000.0  # amax / 6 past 448: the scale clamps there, values saturate at 6
    c = mla_cute.quantize_kv_cache(x, kv_format="V41_FP4")
    assert c.view(torch.uint8)[0, 0, 0, 256] == 0x7E
    y = mla_cute.dequantize_kv_cache(c)
    assert torch.all(y[0, 0, 0, :16].float() == 6 * 448)


def test_format_follows_the_bytes_unless_given():
    assert format_of(torch.empty(1, 1, 1, 656)) == "V32" and format_of(torch.empty(1, 1, 1, 584)) == "V4"
    assert format_of(torch.empty(1, 1, 1, 528)) == "V41" and format_of(torch.empty(1, 1, 1, 288)) == "V41_FP4"
    assert format_of(torch.empty(1, 1, 1, 528), "V32_NO_ROPE") == "V32_NO_ROPE"
    x = _rows(1, 4, "V32_NO_ROPE")
    c = mla_cute.quantize_kv_cache(x, kv_format="V32_NO_ROPE")
    assert not torch.equal(mla_cute.dequantize_kv_cache(c), mla_cute.dequantize_kv_cache(c, kv_format="V32_NO_ROPE"))
    with pytest.raises(ValueError, match="kv_format must be one of"):
        mla_cute.quantize_kv_cache(x, kv_format="V5")
    with pytest.raises(ValueError, match=r"k_cache_fp8 must have shape .* last dimension \(600\) names no format"):
        mla_cute.dequantize_kv_cache(torch.empty(1, 1, 1, 600, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"k_cache must have shape \[num_blocks, page_block_size, 1, 512\]"):
        mla_cute.quantize_kv_cache(_rows(1, 4, "V32"), kv_format="V4")
    with pytest.raises(TypeError, match="k_cache must have dtype"):
        mla_cute.quantize_kv_cache(x.to(torch.int32), kv_format="V41")


@pytest.mark.parametrize("fmt", FORMATS)
def test_gather_rows_reads_the_named_tokens(fmt):
    from mla_cute.kv_formats import gather_rows

    page = 16
    c = mla_cute.quantize_kv_cache(_rows(5, page, fmt, seed=9), kv_format=fmt)
    whole = mla_cute.dequantize_kv_cache(c, kv_format=fmt).reshape(5 * page, -1).float()
    tokens = torch.tensor([0, 17, 79, 33, 33, 64])
    assert torch.equal(gather_rows(c, tokens, kv_format=fmt), whole[tokens])


def _decode_case(fmt, nb, page, b, s_q, h_q, topk, seed):
    gen = torch.Generator().manual_seed(seed)
    cache = mla_cute.quantize_kv_cache(_rows(nb, page, fmt, seed), kv_format=fmt)
    tokens = mla_cute.dequantize_kv_cache(cache, kv_format=fmt).reshape(nb * page, -1)
    idx = torch.randint(-3, nb * page + 3, (b, s_q, topk), generator=gen, dtype=torch.int32)
    return cache, tokens, idx


@pytest.mark.parametrize("fmt,extra_fmt", [("V32_NO_ROPE", None), ("V4", None), ("V41", None), ("V4", "V4"),
                                           ("V41", "V41_FP4"), ("V41", "V41"), ("V32", "V32")])
def test_reference_sparse_decode_per_format_matches_dequantize_then_attend(fmt, extra_fmt):
    """Each format through ``flash_mla_with_kvcache(..., kv_format=...)`` against a float64 loop over the
    dequantized rows; with an extra cache (its own page size), the loop attends to the union of both index sets
    (the extra cache's tokens after the main's), each cut at its own length."""
    from test_reference import check_dense_result, naive_sparse_decode

    b, s_q, h_q = 3, 2, 16
    d = HEAD_DIM[fmt]
    q = torch.randn(b, s_q, h_q, d, generator=torch.Generator().manual_seed(1)).bfloat16()
    cache, tokens, idx = _decode_case(fmt, 4, 16, b, s_q, h_q, 24, seed=2)
    lengths = torch.tensor([24, 5, 0], dtype=torch.int32)
    sink = torch.randn(h_q, generator=torch.Generator().manual_seed(3))
    kw = dict(topk_length=lengths, attn_sink=sink, kv_format="V32_NO_ROPE" if fmt == "V32_NO_ROPE" else None)
    all_tokens = tokens
    main = torch.where(torch.arange(24) < lengths[:, None, None], idx, -1)
    union = main
    if extra_fmt is not None:
        e_cache, e_tokens, e_idx = _decode_case(extra_fmt, 3, 8, b, s_q, h_q, 10, seed=4)
        e_len = torch.tensor([0, 10, 7], dtype=torch.int32)
        kw.update(extra_k_cache=e_cache, extra_indices_in_kvcache=e_idx, extra_topk_length=e_len)
        e_valid = (e_idx >= 0) & (e_idx < e_tokens.shape[0]) & (torch.arange(10) < e_len[:, None, None])
        main = torch.where((main >= 0) & (main < tokens.shape[0]), main, -1)
        union = torch.cat([main, torch.where(e_valid, e_idx + tokens.shape[0], -1)], dim=-1)
        all_tokens = torch.cat([tokens, e_tokens])
    meta = mla_cute.get_mla_metadata()[0]
    out, lse = mla_cute.flash_mla_with_kvcache(q, cache, None, None, 512, meta, is_fp8_kvcache=True, indices=idx,
                                               backend="reference", **kw)
    ref_out, ref_lse = naive_sparse_decode(q, all_tokens, union, d**-0.5, None, sink)
    check_dense_result(out, lse, q, ref_out, ref_lse)
    assert torch.isinf(lse[2]).all() == (extra_fmt is None)  # request 2: length 0 in the main cache


def test_cute_backend_names_what_it_cannot_read_yet(monkeypatch):
    """The cute kernel reads an extra cache of the main cache's format, or V41_FP4 beside V41; another format
    beside V4 (the reference reads it) it refuses by name, before any launch."""
    import mla_cute.api as api

    monkeypatch.setattr(api, "select_backend", lambda device, backend: "cute")
    meta = mla_cute.get_mla_metadata()[0]
    v4, _, idx = _decode_case("V4", 2, 16, 1, 1, 16, 8, seed=0)
    v41, _, extra_idx = _decode_case("V41", 2, 32, 1, 1, 16, 8, seed=1)
    with pytest.raises(NotImplementedError, match="extra_k_cache: .* got V41 "):
        mla_cute.flash_mla_with_kvcache(torch.zeros(1, 1, 16, 512).bfloat16(), v4, None, None, 512, meta,
                                        is_fp8_kvcache=True, indices=idx, extra_k_cache=v41,
                                        extra_indices_in_kvcache=extra_idx)
    assert not meta.have_initialized


@pytest.mark.parametrize("fmt", FORMATS)
def test_write_kv_cache_matches_quantizing_the_whole_cache(fmt):
    """Rows written into their slots (in shuffled order, some skipped with -1) give the bytes of the cache quantized
    whole; the slots not written keep their bytes."""
    nb, page = 3, 16
    x = _rows(nb, page, fmt, seed=11)
    want = mla_cute.quantize_kv_cache(x, kv_format=fmt)
    old = mla_cute.quantize_kv_cache(_rows(nb, page, fmt, seed=12), kv_format=fmt)
    blocked = fmt in PAGE_BLOCKED  # a view with the padded page stride, which clone() would not keep
    cache = mla_cute.quantize_kv_cache(_rows(nb, page, fmt, seed=12), kv_format=fmt) if blocked else old.clone()
    slots = torch.randperm(nb * page, generator=torch.Generator().manual_seed(1))[:40]
    rows = x.reshape(nb * page, -1)[slots]
    mapping = torch.cat([slots, torch.tensor([-1, -1])])
    rows = torch.cat([rows, torch.full((2, rows.shape[1]), float("nan")).bfloat16()])
    kv = fmt if fmt in ("V32_NO_ROPE", "V41_PAGED") else None  # 528 bytes name V41 unless said
    mla_cute.write_kv_cache(cache, rows, mapping.to(torch.int32), kv_format=kv)
    got = mla_cute.dequantize_kv_cache(cache, kv_format=fmt).reshape(nb * page, -1)
    ref = mla_cute.dequantize_kv_cache(want, kv_format=fmt).reshape(nb * page, -1)
    kept = mla_cute.dequantize_kv_cache(old, kv_format=fmt).reshape(nb * page, -1)
    written = torch.zeros(nb * page, dtype=torch.bool)
    written[slots] = True
    assert torch.equal(got[written], ref[written]) and torch.equal(got[~written], kept[~written])
    if not blocked:  # per-token rows: the written bytes themselves
        w, c = want.view(torch.uint8).reshape(nb * page, -1), cache.view(torch.uint8).reshape(nb * page, -1)
        assert torch.equal(c[slots], w[slots])


@pytest.mark.parametrize("fmt", FORMATS)
def test_write_kv_cache_duplicate_slots_keep_the_last_row(fmt):
    """Rows aimed at one slot: the last in slot_mapping order is written whole, as one write after another would
    leave the slot; -1 rows skipped in between do not count."""
    nb, page = 2, 16
    cache = mla_cute.quantize_kv_cache(_rows(nb, page, fmt, seed=5), kv_format=fmt)
    seq = mla_cute.quantize_kv_cache(_rows(nb, page, fmt, seed=5), kv_format=fmt)
    rows = torch.randn(7, HEAD_DIM[fmt], generator=torch.Generator().manual_seed(6)).bfloat16()
    slots = torch.tensor([3, 20, 3, -1, 20, 3, 9], dtype=torch.int64)
    kv = fmt if fmt in ("V32_NO_ROPE", "V41_PAGED") else None
    mla_cute.write_kv_cache(cache, rows, slots, kv_format=kv)
    for i in range(7):  # one row at a time
        mla_cute.write_kv_cache(seq, rows[i:i + 1], slots[i:i + 1], kv_format=kv)
    assert torch.equal(cache.view(torch.uint8), seq.view(torch.uint8))
    assert last_writes(slots).tolist() == [-1, -1, -1, -1, 20, 3, 9]


def test_write_kv_cache_rejects():
    cache = mla_cute.quantize_kv_cache(_rows(2, 16, "V41"), kv_format="V41")
    rows = torch.zeros(3, 512).bfloat16()
    with pytest.raises(ValueError, match="new_rows must be a tensor"):
        mla_cute.write_kv_cache(cache, torch.zeros(3, 576).bfloat16(), torch.zeros(3, dtype=torch.int32))
    with pytest.raises(TypeError, match="slot_mapping must be an int32 or int64"):
        mla_cute.write_kv_cache(cache, rows, torch.zeros(3))
    with pytest.raises(ValueError, match="slot_mapping must have shape"):
        mla_cute.write_kv_cache(cache, rows, torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="slots below num_blocks \\* page_block_size = 32, got 32"):
        mla_cute.write_kv_cache(cache, rows, torch.tensor([0, 32, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="slot_mapping must hold -1 .* or slots >= 0, got -5"):
        mla_cute.write_kv_cache(cache, rows, torch.tensor([4, -5, 1], dtype=torch.int32))


def test_write_kv_cache_skips_minus_one_only():
    """-1 skips its row; any other negative slot is refused by the reference backend (which reads the slots), and
    the cache is left as it was."""
    cache = mla_cute.quantize_kv_cache(_rows(2, 16, "V41"), kv_format="V41")
    before = cache.view(torch.uint8).clone()
    rows = torch.randn(3, 512).bfloat16()
    for bad in (-5, -2, -(2**31)):
        with pytest.raises(ValueError, match=f"slot_mapping must hold -1 .*got {bad}"):
            mla_cute.write_kv_cache(cache, rows, torch.tensor([3, bad, -1], dtype=torch.int64))
        assert torch.equal(cache.view(torch.uint8), before)
    mla_cute.write_kv_cache(cache, rows, torch.tensor([3, -1, -1], dtype=torch.int32))
    changed = (cache.view(torch.uint8) != before).reshape(32, -1).any(dim=1).nonzero().flatten().tolist()
    assert changed == [3]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("nb, page", [(0, 64), (3, 0), (0, 0)])
def test_an_empty_cache_quantizes_to_an_empty_cache(fmt, nb, page):
    """num_blocks or page 0: quantize_kv_cache gives an empty cache of that shape, dequantize_kv_cache an empty
    16-bit one (not an error from inside)."""
    c = mla_cute.quantize_kv_cache(torch.zeros(nb, page, 1, HEAD_DIM[fmt], dtype=torch.bfloat16), kv_format=fmt)
    assert c.shape == (nb, page, 1, BYTES_PER_TOKEN[fmt]) and c.dtype == torch.float8_e4m3fn
    y = mla_cute.dequantize_kv_cache(c, kv_format=fmt)
    assert y.shape == (nb, page, 1, HEAD_DIM[fmt]) and y.dtype == torch.bfloat16


def test_metadata_serves_one_format():
    """A metadata object bound by a call on one format refuses another format of the same shapes (V41 and
    V32_NO_ROPE share 528 bytes a token), naming kv_format."""
    cache, _, idx = _decode_case("V41", 2, 16, 1, 1, 16, 8, seed=0)
    q = torch.randn(1, 1, 16, 512).bfloat16()
    meta = mla_cute.get_mla_metadata()[0]
    kw = dict(is_fp8_kvcache=True, indices=idx, backend="reference")
    mla_cute.flash_mla_with_kvcache(q, cache, None, None, 512, meta, **kw)
    with pytest.raises(ValueError, match="kv_format: 'V41' -> 'V32_NO_ROPE'"):
        mla_cute.flash_mla_with_kvcache(q, cache, None, None, 512, meta, kv_format="V32_NO_ROPE", **kw)
    with pytest.raises(TypeError, match="kv_format must be a str"):
        mla_cute.flash_mla_with_kvcache(q, cache, None, None, 512, mla_cute.get_mla_metadata()[0],
                                        kv_format=4, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_nan_rope_values_are_one_bf16_pattern(dtype):
    """A NaN RoPE value (either sign, any payload, any input dtype) is stored as bf16 0x7FFF, as the writer kernel
    stores it; other values round to nearest even."""
    for fmt, col in (("V32", 520), ("V4", 450)):
        x = _rows(1, 1, fmt, seed=9).to(dtype)
        x[0, 0, 0, col], x[0, 0, 0, col + 1] = float("nan"), -float("nan")
        raw = mla_cute.quantize_kv_cache(x, kv_format=fmt).view(torch.uint8)[0, 0, 0]
        at = 528 + 2 * (col - 512) if fmt == "V32" else 448 + 2 * (col - 448)
        rope = raw[at: at + 4].view(torch.int16).tolist()
        assert rope == [0x7FFF, 0x7FFF], (fmt, dtype, [hex(v & 0xFFFF) for v in rope])


# A page-blocked cache is whole pages of its own page count (``check_page_layout``).

def _narrowed(c):
    """Views of a page-blocked cache narrowed along the page dimension (each keeps the whole page's block stride)."""
    return {"first half": c[:, :32], "second half": c[:, 32:], "every other": c[:, ::2], "one block": c[:1, :32],
            "of a packed copy": c.clone()[:, :32], "block and page": c[1:, 16:48]}


@pytest.mark.parametrize("fmt", list(PAGE_BLOCKED))
def test_a_page_narrowed_view_is_refused_by_dequantize_and_write(fmt):
    """``c[:, :32]`` of a page-64 cache: its scale rows are found from 32, not 64, so it must be refused (naming the
    argument) by dequantize_kv_cache and write_kv_cache, and the cache is left as it was."""
    c = mla_cute.quantize_kv_cache(_rows(3, 64, fmt), kv_format=fmt)
    before = mla_cute.dequantize_kv_cache(c, kv_format=fmt)
    for what, view in _narrowed(c).items():
        with pytest.raises(ValueError, match=f"k_cache_fp8 must be whole {fmt} pages of its page_block_size"):
            mla_cute.dequantize_kv_cache(view, kv_format=fmt)
        with pytest.raises(ValueError, match=f"k_cache must be whole {fmt} pages .* got strides"):
            mla_cute.write_kv_cache(view, torch.randn(2, 512), torch.tensor([0, 33]), kv_format=fmt)
    assert torch.equal(mla_cute.dequantize_kv_cache(c, kv_format=fmt), before)


@pytest.mark.parametrize("fmt", list(PAGE_BLOCKED))
def test_whole_pages_of_a_page_blocked_cache_are_accepted(fmt):
    """The padded cache, a packed copy (``clone``, ``.contiguous()``), blocks sliced off it and a single block read
    as the cache they came from."""
    x = _rows(3, 64, fmt, seed=5)
    c = mla_cute.quantize_kv_cache(x, kv_format=fmt)
    full = mla_cute.dequantize_kv_cache(c, kv_format=fmt)
    packed = c.clone()
    assert packed.stride(0) == 64 * BYTES_PER_TOKEN[fmt] and c.contiguous().stride() == packed.stride()
    for view, want in [(c, full), (packed, full), (c[1:], full[1:]), (c[:1], full[:1]), (packed[2:], full[2:]),
                       (c[1][None], full[1:2])]:
        assert torch.equal(mla_cute.dequantize_kv_cache(view, kv_format=fmt), want)
    mla_cute.write_kv_cache(packed[1:], x[0, :2, 0].float(), torch.tensor([5, 70]), kv_format=fmt)
    again = mla_cute.dequantize_kv_cache(packed, kv_format=fmt)
    assert torch.equal(again[1, 5], full[0, 0]) and torch.equal(again[2, 6], full[0, 1])


@pytest.mark.parametrize("n", [1, 2, 17, 4096])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_last_writes_keeps_the_last_row_of_each_slot(n, dtype):
    """Against one pass in slot_mapping order: a row keeps its slot only if no later row names it (-1 and other
    negative slots included, which the writers skip or refuse after)."""
    slots = torch.randint(-3, max(n // 4, 2), (n,), generator=torch.Generator().manual_seed(n)).to(dtype)
    last = {int(s): i for i, s in enumerate(slots.tolist())}
    want = [s if last[s] == i else -1 for i, s in enumerate(slots.tolist())]
    got = last_writes(slots)
    assert got.dtype == dtype and got.tolist() == want
