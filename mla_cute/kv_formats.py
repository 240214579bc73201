"""The quantized sparse-decode cache formats besides V3.2's 656-byte row (``fp8.py``), byte-compatible with
FlashMLA's quantizers.  Each quantizes a 16-bit cache ``[num_blocks, page, 1, d_qk]`` and dequantizes to bf16.

  V32_NO_ROPE  528 B, d_qk 512: per token 512 e4m3, then 4 fp32 power-of-two scales (one per 128 values).
  V4           584 B, d_qk 512, page-blocked: a page holds ``page`` data rows of 576 B (448 e4m3 values, then
               the 64 RoPE values as bf16), then ``page`` scale rows of 8 B (7 ue8m0 scales, one per 64 e4m3
               values, and a zero pad byte); a page takes ``576 * ceil(584 * page / 576)`` bytes, so the cache
               ``[num_blocks, page, 1, 584]`` is a view with that block stride (its 584-byte rows are formal:
               a token's bytes are where the layout says).
  V41          528 B, d_qk 512: per token 512 e4m3 values (the RoPE part quantized too), then 16 ue8m0 scales
               (one per 32 values).
  V41_PAGED    528 B, d_qk 512, page-blocked: V41's bytes in FlashMLA's 2026-09-10 layout: a page holds ``page``
               data rows of 512 e4m3 values, then ``page`` scale rows of 16 ue8m0 scales; a page takes
               ``512 * ceil(528 * page / 512)`` bytes (a view, as V4's).
  V41_FP4      288 B, d_qk 512: per token 512 e2m1 values in 256 bytes (the even index in the low nibble), then
               32 e4m3 scales (one per 16 values); the extra cache beside a V41 main cache.

A page-blocked token's data row and scale row, put side by side, are its bytes in a token-major cache of the
same format (V4: 576 + 8, V41_PAGED: V41's 512 + 16); the functions below work on those and place them.

Scales of the e4m3 formats are powers of two, amax / 448 rounded up to a power of two, at least 2^-13, per tile (the exact
rule of ``fp8.py``, NaN and inf tiles as there); a ue8m0 byte is the exponent plus 127 (0xFF for a tile holding
NaN or inf).  The fp4 scale is the e4m3 of ``clamp(amax / 6, 2^-9, 448)``, the division exact before the rounding
(0x7F for a tile holding NaN or inf, amax counting NaN as inf), the values ``x / scale`` (IEEE fp32 division)
rounded to the nearest e2m1 magnitude of ``min(|v|, 6)``, ties to the even code, the sign bit where v is negative
or -0 (a NaN value: code 0).  Dequantization is exact in bf16.  ``write_kv_cache``'s kernel writes the same bytes
(``kernels/write_cache.py``).
"""

from __future__ import annotations

import math

import torch

from .fp8 import FP8_BYTES_PER_TOKEN, _check_cache, bf16_bytes, e4m3_tiles, fp32_scales
from .fp8 import dequantize_kv_cache as _dequantize_v32, quantize_kv_cache as _quantize_v32

D_V4 = 512
V4_NOPE, V4_TILE, V4_TILES = 448, 64, 7
V4_DATA_ROW = V4_NOPE + (D_V4 - V4_NOPE) * 2  # 576
V4_SCALE_ROW = 8

BYTES_PER_TOKEN = {"V32": FP8_BYTES_PER_TOKEN, "V32_NO_ROPE": 528, "V4": 584, "V41": 528, "V41_PAGED": 528,
                   "V41_FP4": 288}
HEAD_DIM = {"V32": 576, "V32_NO_ROPE": 512, "V4": 512, "V41": 512, "V41_PAGED": 512, "V41_FP4": 512}
# The page-blocked formats: (data row bytes, scale row bytes, the multiple a page's bytes are padded to).
PAGE_BLOCKED = {"V4": (V4_DATA_ROW, V4_SCALE_ROW, 576), "V41_PAGED": (512, 16, 512)}
_FP8_MAX = 448.0
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MIDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def format_of(k_cache: torch.Tensor, kv_format=None, name: str = "k_cache") -> str:
    """``kv_format`` checked, or the format the cache's bytes per token name (528 means V41: V32_NO_ROPE must be
    said, FlashMLA's rule); ``name``: the cache's argument, for the errors."""
    if kv_format is not None:
        if not isinstance(kv_format, str):
            raise TypeError(f"kv_format must be a str, got {type(kv_format).__name__}")
        if kv_format not in BYTES_PER_TOKEN:
            raise ValueError(f"kv_format must be one of {sorted(BYTES_PER_TOKEN)}, got {kv_format!r}")
        return kv_format
    if not isinstance(k_cache, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(k_cache).__name__}")
    by_bytes = {656: "V32", 584: "V4", 528: "V41", 288: "V41_FP4"}
    last = k_cache.shape[-1] if k_cache.dim() else None
    if last not in by_bytes:
        raise ValueError(f"{name} must have shape [num_blocks, page_block_size, 1, bytes per token]: its last "
                         f"dimension ({last}) names no format: 656 (V32), 584 (V4), 528 (V41, or V32_NO_ROPE with "
                         "kv_format='V32_NO_ROPE') or 288 (V41_FP4)")
    return by_bytes[last]


