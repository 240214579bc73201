"""Combine kernel: merges the fp32 partials of split requests (log-sum-exp rule).

Grid (b, h_kv, ceil(rows / 8)); 8 warps, one query row per warp; lane l owns the
output columns 4l + 128k (k < 4), read as 16-byte vectors.  Requests that were not
split were written by the split kernel directly and are skipped here.

Partial i of a row carries O_i (normalised by its own sum) and lse_i in base 2 (-inf
when it saw no token).  With L = log2(sum_i 2^lse_i):  out = sum_i 2^(lse_i - L) O_i,
lse = L * ln 2; L = -inf (nothing attended anywhere) gives out 0 and lse +inf.  With an
attention sink (sparse decode), out is further scaled by 2^L / (2^L + 2^sink); lse is not.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute

from .consumer import LOG2_E, sink_factor
from .layouts import lse_rows, out_rows

D_V = 512
ROWS_PER_CTA = 8
VEC = 4
CHUNKS = D_V // (32 * VEC)
SPLITS_IN_FLIGHT = 4  # partials each warp loads at once
LN_2 = math.log(2.0)


class CombineKernel:
    num_threads = 32 * ROWS_PER_CTA

    def __init__(self, dtype, group: int, s_q: int, has_sink: bool = False):
        self.dtype = dtype
        self.has_sink = has_sink
        self.group = group
        self.s_q = s_q
        self.rows = group * s_q

    @cute.jit
    def __call__(
        self,
        mNumSplits: cute.Tensor,  # [b + 1] int32
        mOAccum: cute.Tensor,  # [splits, h_kv, rows, 512] fp32
        mLseAccum: cute.Tensor,  # [splits, h_kv, rows] fp32
        mOut: cute.Tensor,  # [b, s_q, h_q, 512]
        mLse: cute.Tensor,  # [b, h_q, s_q] fp32
        mSink: cute.Tensor,  # [h_q] fp32 (h_kv = 1), or None
        stream,
    ):
        h_kv = mOAccum.shape[1]
        mOut = out_rows(mOut, h_kv, self.group, self.s_q)
        mLse = lse_rows(mLse, h_kv, self.group, self.s_q)
        self.kernel(mNumSplits, mOAccum, mLseAccum, mOut, mLse, mSink).launch(
            grid=[mOut.shape[0], h_kv, (self.rows + ROWS_PER_CTA - 1) // ROWS_PER_CTA],
            block=[self.num_threads, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mNumSplits, mOAccum, mLseAccum, mOut, mLse, mSink):
        tidx, _, _ = cute.arch.thread_idx()
        req, kv_head, row_block = cute.arch.block_idx()
        lane = tidx % 32
        row = row_block * ROWS_PER_CTA + tidx // 32
        start = mNumSplits[req]
        n = mNumSplits[req + 1] - start
        if n > 1 and row < self.rows:
            top = -cutlass.Float32.inf
            for s in cutlass.range(lane, n, 32, unroll=1):
                top = cute.arch.fmax(top, mLseAccum[start + s, kv_head, row])
            top = cute.arch.warp_reduction_max(top)
            if top == -cutlass.Float32.inf:
                top = 0.0
            total = cutlass.Float32(0.0)
            for s in cutlass.range(lane, n, 32, unroll=1):
                total += cute.math.exp2(mLseAccum[start + s, kv_head, row] - top, fastmath=True)
            total = cute.arch.warp_reduction_sum(total)
            lse2 = cutlass.Float32.inf
            if total > 0.0:
                lse2 = cute.math.log2(total, fastmath=False) + top

            factor = cutlass.Float32(1.0)
            if cutlass.const_expr(self.has_sink):
                factor = sink_factor(mSink[row % self.group] * LOG2_E, lse2)
            acc = cute.make_rmem_tensor((VEC, CHUNKS), cutlass.Float32)
            acc.fill(0.0)
            # Unrolled so the loads of several partials are in flight together: one partial at
            # a time paid a round trip to L2 per split (66 splits a row at b = 1).
            for s in cutlass.range(n, unroll=SPLITS_IN_FLIGHT):
                w = cute.math.exp2(mLseAccum[start + s, kv_head, row] - lse2, fastmath=True) * factor
                src = mOAccum[start + s, kv_head, row, None]
                for k in cutlass.range_constexpr(CHUNKS):
                    v = cute.local_tile(src, (VEC,), (lane + 32 * k,)).load()
                    for j in cutlass.range_constexpr(VEC):
                        acc[j, k] = acc[j, k] + w * v[j]
            dst = mOut[req, kv_head, row, None]
            for k in cutlass.range_constexpr(CHUNKS):
                out = cute.local_tile(dst, (VEC,), (lane + 32 * k,))
                out.store(acc[None, k].load().to(self.dtype))
            if lane == 0:
                mLse[req, kv_head, row] = lse2 * LN_2
