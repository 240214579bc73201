"""The 656-byte FP8 MLA cache row (DeepSeek V3.2 sparse layout).

Byte layout of one token:
  [0, 512)    512 x float8_e4m3 latent values, 4 tiles of 128
  [512, 528)  4 x float32 scales, one per tile, each a power of two
  [528, 656)  64 x bfloat16 RoPE values, not quantized

A power-of-two scale makes ``fp8 * scale`` exact in bf16, so a dequantized cache is a
fixed point: ``dequantize(quantize(y)) == y`` for ``y = dequantize(quantize(x))``.  (The
bytes can differ: a tile whose largest value rounds down to 224 * scale gets half the
scale the second time, with the same values.)  The scale rule is FlashMLA's.
"""

from __future__ import annotations

import torch

D_QK = 576
D_LATENT = 512
D_ROPE = 64
TILE = 128
NUM_TILES = D_LATENT // TILE
FP8_BYTES_PER_TOKEN = D_LATENT + NUM_TILES * 4 + D_ROPE * 2  # 656
_FP8_MAX = 448.0


def _check_cache(name: str, t: torch.Tensor, last: int, dtypes: tuple) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4 or t.shape[2] != 1 or t.shape[3] != last:
        raise ValueError(f"{name} must have shape [num_blocks, page_block_size, 1, {last}], got {list(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")


def quantize_kv_cache(k_cache: torch.Tensor) -> torch.Tensor:
    """Quantize a 16-bit cache ``[num_blocks, page, 1, 576]`` into the 656-byte FP8 layout.

    Returns a ``torch.float8_e4m3fn`` tensor ``[num_blocks, page, 1, 656]`` (view it as
    uint8 where raw bytes are needed).  Scale per 128 latent values:
    ``2 ** ceil(log2(amax / 448))`` (amax clamped to 1e-4 * 448 so all-zero tiles work).
    """
    _check_cache("k_cache", k_cache, D_QK, (torch.bfloat16, torch.float16, torch.float32))
    nb, page = k_cache.shape[0], k_cache.shape[1]
    x = k_cache.reshape(nb, page, D_QK)
    out = torch.empty(nb, page, FP8_BYTES_PER_TOKEN, dtype=torch.uint8, device=k_cache.device)
    latent = x[..., :D_LATENT].float().reshape(nb, page, NUM_TILES, TILE)
    amax = latent.abs().amax(dim=-1)
    scale = torch.pow(2.0, torch.ceil(torch.log2(torch.clamp_min(amax / _FP8_MAX, 1e-4))))
    q = (latent / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).reshape(nb, page, D_LATENT)
    out[..., :D_LATENT] = q.view(torch.uint8)
    out[..., D_LATENT : D_LATENT + NUM_TILES * 4] = scale.to(torch.float32).contiguous().view(torch.uint8)
    out[..., D_LATENT + NUM_TILES * 4 :] = x[..., D_LATENT:].to(torch.bfloat16).contiguous().view(torch.uint8)
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