def page_bytes(kv_format: str, page: int) -> int:
    """Bytes of one page of a page-blocked format (its block stride): its rows' bytes rounded up to its multiple."""
    data, scale, align = PAGE_BLOCKED[kv_format]
    return align * math.ceil((data + scale) * page / align)


def check_page_layout(name: str, cache: torch.Tensor, kv_format: str) -> None:
    """The one layout rule of page-blocked caches (``PAGE_BLOCKED``), checked by every reader and by the writer
    (``name``: the argument, for the error).  A page's scale rows are found from its page count (after ``page``
    data rows), so the cache must be whole pages of its own page count: its rows packed (strides ``[B, bytes per
    token, *, 1]``) and its block stride ``B`` either ``page_bytes(kv_format, page)`` (padded, as
    ``quantize_kv_cache`` lays it out) or ``page * bytes per token`` (packed, as a copy leaves it).  A view
    narrowed along the page dimension (``c[:, :32]`` of a page-64 cache) keeps the whole page's block stride,
    which is neither for its smaller page count (a row's bytes exceed the padding multiple, so ``page_bytes``
    grows by more than the multiple with every token): it is refused rather than read with other tokens' bytes as
    its scales.  Token-major formats and empty caches have nothing to check."""
    if kv_format not in PAGE_BLOCKED or cache.shape[0] == 0 or cache.shape[1] == 0:
        return
    page, bpt = cache.shape[1], BYTES_PER_TOKEN[kv_format]
    padded = page_bytes(kv_format, page)
    s = cache.stride()  # in bytes: the cache dtypes are one byte wide
    if s[3] != 1 or (page > 1 and s[1] != bpt) or s[0] not in (padded, page * bpt):
        raise ValueError(
            f"{name} must be whole {kv_format} pages of its page_block_size {page}: block stride "
            f"page_bytes({kv_format!r}, {page}) = {padded} or {page} * {bpt} = {page * bpt} bytes, rows packed "
            f"(strides [B, {bpt}, *, 1]), got strides {list(s)} (a view narrowed along the page dimension keeps "
            "the whole page's block stride, and its scale rows are not where its page count puts them)")


def v4_page_bytes(page: int) -> int:
    """Bytes of one V4 page: its 584 * page bytes rounded up to a multiple of 576."""
    return page_bytes("V4", page)


_HALF_IN = (torch.bfloat16, torch.float16, torch.float32)
_BYTES_IN = (torch.float8_e4m3fn, torch.uint8, torch.int8)


def _e4m3_tiles(x: torch.Tensor, tile: int):
    """x [..., d] fp32 in tiles of ``tile``: (e4m3 bytes [..., d], exponents [..., d / tile])."""
    q, e = e4m3_tiles(x.reshape(*x.shape[:-1], -1, tile))
    return q.reshape(x.shape), e


def _ue8m0(e: torch.Tensor) -> torch.Tensor:
    """ue8m0 bytes of exponents (0xFF where NaN or infinite)."""
    ok = torch.isfinite(e)
    return torch.where(ok, torch.where(ok, e, 0.0) + 127, 255.0).to(torch.uint8)


def _from_ue8m0(b: torch.Tensor) -> torch.Tensor:
    e = b.to(torch.float32) - 127
    return torch.where(b == 255, torch.nan, torch.pow(2.0, e))


def _e4m3_values(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float8_e4m3fn).float()


def page_rows(k_cache: torch.Tensor, row: int) -> torch.Tensor:
    """A cache's pages as raw bytes [num_blocks, row * page] from each page's base (strided V4 caches included)."""
    raw = k_cache.view(torch.uint8)
    nb, page = raw.shape[0], raw.shape[1]
    return torch.as_strided(raw, (nb, row * page), (raw.stride(0), 1), raw.storage_offset())


