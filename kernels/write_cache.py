"""The cache writer: new 16-bit rows quantized into their slots of a quantized cache, one launch
(``mla_cute.write_kv_cache``).  Its bytes are ``mla_cute.kv_formats``' (the quantizers' rules, exact).

One warp a row, 4 rows a CTA of 128 threads; no shared memory, no barriers.  Lane l holds the row's values
16 l .. 16 l + 15 in fp32 (V32 also RoPE values 512 + 2 l, 513 + 2 l).  A scale tile of T values is T / 16
consecutive lanes: its largest magnitude is a butterfly max over them of the values' absolute bits as
integers (NaN above inf above every finite value, so a tile's NaN or inf is seen there).

  V32          tiles 128 (8 lanes), fp32 scales; lane l's 16 e4m3 bytes at 16 l, tile t's scale at 512 + 4 t
               (lane 8 t writes it), the RoPE pair as bf16 at 528 + 4 l (RoPE NaN: 0x7FFF, as the quantizers).
  V32_NO_ROPE  as V32 without RoPE (528-byte rows).
  V41          tiles 32 (2 lanes), ue8m0 scales: the 16 scale bytes at 512, word w by lane 8 w.
  V41_PAGED    V41's bytes: data row t at 512 t of the page, scale row t at 512 page + 16 t.
  V4           lanes 0-27: the 448 NoPE values, tiles 64 (4 lanes); lanes 28-31: the 64 RoPE values as
               bf16 at 448 + 32 (l - 28) of the data row (576 t of the page); the scale row (576 page + 8 t):
               7 ue8m0 bytes and a zero, words by lanes 0 and 16.
  V41_FP4      tiles 16 (one lane): lane l's codes at 8 l (even index in the low nibble), its e4m3 scale at
               256 + l, words by lanes 4 w.

The e4m3 formats' scale is 2^e, e the least integer >= -13 with amax <= 448 * 2^e, read off amax's bits
(amax = 1.f 2^(b - 127): e = b - 135, plus 1 where f > 0.75); values times 2^-e (exact) to e4m3 (round to
nearest even).  A NaN tile's values are NaN (0x7F) and its scale NaN (ue8m0 0xFF, fp32 0x7FC00000); an inf
tile's scale is inf (0xFF, fp32 0x7F800000), its finite values +-0 and infinite ones NaN.  V41_FP4: scale
s = e4m3(clamp(amax / 6, 2^-9, 448)) (amax counting NaN as inf; 0x7F where the tile holds NaN or inf), the
value v = x / s (IEEE division) to the nearest e2m1 magnitude of min(|v|, 6), ties to the even code, sign
bit where v < 0 or -0 (NaN: code 0).

A slot outside [0, num_blocks * page) (-1: skip) is not written; slots must be distinct (not checked here).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from ..schedules.configs import WriteCacheConfig
from .bits import as_bits, bf16_pair, div_rn, e4m3_pair, e4m3_value, from_bits
from .constants import FLOAT_DTYPES

ROWS_PER_CTA = 4
LANE_VALUES = 16
# kv_format: (values a scale tile, its data row bytes, its scale row bytes: 0 where the scales are in the row)
LAYOUT = {"V32": (128, 656, 0), "V32_NO_ROPE": (128, 528, 0), "V41": (32, 528, 0), "V41_PAGED": (32, 512, 16),
          "V4": (64, 576, 8), "V41_FP4": (16, 288, 0)}
_INF_BITS = 0x7F800000
_NAN_BITS = 0x7FC00000
_E2M1_MIDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


class WriteCacheKernel:
    num_threads = 32 * ROWS_PER_CTA

    def __init__(self, config: WriteCacheConfig):
        self.kv_format = config.kv_format
        self.dtype = FLOAT_DTYPES[config.dtype]
        self.tile, self.data_bytes, self.scale_bytes = LAYOUT[config.kv_format]

    @cute.jit
    def __call__(self, mRows: cute.Tensor, mSlots: cute.Tensor, mPages: cute.Tensor, page: cutlass.Int32, stream):
        """``mRows`` [n, d_qk] 16-bit or fp32; ``mSlots`` [n] int32 or int64; ``mPages`` the cache's pages as
        int32 words [num_blocks, page bytes / 4] from each page's base."""
        n = mRows.shape[0]
        self.kernel(mRows, mSlots, mPages, page).launch(
            grid=[(n + ROWS_PER_CTA - 1) // ROWS_PER_CTA, 1, 1], block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mRows, mSlots, mPages, page):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        row = bidx * ROWS_PER_CTA + tidx // 32
        if row < mRows.shape[0]:
            slot = cutlass.Int64(mSlots[row])
            if slot >= 0 and slot < cutlass.Int64(mPages.shape[0]) * cutlass.Int64(page):
                blk = cutlass.Int32(slot // cutlass.Int64(page))
                off = cutlass.Int32(slot - cutlass.Int64(blk) * cutlass.Int64(page))
                vals = cute.make_rmem_tensor((LANE_VALUES,), cutlass.Float32)
                src = cute.local_tile(mRows[row, None], (LANE_VALUES,), (lane,))
                vals.store(src.load().to(cutlass.Float32))
                data = cute.local_tile(mPages[blk, None], (self.data_bytes // 4,), (off,))
                if cutlass.const_expr(self.kv_format == "V41_FP4"):
                    self.write_fp4(vals, data, lane)
                else:
                    scales = data  # the scales inside the row
                    if cutlass.const_expr(self.scale_bytes > 0):
                        base = page * (self.data_bytes // 4) + off * (self.scale_bytes // 4)
                        scales = cute.make_tensor(mPages[blk, None].iterator + base,
                                                  cute.make_layout(self.scale_bytes // 4))
                    self.write_e4m3(vals, mRows, row, data, scales, lane)

    @cute.jit
    def tile_amax_bits(self, vals, lanes: int):
        """The largest absolute value's bits over this lane's values and its tile's ``lanes`` lanes."""
        top = cutlass.Int32(0)
        for i in cutlass.range_constexpr(LANE_VALUES):
            top = cutlass.max(top, as_bits(vals[i]) & 0x7FFFFFFF)
        step = 1
        while cutlass.const_expr(step < lanes):
            top = cutlass.max(top, cute.arch.shuffle_sync_bfly(top, offset=step))
            step *= 2
        return top

    @cute.jit
    def write_e4m3(self, vals, mRows, row, data, scales, lane):
        lanes = self.tile // LANE_VALUES
        top = self.tile_amax_bits(vals, lanes)
        b = top >> 23
        e = cutlass.max(b - 135 + cutlass.Int32((top & 0x7FFFFF) > 0x600000), -13)
        inv = from_bits((127 - e) << 23)  # 2^-e
        scale_bits = (e + 127) << 23  # the fp32 scale
        ue8m0 = e + 127
        if top == _INF_BITS:
            inv = cutlass.Float32(0.0)
            scale_bits = cutlass.Int32(_INF_BITS)
            ue8m0 = cutlass.Int32(255)
        if top > _INF_BITS:
            inv = from_bits(cutlass.Int32(_NAN_BITS))
            scale_bits = cutlass.Int32(_NAN_BITS)
            ue8m0 = cutlass.Int32(255)
        words = cute.make_rmem_tensor((LANE_VALUES // 4,), cutlass.Int32)
        for w in cutlass.range_constexpr(LANE_VALUES // 4):
            lo = e4m3_pair(self.canonical(vals[4 * w] * inv), self.canonical(vals[4 * w + 1] * inv))
            hi = e4m3_pair(self.canonical(vals[4 * w + 2] * inv), self.canonical(vals[4 * w + 3] * inv))
            words[w] = lo | (hi << 16)
        nope_lanes = 28 if self.kv_format == "V4" else 32
        if lane < nope_lanes:
            cute.autovec_copy(words, cute.local_tile(data, (LANE_VALUES // 4,), (lane,)))
        if cutlass.const_expr(self.kv_format in ("V32", "V32_NO_ROPE")):
            if lane % lanes == 0:
                scales[128 + lane // lanes] = scale_bits
        elif cutlass.const_expr(self.kv_format == "V4"):
            self.write_rope(vals, data, lane)
            self.write_scale_bytes(ue8m0 if lane < 28 else cutlass.Int32(0), scales, lane, lanes, 0)
        else:
            self.write_scale_bytes(ue8m0, scales, lane, lanes, 128 if self.scale_bytes == 0 else 0)
        if cutlass.const_expr(self.kv_format == "V32"):
            rope = cute.make_rmem_tensor((2,), self.dtype)
            cute.autovec_copy(cute.local_tile(mRows[row, None], (2,), (256 + lane,)), rope)
            values = cute.make_rmem_tensor((2,), cutlass.Float32)
            values.store(rope.load().to(cutlass.Float32))
            data[132 + lane] = bf16_pair(values[0], values[1])

    @cute.jit
    def canonical(self, v):
        """NaN as the positive quiet NaN (its e4m3 byte 0x7F)."""
        out = v
        if v != v:
            out = from_bits(cutlass.Int32(_NAN_BITS))
        return out

    @cute.jit
    def write_rope(self, vals, data, lane):
        """V4: lanes 28-31's values as bf16 at data row byte 448 + 32 (l - 28)."""
        if lane >= 28:
            rope = cute.make_rmem_tensor((LANE_VALUES // 2,), cutlass.Int32)
            for w in cutlass.range_constexpr(LANE_VALUES // 2):
                rope[w] = bf16_pair(vals[2 * w], vals[2 * w + 1])
            # 8 words a lane: data row word 112 + 8 (l - 28) = 8 (l - 14).
            cute.autovec_copy(rope, cute.local_tile(data, (LANE_VALUES // 2,), (lane - 14,)))

    @cute.jit
    def write_scale_bytes(self, byte, scales, lane, lanes, at):
        """One byte a tile (its first lane's) gathered 4 a word: word w (tiles 4 w .. 4 w + 3) written by
        the lane of tile 4 w, at word ``at`` + w of ``scales``."""
        group = 4 * lanes
        first = lane - lane % group
        word = cutlass.Int32(0)
        for k in cutlass.range_constexpr(4):
            word = word | ((cute.arch.shuffle_sync(byte, first + k * lanes) & 0xFF) << (8 * k))
        if lane % group == 0:
            scales[at + lane // group] = word

    @cute.jit
    def write_fp4(self, vals, data, lane):
        top = self.tile_amax_bits(vals, 1)
        amax = from_bits(cutlass.min(top, cutlass.Int32(_INF_BITS)))  # NaN counts as inf
        q = div_rn(amax, cutlass.Float32(6.0))
        q = cutlass.min(cutlass.max(q, cutlass.Float32(2.0 ** -9)), cutlass.Float32(448.0))
        s_byte = e4m3_pair(q, cutlass.Float32(0.0)) & 0xFF
        s = e4m3_value(s_byte)
        if top >= _INF_BITS:
            s_byte = cutlass.Int32(0x7F)
        words = cute.make_rmem_tensor((2,), cutlass.Int32)
        words.fill(0)
        for i in cutlass.range_constexpr(LANE_VALUES):
            v = div_rn(vals[i], s)
            a = cutlass.min(from_bits(as_bits(v) & 0x7FFFFFFF), cutlass.Float32(6.0))
            code = cutlass.Int32(0)
            for j in cutlass.range_constexpr(len(_E2M1_MIDS)):
                if cutlass.const_expr(j % 2 == 1):
                    code = code + cutlass.Int32(a >= _E2M1_MIDS[j])
                else:
                    code = code + cutlass.Int32(a > _E2M1_MIDS[j])
            if as_bits(v) < 0 and v == v:
                code = code | 8
            if v != v:
                code = cutlass.Int32(0)
            words[i // 8] = words[i // 8] | (code << (4 * (i % 8)))
        cute.autovec_copy(words, cute.local_tile(data, (2,), (lane,)))
        word = cutlass.Int32(0)
        first = lane - lane % 4
        for k in cutlass.range_constexpr(4):
            word = word | ((cute.arch.shuffle_sync(s_byte, first + k) & 0xFF) << (8 * k))
        if lane % 4 == 0:
            data[64 + lane // 4] = word
