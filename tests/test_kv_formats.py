"""The cache formats' quantizers (``mla_cute.kv_formats``): byte layouts, scale rules, round trips."""

from __future__ import annotations

import pytest
import torch

import mla_cute
from mla_cute.kv_formats import BYTES_PER_TOKEN, HEAD_DIM, format_of, v4_page_bytes

FORMATS = list(BYTES_PER_TOKEN)
# Relative error of one round trip on unit-normal rows: e4m3 keeps 3 mantissa bits, e2m1 one.
ROUND_TRIP_ERR = {"V32": 0.04, "V32_NO_ROPE": 0.04, "V4": 0.04, "V41": 0.04, "V41_FP4": 0.12}


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
    with pytest.raises(ValueError, match="names no format"):
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