def quantize_kv_cache(k_cache: torch.Tensor, kv_format: str = "V32") -> torch.Tensor:
    """Quantize a 16-bit cache ``[num_blocks, page, 1, d_qk]`` (d_qk 576 for V32, else 512) into ``kv_format``.
    Returns a ``torch.float8_e4m3fn`` tensor ``[num_blocks, page, 1, bytes per token]`` (for V4 a view with the
    padded page stride).  An empty cache (num_blocks or page 0) gives an empty one of that shape, as
    ``dequantize_kv_cache`` gives back."""
    fmt = format_of(None, kv_format)
    if fmt == "V32":
        return _quantize_v32(k_cache)
    _check_cache("k_cache", k_cache, HEAD_DIM[fmt], _HALF_IN)
    nb, page = k_cache.shape[0], k_cache.shape[1]
    if nb == 0 or page == 0:
        return torch.empty(nb, page, 1, BYTES_PER_TOKEN[fmt], dtype=torch.float8_e4m3fn, device=k_cache.device)
    raw = _token_bytes(fmt, k_cache.reshape(nb, page, -1))
    if fmt not in PAGE_BLOCKED:
        return raw.view(torch.float8_e4m3fn).reshape(nb, page, 1, -1)
    data, scale, _ = PAGE_BLOCKED[fmt]
    buf = torch.zeros(nb, page_bytes(fmt, page), dtype=torch.uint8, device=k_cache.device)
    buf[:, : data * page].view(nb, page, data).copy_(raw[..., :data])
    buf[:, data * page : (data + scale) * page].view(nb, page, scale).copy_(raw[..., data:])
    bpt = BYTES_PER_TOKEN[fmt]
    return buf.view(torch.float8_e4m3fn)[:, : bpt * page].view(nb, page, 1, bpt)


def _token_bytes(fmt: str, rows: torch.Tensor) -> torch.Tensor:
    """16-bit rows ``[..., d_qk]`` as a token-major cache's bytes ``[..., bytes per token]`` uint8 (a page-blocked
    format's: its data row, then its scale row)."""
    x = rows.float()
    out = torch.zeros(*rows.shape[:-1], BYTES_PER_TOKEN[fmt], dtype=torch.uint8, device=rows.device)
    if fmt == "V4":
        q, e = _e4m3_tiles(x[..., :V4_NOPE], V4_TILE)
        out[..., :V4_NOPE] = q
        out[..., V4_NOPE:V4_DATA_ROW] = bf16_bytes(rows[..., V4_NOPE:])
        out[..., V4_DATA_ROW : V4_DATA_ROW + V4_TILES] = _ue8m0(e)
    elif fmt == "V32_NO_ROPE":
        q, e = _e4m3_tiles(x, 128)
        out[..., :512] = q
        out[..., 512:] = fp32_scales(e)
    elif fmt in ("V41", "V41_PAGED"):
        q, e = _e4m3_tiles(x, 32)
        out[..., :512] = q
        out[..., 512:] = _ue8m0(e)
    else:  # V41_FP4
        codes, scale = _e2m1_tiles(x)
        out[..., :256] = codes[..., 0::2] | (codes[..., 1::2] << 4)
        out[..., 256:] = scale
    return out


def _e2m1_tiles(x: torch.Tensor):
    """x [..., 512] fp32 in tiles of 16: (e2m1 codes [..., 512] uint8, e4m3 scale bytes [..., 32])."""
    t = x.reshape(*x.shape[:-1], 32, 16)
    amax = torch.where(torch.isnan(t), torch.inf, t.abs()).amax(dim=-1)
    # amax / 6 in fp64 is exact enough that its e4m3 rounding is the exact quotient's (torch's CUDA division by a
    # number multiplies by its reciprocal).
    s = torch.clamp(amax.double() / 6.0, 2.0**-9, _FP8_MAX).float().to(torch.float8_e4m3fn)
    s_bytes = torch.where(torch.isinf(amax), 0x7F, s.view(torch.uint8).to(torch.int32)).to(torch.uint8)
    v = t / s.float().unsqueeze(-1)
    a = torch.nan_to_num(v.abs(), nan=0.0, posinf=6.0).clamp(max=6.0)
    mids = torch.tensor(_E2M1_MIDS, dtype=torch.float32, device=x.device)
    code = torch.bucketize(a, mids)  # mids[code - 1] < a <= mids[code]
    tie = (code < len(_E2M1_MIDS)) & (a == mids[code.clamp(max=len(_E2M1_MIDS) - 1)]) & (code % 2 == 1)
    code = code + tie.to(code.dtype)
    code = code | torch.where(torch.signbit(v) & ~torch.isnan(v), 8, 0)
    return code.to(torch.uint8).reshape(x.shape), s_bytes


