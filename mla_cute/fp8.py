"""The 656-byte FP8 MLA cache row (DeepSeek V3.2 sparse layout).

Byte layout of one token:
  [0, 512)    512 x float8_e4m3 latent values, 4 tiles of 128
  [512, 528)  4 x float32 scales, one per tile, each a power of two
  [528, 656)  64 x bfloat16 RoPE values, not quantized

A power-of-two scale makes ``fp8 * scale`` exact in bf16, so a dequantized cache is a
fixed point: ``dequantize(quantize(y)) == y`` for ``y = dequantize(quantize(x))``.  (The
bytes can differ: a tile whose largest value rounds down to 224 * scale gets half the
scale the second time, with the same values.)

The scale rule is FlashMLA's, made exact: a tile's scale is 2^e, e the least integer >= -13
with amax <= 448 * 2^e (FlashMLA's ``2^ceil(log2(max(amax / 448, 1e-4)))`` without the
rounding of the division and the logarithm, which differs between CPU and GPU and from the
exact rule for a tile whose amax / 448 lies within a few ulps above a power of two).  A NaN
value's byte is 0x7F (a NaN RoPE value's bf16 0x7FFF); a tile holding NaN has scale NaN (fp32 0x7FC00000), one holding inf
(no NaN) scale inf: its finite values become +-0, its infinities NaN.
"""

from __future__ import annotations

import torch

D_QK = 576
D_LATENT = 512
D_ROPE = 64
TILE = 128
NUM_TILES = D_LATENT // TILE
FP8_BYTES_PER_TOKEN = D_LATENT + NUM_TILES * 4 + D_ROPE * 2  # 656


def _check_cache(name: str, t: torch.Tensor, last: int, dtypes: tuple) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4 or t.shape[2] != 1 or t.shape[3] != last:
        raise ValueError(f"{name} must have shape [num_blocks, page_block_size, 1, {last}], got {list(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")


def scale_exponents(tiles: torch.Tensor) -> torch.Tensor:
    """Per tile (the last dim, fp32) the scale's exponent e (fp32; NaN where the tile holds NaN, inf where it
    holds inf and no NaN): with amax = 1.f 2^(b - 127), amax <= 448 * 2^k iff k >= b - 135 + (1.f > 1.75)."""
    amax = tiles.abs().amax(dim=-1)
    bits = amax.view(torch.int32)
    k = (bits >> 23) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    e = torch.clamp_min(k, -13).to(torch.float32)
    return torch.where(torch.isnan(amax), torch.nan, torch.where(torch.isinf(amax), torch.inf, e))


def e4m3_tiles(tiles: torch.Tensor):
    """Tiles (last dim, fp32) over their scales 2^e as e4m3 bytes (uint8, NaN 0x7F), and the exponents e."""
    e = scale_exponents(tiles)
    v = tiles / torch.pow(2.0, e).unsqueeze(-1)
    q = v.to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(torch.isnan(v), 0x7F, q.to(torch.int32)).to(torch.uint8), e


def fp32_scales(e: torch.Tensor) -> torch.Tensor:
    """The fp32 scales 2^e as bytes [..., 4 a scale] (NaN 0x7FC00000)."""
    bits = torch.pow(2.0, e).contiguous().view(torch.int32)
    return torch.where(torch.isnan(e), 0x7FC00000, bits).contiguous().view(torch.uint8).reshape(*e.shape[:-1], -1)


def bf16_bytes(x: torch.Tensor) -> torch.Tensor:
    """``x`` as bf16 bytes [..., 2 a value], round to nearest even, a NaN as 0x7FFF (whatever its sign and
    payload, and whatever the device: torch's conversions keep or drop them differently)."""
    bits = x.to(torch.bfloat16).contiguous().view(torch.int16)
    return torch.where(torch.isnan(x), 0x7FFF, bits).to(torch.int16).contiguous().view(torch.uint8).reshape(
        *x.shape[:-1], -1)


def quantize_kv_cache(k_cache: torch.Tensor) -> torch.Tensor:
    """Quantize a 16-bit cache ``[num_blocks, page, 1, 576]`` into the 656-byte FP8 layout.

    Returns a ``torch.float8_e4m3fn`` tensor ``[num_blocks, page, 1, 656]`` (view it as
    uint8 where raw bytes are needed).  Scale per 128 latent values: amax / 448 rounded up to
    a power of two, at least 2^-13 (so all-zero tiles work).
    """
    _check_cache("k_cache", k_cache, D_QK, (torch.bfloat16, torch.float16, torch.float32))
    nb, page = k_cache.shape[0], k_cache.shape[1]
    if nb == 0 or page == 0:  # an empty cache quantizes to an empty cache
        return torch.empty(nb, page, 1, FP8_BYTES_PER_TOKEN, dtype=torch.float8_e4m3fn, device=k_cache.device)
    x = k_cache.reshape(nb, page, D_QK)
    out = torch.empty(nb, page, FP8_BYTES_PER_TOKEN, dtype=torch.uint8, device=k_cache.device)
    latent = x[..., :D_LATENT].float().reshape(nb, page, NUM_TILES, TILE)
    q, e = e4m3_tiles(latent)
    out[..., :D_LATENT] = q.reshape(nb, page, D_LATENT)
    out[..., D_LATENT : D_LATENT + NUM_TILES * 4] = fp32_scales(e)
    out[..., D_LATENT + NUM_TILES * 4 :] = bf16_bytes(x[..., D_LATENT:])
    return out.view(torch.float8_e4m3fn).reshape(nb, page, 1, FP8_BYTES_PER_TOKEN)


def dequantize_kv_cache(k_cache_fp8: torch.Tensor) -> torch.Tensor:
    """Expand a 656-byte FP8 cache ``[num_blocks, page, 1, 656]`` back to bf16 ``[num_blocks, page, 1, 576]``."""
    _check_cache("k_cache_fp8", k_cache_fp8, FP8_BYTES_PER_TOKEN, (torch.float8_e4m3fn, torch.uint8, torch.int8))
    nb, page = k_cache_fp8.shape[0], k_cache_fp8.shape[1]
    raw = k_cache_fp8.reshape(nb, page, FP8_BYTES_PER_TOKEN).view(torch.uint8)
    out = torch.empty(nb, page, D_QK, dtype=torch.bfloat16, device=k_cache_fp8.device)
    latent = raw[..., :D_LATENT].contiguous().view(torch.float8_e4m3fn).float().reshape(nb, page, NUM_TILES, TILE)
    scale = raw[..., D_LATENT : D_LATENT + NUM_TILES * 4].contiguous().view(torch.float32)
    out[..., :D_LATENT] = (latent * scale.unsqueeze(-1)).reshape(nb, page, D_LATENT).to(torch.bfloat16)
    out[..., D_LATENT:] = raw[..., D_LATENT + NUM_TILES * 4 :].contiguous().view(torch.bfloat16)
    return out.reshape(nb, page, 1, D_QK)
