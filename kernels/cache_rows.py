"""The sparse decode producer's view of a cache format (``mla_cute.kv_formats``): which bytes of a token a
producer thread loads, and how each piece dequantizes into the fp16 K tile.

Every format gives a thread (lane l of the 8 sharing a token) the same K-tile columns: latent piece m
(m < 4) is the 16 columns from 128 m + 16 l; the RoPE piece, where there is one, 8 bf16 values.  The
thread's registers per token (int32 words, 4 a slot): slots 0-3 the latent pieces, 4 the scales, 5 the
RoPE piece.

  V32          656 B a token: e4m3 piece m at byte 16 (8 m + l); 4 fp32 scales at 512 (one per 128: piece
               m's is word m); RoPE bf16 at 528 + 16 l into columns 512 + 8 l, left bf16 (S's RoPE
               k-blocks are bf16 MMAs; V is columns 0-511).  d_qk 576.
  V32_NO_ROPE  528 B: the latent and its scales as V32; no RoPE.  d_qk 512.
  V41          528 B: the latent as V32 (its last 64 values are the quantized RoPE); 16 ue8m0 scales at 512
               (one per 32: piece m's is byte 4 m + l / 2).  d_qk 512.
  V41_PAGED    page-blocked V41: data row t (512 e4m3, the latent as V32's) at byte 512 t of its page; scale row
               t (V41's 16 ue8m0) at 512 page + 16 t.  d_qk 512.
  V4           page-blocked: data row t at byte 576 t of its page: 448 e4m3 (pieces m < 3, and m = 3 for
               l < 4), RoPE bf16 at 448 + 16 l into columns 448 + 8 l, converted to fp16 (V reads them
               too, so they take the operand type); scale row t at 576 page + 8 t: 7 ue8m0 (one per 64:
               piece m's is byte 2 m + l / 4).  d_qk 512.

  V41_FP4      the extra cache beside a V41 or V41_PAGED main cache (a second codec of the kernel), 288 B: lane
               l's piece m is 16 e2m1 codes, the 8 bytes at 64 m + 8 l (slot m's first two words); the 32 e4m3
               scales at 256 fill the scale and RoPE slots (piece m's is byte 8 m + l).  A code s e1 e0 m is
               read as the e4m3 byte s 0 0 e1 e0 m 0 0, its value times 2^-6, converted by the e4m3 path and
               multiplied by the scale times 2^6: exact in fp16.  d_qk 512.

A ue8m0 byte e is the scale 2^(e - 127), made as the fp32 of bits e << 23 and rounded to fp16 like V32's
fp32 scales: exact for the quantizers' scales, 2^-13 and up.  fp16 holds the dequantized values up to
65504 (a scale up to 2^7), and V4's RoPE values alike (larger ones become inf).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from .bits import byte_perm, e4m3_value, from_bits

PIECE = 16  # bytes per load
WORDS = PIECE // 4
LATENT_PIECES = 4  # latent loads a thread per token
SCALE_SLOT = LATENT_PIECES
ROPE_SLOT = LATENT_PIECES + 1
SLOTS = LATENT_PIECES + 2


@cute.jit
def load_piece(src, dst):
    """16 bytes of a cache row (4 int32 words) into registers: one vector load that asks L2 to fetch the 256-byte
    block around it.  A token's row is read by 8 lanes in 128-byte segments, so the prefetch brings its next
    segment into L2 while the first is still in flight (the gather is latency-bound: each tile's rows are random
    cache lines)."""
    atom = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), cutlass.Int32, num_bits_per_copy=128,
                               l2_prefetch_size=cute.nvgpu.L2PrefetchSize.SIZE_256B)
    cute.copy(atom, src, dst)


class CacheRows:
    """One format's token bytes (the class attributes) and its producer steps.

    ``row_bytes``: a token's bytes in the kernel's ``mCache`` rows (V4: its data row); ``d_qk``: q's head
    dimension; ``rope_col``: the K-tile column of lane 0's RoPE piece (None: no RoPE piece);
    ``rope_bf16``: the RoPE columns stay bf16 (S's separate k-blocks) rather than fp16;
    ``whole_tile_rows_in_flight``: the rows (of 4) a whole-tile gather's thread loads before converting them;
    ``two_cache_rows_in_flight``: the same in the kernel over two caches."""

    row_bytes = 528
    d_qk = 512
    rope_col = None
    rope_bf16 = False
    whole_tile_rows_in_flight = 4  # rows a whole-tile gather's thread loads before converting them
    two_cache_rows_in_flight = 2  # the same from two caches (where this format is the main cache)

    @property
    def row_words(self) -> int:
        return self.row_bytes // 4

    @property
    def tile_cols(self) -> int:
        """K-tile columns the producer fills (and a crossover hands over): 576 with the bf16 RoPE block."""
        return 576 if self.rope_bf16 else 512

    def scale_view(self, mCache):
        """The scale rows beside ``mCache``'s (None: the scales are in the token's row)."""
        return None

    @cute.jit
    def load(self, raw, k, src, blk_id, off):
        """Start this thread's loads of token ``off`` of block ``blk_id`` into ``raw[None, :, k]``."""
        row = src.mCache[blk_id, off, None]
        for m in cutlass.range_constexpr(LATENT_PIECES):
            load_piece(cute.local_tile(row, (WORDS,), (m * 8 + src.lane,)), raw[None, m, k])
        self.load_scales(raw, k, src, blk_id, off, row)

    @cute.jit
    def load_scales(self, raw, k, src, blk_id, off, row):
        """The token's scales into the scale slot: the 16 bytes after its 512 latent bytes."""
        load_piece(cute.local_tile(row, (WORDS,), (512 // PIECE,)), raw[None, SCALE_SLOT, k])

    def piece_lanes(self, m: int) -> int:
        """The lanes (from 0) whose latent piece ``m`` is e4m3: all 8 (V4's piece 3: 4, the rest is RoPE)."""
        return 8

    @cute.jit
    def scale(self, raw, k, m, lane):
        """Latent piece ``m``'s scale, fp32."""
        return cute.recast_tensor(raw[None, SCALE_SLOT, k], cutlass.Float32)[m]

    @cute.jit
    def piece(self, raw, k, m, lane, dtype):
        """Latent piece ``m`` of row ``k`` dequantized: its 16 values in ``dtype`` (e4m3 times the scale rounded
        to ``dtype``, one multiply per two values)."""
        scale = self.scale(raw, k, m, lane)
        fp8 = cute.recast_tensor(raw[None, m, k], cutlass.Float8E4M3FN)
        return fp8.load().to(dtype) * scale.to(dtype)


class V32Rows(CacheRows):
    row_bytes = 656
    d_qk = 576
    rope_col = 512
    rope_bf16 = True
    two_cache_rows_in_flight = 4

    @cute.jit
    def load(self, raw, k, src, blk_id, off):
        CacheRows.load(self, raw, k, src, blk_id, off)
        row = src.mCache[blk_id, off, None]
        load_piece(cute.local_tile(row, (WORDS,), ((512 + 16) // PIECE + src.lane,)), raw[None, ROPE_SLOT, k])


class NoRopeRows(CacheRows):
    """V32_NO_ROPE."""


@cute.jit
def ue8m0_scale(word, byte):
    """The fp32 scale 2^(e - 127) of byte ``byte`` (0-3, may be a register) of ``word``."""
    return from_bits(((word >> (byte * 8)) & 0xFF) << 23)


class V41Rows(CacheRows):
    whole_tile_rows_in_flight = 2

    @cute.jit
    def scale(self, raw, k, m, lane):
        # Byte 4 m + l / 2 of the 16: word m, byte l / 2.
        return ue8m0_scale(raw[m, SCALE_SLOT, k], lane >> 1)


class PageBlocked:
    """A page-blocked format's scale rows: ``scale_words`` words a token, after the page's data rows."""

    scale_words = WORDS

    def scale_view(self, mCache):
        """Scale row t of block b: ``scale_words`` words at word (data row words) page + (scale_words) t."""
        page = mCache.shape[1]
        words = self.scale_words
        layout = cute.make_layout((mCache.shape[0], page, words), stride=(mCache.stride[0], words, 1))
        return cute.make_tensor(mCache.iterator + cute.assume(page * self.row_words, divby=16), layout)


class V41PagedRows(PageBlocked, V41Rows):
    row_bytes = 512  # the data row; the 16-byte scale rows follow the page's data rows

    @cute.jit
    def load_scales(self, raw, k, src, blk_id, off, row):
        load_piece(src.scales[blk_id, off, None], raw[None, SCALE_SLOT, k])


class V4Rows(PageBlocked, CacheRows):
    row_bytes = 576  # the data row (448 e4m3 + 64 bf16); the 8-byte scale rows follow the page's data rows
    rope_col = 448
    scale_words = 2
    two_cache_rows_in_flight = 4

    def piece_lanes(self, m: int) -> int:
        return 4 if m == 3 else 8

    @cute.jit
    def load(self, raw, k, src, blk_id, off):
        row = src.mCache[blk_id, off, None]
        lane = src.lane
        for m in cutlass.range_constexpr(LATENT_PIECES - 1):
            load_piece(cute.local_tile(row, (WORDS,), (m * 8 + lane,)), raw[None, m, k])
        if lane < 4:
            load_piece(cute.local_tile(row, (WORDS,), (24 + lane,)), raw[None, 3, k])
        load_piece(cute.local_tile(row, (WORDS,), (448 // PIECE + lane,)), raw[None, ROPE_SLOT, k])
        scales = src.scales[blk_id, off, None]
        cute.autovec_copy(scales, cute.local_tile(raw[None, SCALE_SLOT, k], (2,), (0,)))

    @cute.jit
    def scale(self, raw, k, m, lane):
        # Byte 2 m + l / 4 of the 8: word m / 2, byte 2 (m % 2) + l / 4.
        return ue8m0_scale(raw[m // 2, SCALE_SLOT, k], 2 * (m % 2) + (lane >> 2))


class Fp4Rows(CacheRows):
    """V41_FP4, an extra cache's codec (the module docstring)."""

    row_bytes = 288
    whole_tile_rows_in_flight = 2

    @cute.jit
    def load(self, raw, k, src, blk_id, off):
        row = src.mCache[blk_id, off, None]
        for m in cutlass.range_constexpr(LATENT_PIECES):
            cute.autovec_copy(cute.local_tile(row, (2,), (m * 8 + src.lane,)), cute.local_tile(raw[None, m, k], (2,), (0,)))
        load_piece(cute.local_tile(row, (WORDS,), (256 // PIECE,)), raw[None, SCALE_SLOT, k])
        load_piece(cute.local_tile(row, (WORDS,), (256 // PIECE + 1,)), raw[None, ROPE_SLOT, k])

    @cute.jit
    def scale(self, raw, k, m, lane):
        # Byte 8 m + l of the 32: word 2 m + l / 4 (pieces 2, 3 in the RoPE slot), byte l % 4; e4m3 to fp32.
        slot = SCALE_SLOT if m < 2 else ROPE_SLOT
        word = cutlass.select_(lane < 4, raw[2 * (m % 2), slot, k], raw[2 * (m % 2) + 1, slot, k])
        byte = (word >> ((lane & 3) * 8)) & 0x7F  # a scale is positive
        value = e4m3_value(byte)
        if byte == 0x7F:  # a tile that held NaN or inf: NaN, as the reference reads it
            value = cutlass.Float32.nan
        return value

    @cute.jit
    def piece(self, raw, k, m, lane, dtype):
        """The 16 codes (two words, 8 each, the first in the low nibble) as e4m3 bytes of their values times
        2^-6 (code s e1 e0 m to byte s 0 0 e1 e0 m 0 0: the same exponent and mantissa, 6 bias steps apart), put
        in order by prmt and converted two at a time; times the scale times 2^6, exact in fp16."""
        fp8 = cute.make_rmem_tensor((PIECE // 4,), cutlass.Int32)
        for w in cutlass.range_constexpr(2):
            codes = raw[w, m, k]
            even = e2m1_as_e4m3(codes & 0x0F0F0F0F)  # bytes: codes 0, 2, 4, 6 of the word
            odd = e2m1_as_e4m3((codes >> 4) & 0x0F0F0F0F)  # codes 1, 3, 5, 7
            fp8[2 * w] = byte_perm(even, odd, 0x5140)
            fp8[2 * w + 1] = byte_perm(even, odd, 0x7362)
        vals = cute.recast_tensor(fp8, cutlass.Float8E4M3FN).load().to(dtype)
        return vals * (self.scale(raw, k, m, lane) * cutlass.Float32(2.0 ** 6)).to(dtype)


@cute.jit
def e2m1_as_e4m3(nibbles):
    """Four e2m1 codes, one in the low nibble of each byte, as the e4m3 bytes of their values times 2^-6."""
    return ((nibbles & 0x08080808) << 4) | ((nibbles & 0x07070707) << 2)


ROWS = {"V32": V32Rows, "V32_NO_ROPE": NoRopeRows, "V41": V41Rows, "V41_PAGED": V41PagedRows, "V4": V4Rows,
        "V41_FP4": Fp4Rows}


def cache_rows(kv_format: str) -> CacheRows:
    """The producer's steps for ``kv_format`` (a sparse decode kernel's config field, or its extra cache's)."""
    if kv_format not in ROWS:
        raise ValueError(f"kv_format: the sparse decode kernel reads {sorted(ROWS)}, got {kv_format!r}")
    return ROWS[kv_format]()