def dequantize_kv_cache(k_cache_fp8: torch.Tensor, kv_format=None) -> torch.Tensor:
    """Expand a quantized cache ``[num_blocks, page, 1, bytes per token]`` back to bf16 ``[num_blocks, page, 1,
    d_qk]``; ``kv_format`` as the bytes per token name it unless given (528 bytes: V41 unless said).  An empty
    cache (num_blocks or page 0) gives an empty one."""
    k_cache = k_cache_fp8
    fmt = format_of(k_cache, kv_format, "k_cache_fp8")
    if fmt == "V32":
        return _dequantize_v32(k_cache)
    _check_cache("k_cache_fp8", k_cache, BYTES_PER_TOKEN[fmt], _BYTES_IN)
    check_page_layout("k_cache_fp8", k_cache, fmt)
    nb, page = k_cache.shape[0], k_cache.shape[1]
    if nb == 0 or page == 0:
        return torch.empty(nb, page, 1, HEAD_DIM[fmt], dtype=torch.bfloat16, device=k_cache.device)
    if fmt in PAGE_BLOCKED:
        data, scale, _ = PAGE_BLOCKED[fmt]
        pages = page_rows(k_cache, data + scale)
        raw = torch.cat([pages[:, : data * page].reshape(nb, page, data),
                         pages[:, data * page :].reshape(nb, page, scale)], dim=-1)
    else:
        raw = k_cache.reshape(nb, page, -1).view(torch.uint8)
    return _from_token_bytes(fmt, raw).reshape(nb, page, 1, HEAD_DIM[fmt])


def _from_token_bytes(fmt: str, raw: torch.Tensor) -> torch.Tensor:
    """``_token_bytes``' inverse: bytes ``[..., bytes per token]`` to bf16 ``[..., d_qk]``."""
    lead = raw.shape[:-1]
    if fmt == "V4":
        scales = raw[..., V4_DATA_ROW : V4_DATA_ROW + V4_TILES]
        nope = _e4m3_values(raw[..., :V4_NOPE]).reshape(*lead, V4_TILES, V4_TILE) * _from_ue8m0(scales).unsqueeze(-1)
        out = torch.empty(*lead, D_V4, dtype=torch.bfloat16, device=raw.device)
        out[..., :V4_NOPE] = nope.reshape(*lead, V4_NOPE).to(torch.bfloat16)
        out[..., V4_NOPE:] = raw[..., V4_NOPE:V4_DATA_ROW].contiguous().view(torch.bfloat16)
        return out
    if fmt == "V32_NO_ROPE":
        vals = _e4m3_values(raw[..., :512]).reshape(*lead, 4, 128)
        scale = raw[..., 512:].contiguous().view(torch.float32)
    elif fmt in ("V41", "V41_PAGED"):
        vals = _e4m3_values(raw[..., :512]).reshape(*lead, 16, 32)
        scale = _from_ue8m0(raw[..., 512:])
    else:  # V41_FP4
        packed = raw[..., :256].to(torch.int64)
        codes = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(*lead, 512)
        mag = torch.tensor(_E2M1, dtype=torch.float32, device=raw.device)[codes & 7]
        vals = torch.where(codes >= 8, -mag, mag).reshape(*lead, 32, 16)
        scale = _e4m3_values(raw[..., 256:])
    return (vals * scale.unsqueeze(-1)).reshape(*lead, 512).to(torch.bfloat16)


def gather_rows(k_cache: torch.Tensor, tokens: torch.Tensor, kv_format=None) -> torch.Tensor:
    """Tokens ``block * page + offset`` (each within the cache) of a quantized cache, dequantized: fp32 ``[m, d_qk]``.
    Only the rows named are read (a V4 token's data and scale rows from its page)."""
    fmt = format_of(k_cache, kv_format)
    bpt = BYTES_PER_TOKEN[fmt]
    tokens = tokens.reshape(-1).long()
    if fmt == "V32":
        rows = k_cache.reshape(-1, bpt).view(torch.uint8)[tokens].reshape(-1, 1, 1, bpt)
        return dequantize_kv_cache(rows, kv_format=fmt).reshape(-1, HEAD_DIM[fmt]).float()
    if fmt not in PAGE_BLOCKED:
        raw = k_cache.reshape(-1, bpt).view(torch.uint8)[tokens]
    else:
        data, scale, _ = PAGE_BLOCKED[fmt]
        page = k_cache.shape[1]
        pages = page_rows(k_cache, data + scale)
        blk, slot = tokens // page, tokens % page
        rows = pages[blk.unsqueeze(1), (data * slot).unsqueeze(1) + torch.arange(data, device=tokens.device)]
        at = data * page + scale * slot
        scales = pages[blk.unsqueeze(1), at.unsqueeze(1) + torch.arange(scale, device=tokens.device)]
        raw = torch.cat([rows, scales], dim=1)
    return _from_token_bytes(fmt, raw).float()
