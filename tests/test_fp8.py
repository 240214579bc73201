"""The 656-byte FP8 cache row: layout, accuracy, round trips and argument checks."""

import pytest
import torch

import mla_cute
from mla_cute.fp8 import FP8_BYTES_PER_TOKEN

D_QK, D_LAT, TILE = 576, 512, 128
SCALE_BYTES = slice(512, 528)
ROPE_BYTES = slice(528, 656)
# Smallest normal e4m3 magnitude: below it the 3-bit mantissa no longer bounds the relative error.
FP8_MIN_NORMAL = 2.0**-6


def make_cache(nb, page, gen, dtype=torch.bfloat16, spread=True):
    x = torch.randn(nb, page, 1, D_QK, generator=gen)
    if spread:
        # Give each 128-value tile its own magnitude so scales differ across tiles and tokens.
        mag = 2.0 ** torch.randint(-8, 9, (nb, page, 1, 4), generator=gen).float()
        x[..., :D_LAT] *= mag.repeat_interleave(TILE, dim=-1)
    return x.to(dtype)


def scales_of(fp8):
    raw = fp8.view(torch.uint8)
    return raw[..., SCALE_BYTES].contiguous().view(torch.float32)  # [nb, page, 1, 4]


def test_shape_and_dtype():
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        out = mla_cute.quantize_kv_cache(make_cache(3, 16, gen, dtype))
        assert out.dtype == torch.float8_e4m3fn and out.shape == (3, 16, 1, 656)
        assert FP8_BYTES_PER_TOKEN == 656
        deq = mla_cute.dequantize_kv_cache(out)
        assert deq.dtype == torch.bfloat16 and deq.shape == (3, 16, 1, D_QK)


def test_scales_are_powers_of_two_from_tile_amax():
    gen = torch.Generator().manual_seed(1)
    x = make_cache(4, 64, gen)
    scale = scales_of(mla_cute.quantize_kv_cache(x))
    assert torch.all(scale > 0) and torch.all(torch.isfinite(scale))
    mant, _ = torch.frexp(scale)
    assert torch.all(mant == 0.5)  # exactly a power of two
    amax = x[..., :D_LAT].float().abs().reshape(4, 64, 1, 4, TILE).amax(-1)
    # The smallest power of two that brings the tile into e4m3's +-448 range, except that
    # tiny tiles share the floor 2^ceil(log2(1e-4)) = 2^-13 (documented clamp of amax/448).
    assert torch.all(amax / scale <= 448.0)
    floor = 2.0**-13
    assert torch.all(scale >= floor)
    unclamped = scale > floor
    assert torch.all(amax[unclamped] / (scale[unclamped] / 2) > 448.0)
    assert torch.all(amax[~unclamped] <= 448.0 * floor)
    assert unclamped.any() and (~unclamped).any()  # make_cache's spread reaches both regimes


def test_rope_bytes_are_the_bf16_input():
    gen = torch.Generator().manual_seed(2)
    x = make_cache(2, 32, gen)
    raw = mla_cute.quantize_kv_cache(x).view(torch.uint8)
    want = x[..., D_LAT:].contiguous().view(torch.uint8)
    assert torch.equal(raw[..., ROPE_BYTES], want)
    # ...and dequantization returns them untouched.
    assert torch.equal(mla_cute.dequantize_kv_cache(raw)[..., D_LAT:], x[..., D_LAT:])


def test_latent_bytes_are_fp8_of_scaled_values():
    gen = torch.Generator().manual_seed(3)
    x = make_cache(2, 16, gen)
    fp8 = mla_cute.quantize_kv_cache(x)
    scale = scales_of(fp8).repeat_interleave(TILE, dim=-1)
    want = (x[..., :D_LAT].float() / scale).to(torch.float8_e4m3fn)
    assert torch.equal(fp8[..., :D_LAT].view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_is_close(dtype):
    gen = torch.Generator().manual_seed(4)
    x = make_cache(4, 64, gen, dtype)
    fp8 = mla_cute.quantize_kv_cache(x)
    deq = mla_cute.dequantize_kv_cache(fp8).float()[..., :D_LAT]
    ref = x.float()[..., :D_LAT]
    scale = scales_of(fp8).repeat_interleave(TILE, dim=-1)
    err = (deq - ref).abs()
    normal = ref.abs() / scale >= FP8_MIN_NORMAL
    # 3 mantissa bits: at most half an ulp = 1/16 relative (bf16 output adds ~0.4% for fp32 input).
    assert torch.all(err[normal] <= ref.abs()[normal] * (0.0625 if dtype == torch.bfloat16 else 0.067))
    # Subnormal e4m3 steps are 2^-9 of the scale: half of that bounds the absolute error.
    assert torch.all(err[~normal] <= scale[~normal] * 2.0**-10 * 1.01)
    assert normal.float().mean() > 0.9  # the bound above is about most elements, not a corner


def test_dequantize_quantize_is_idempotent_in_value():
    gen = torch.Generator().manual_seed(5)
    once = mla_cute.dequantize_kv_cache(mla_cute.quantize_kv_cache(make_cache(8, 64, gen)))
    twice = mla_cute.dequantize_kv_cache(mla_cute.quantize_kv_cache(once))
    assert torch.equal(once, twice)


def test_bytes_round_trip_when_tile_max_is_representable():
    # Inputs already on the fp8 grid with a tile maximum of 448 * scale: the byte round trip is exact.
    gen = torch.Generator().manual_seed(7)
    x = make_cache(2, 16, gen)
    grid = mla_cute.dequantize_kv_cache(mla_cute.quantize_kv_cache(x))
    scale = scales_of(mla_cute.quantize_kv_cache(x))
    grid[..., :D_LAT].view(2, 16, 1, 4, TILE)[..., 0] = (448.0 * scale).bfloat16()
    first = mla_cute.quantize_kv_cache(grid)
    again = mla_cute.quantize_kv_cache(mla_cute.dequantize_kv_cache(first))
    assert torch.equal(first.view(torch.uint8), again.view(torch.uint8))


def test_zero_and_tiny_tiles():
    gen = torch.Generator().manual_seed(8)
    x = make_cache(2, 8, gen)
    x[0, 0] = 0  # a whole token, RoPE included
    x[0, 1, :, :TILE] = 0  # one tile of a token
    x[1] = 0  # a whole block
    x[0, 2, :, TILE : 2 * TILE] = 1e-30  # below any useful scale
    x[0, 3, :, 2 * TILE : 3 * TILE] = torch.randn(TILE, generator=gen).bfloat16() * 1e-3
    fp8 = mla_cute.quantize_kv_cache(x)
    scale = scales_of(fp8)
    assert torch.all(torch.isfinite(scale)) and torch.all(scale > 0)
    deq = mla_cute.dequantize_kv_cache(fp8)
    assert torch.all(torch.isfinite(deq))
    assert torch.all(deq[0, 0] == 0) and torch.all(deq[1] == 0) and torch.all(deq[0, 1, :, :TILE] == 0)
    assert torch.all(deq[0, 2, :, TILE : 2 * TILE].float().abs() <= 1e-6)
    small = x[0, 3, :, 2 * TILE : 3 * TILE].float()
    assert torch.allclose(deq[0, 3, :, 2 * TILE : 3 * TILE].float(), small, rtol=0.07, atol=1e-6)


def test_large_magnitudes_do_not_saturate():
    gen = torch.Generator().manual_seed(9)
    x = make_cache(1, 4, gen, spread=False) * 3e4
    deq = mla_cute.dequantize_kv_cache(mla_cute.quantize_kv_cache(x)).float()
    assert torch.all(torch.isfinite(deq))
    amax_in = x[..., :D_LAT].float().abs().amax()
    assert torch.allclose(deq[..., :D_LAT].abs().amax(), amax_in, rtol=0.0625)


def test_byte_views_dequantize_alike():
    gen = torch.Generator().manual_seed(10)
    fp8 = mla_cute.quantize_kv_cache(make_cache(2, 4, gen))
    ref = mla_cute.dequantize_kv_cache(fp8)
    assert torch.equal(mla_cute.dequantize_kv_cache(fp8.view(torch.uint8)), ref)
    assert torch.equal(mla_cute.dequantize_kv_cache(fp8.view(torch.int8)), ref)


def test_noncontiguous_input():
    gen = torch.Generator().manual_seed(11)
    pool = make_cache(6, 8, gen)
    x = pool[::2]  # every other block of a larger pool
    assert not x.is_contiguous()
    assert torch.equal(
        mla_cute.quantize_kv_cache(x).view(torch.uint8),
        mla_cute.quantize_kv_cache(x.contiguous()).view(torch.uint8),
    )
    fp8_pool = mla_cute.quantize_kv_cache(pool)
    assert torch.equal(mla_cute.dequantize_kv_cache(fp8_pool[1::2]), mla_cute.dequantize_kv_cache(fp8_pool)[1::2])


@pytest.mark.parametrize(
    "x,exc",
    [
        (torch.zeros(2, 4, 576, dtype=torch.bfloat16), ValueError),  # rank 3
        (torch.zeros(2, 4, 2, 576, dtype=torch.bfloat16), ValueError),  # h_kv 2
        (torch.zeros(2, 4, 1, 512, dtype=torch.bfloat16), ValueError),  # no RoPE
        (torch.zeros(2, 4, 1, 656, dtype=torch.bfloat16), ValueError),  # already a byte row width
        (torch.zeros(2, 4, 1, 576, dtype=torch.int32), TypeError),
        (torch.zeros(2, 4, 1, 576, dtype=torch.uint8), TypeError),
        (torch.zeros(2, 4, 1, 576).tolist(), TypeError),
    ],
)
def test_quantize_rejects(x, exc):
    with pytest.raises(exc, match="k_cache"):
        mla_cute.quantize_kv_cache(x)


@pytest.mark.parametrize(
    "x,exc",
    [
        (torch.zeros(2, 4, 656, dtype=torch.uint8), ValueError),  # rank 3
        (torch.zeros(2, 4, 1, 576, dtype=torch.uint8), ValueError),  # a 16-bit row width
        (torch.zeros(2, 4, 2, 656, dtype=torch.uint8), ValueError),
        (torch.zeros(2, 4, 1, 656, dtype=torch.bfloat16), TypeError),
        (torch.zeros(2, 4, 1, 656, dtype=torch.float32), TypeError),
        (None, TypeError),
    ],
)
def test_dequantize_rejects(x, exc):
    with pytest.raises(exc, match="k_cache_fp8"):
        mla_cute.dequantize_kv_cache(x)
