"""The merge of R partial attention results by log-sum-exp (``mla_cute.merge_partial_attention``: context-parallel
decode's ranks, or any split of a request's tokens), one launch.

One warp a row (b, s, h), 4 rows a CTA of 128 threads; no shared memory, no barriers.  Lane l owns the columns
``c l .. c l + c - 1`` (c = d_v / 32, loaded as 16-byte vectors).  Two passes over the R parts: the largest lse
(a part's +inf, nothing attended, counts as -inf: it weighs nothing), then ``w_r = exp(lse_r - max)``, the sum of
the weights and of ``w_r out_r`` in fp32.  The row's lse is ``max + log(sum)`` (+inf where no part attended: out
0); its out the weighted sum over the sum, times ``1 / (1 + exp(sink - lse))`` with a sink (+inf: 0, -inf: 1).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from ..schedules.configs import MergeConfig
from .constants import FLOAT_DTYPES, LN_2, LOG2_E

ROWS_PER_CTA = 4


class MergeKernel:
    num_threads = 32 * ROWS_PER_CTA

    def __init__(self, config: MergeConfig):
        self.dtype = FLOAT_DTYPES[config.dtype]
        self.cols = config.d_v // 32  # a lane's columns
        self.has_sink = config.has_sink

    @cute.jit
    def __call__(self, mOuts: cute.Tensor, mLses: cute.Tensor, mSink: cute.Tensor, mOut: cute.Tensor,
                 mLse: cute.Tensor, stream):
        """``mOuts`` [R, b, s_q, h_q, d_v]; ``mLses`` [R, b, h_q, s_q] fp32 (natural log); ``mSink`` [h_q] fp32 or
        None; ``mOut`` [b, s_q, h_q, d_v]; ``mLse`` [b, h_q, s_q] fp32."""
        if cutlass.const_expr((mSink is not None) != self.has_sink):
            raise ValueError(f"attn_sink: the kernel is built with has_sink={self.has_sink}")
        rows = mOut.shape[0] * mOut.shape[1] * mOut.shape[2]
        self.kernel(mOuts, mLses, mSink, mOut, mLse).launch(
            grid=[(rows + ROWS_PER_CTA - 1) // ROWS_PER_CTA, 1, 1], block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mOuts, mLses, mSink, mOut, mLse):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        s_q, h_q = mOut.shape[1], mOut.shape[2]
        row = bidx * ROWS_PER_CTA + tidx // 32
        if row < mOut.shape[0] * s_q * h_q:
            b = row // (s_q * h_q)
            s = (row // h_q) % s_q
            h = row % h_q
            parts = mOuts.shape[0]
            top = -cutlass.Float32.inf
            for r in cutlass.range(parts, unroll=1):
                top = cute.arch.fmax(top, self.part_lse2(mLses[r, b, h, s]))
            acc = cute.make_rmem_tensor((self.cols,), cutlass.Float32)
            acc.fill(0.0)
            total = cutlass.Float32(0.0)
            if top > -cutlass.Float32.inf:
                for r in cutlass.range(parts, unroll=1):
                    w = cute.math.exp2(self.part_lse2(mLses[r, b, h, s]) - top, fastmath=True)
                    total = total + w
                    vals = cute.make_rmem_tensor((self.cols,), self.dtype)
                    cute.autovec_copy(cute.local_tile(mOuts[r, b, s, h, None], (self.cols,), (lane,)), vals)
                    acc.store(acc.load() + vals.load().to(cutlass.Float32) * w)
            self.finish(acc, top, total, mSink, mOut, mLse, b, s, h, lane)

    @cute.jit
    def part_lse2(self, lse):
        """A part's lse in base 2; +inf (nothing attended) as -inf."""
        out = lse * LOG2_E
        if lse == cutlass.Float32.inf:
            out = -cutlass.Float32.inf
        return out

    @cute.jit
    def finish(self, acc, top, total, mSink, mOut, mLse, b, s, h, lane):
        lse = cutlass.Float32.inf
        factor = cutlass.Float32(0.0)
        if top > -cutlass.Float32.inf:
            lse2 = top + cute.math.log2(total, fastmath=False)
            lse = lse2 * LN_2
            factor = 1.0 / total
            if cutlass.const_expr(self.has_sink):
                # 1 / (1 + 2^(sink2 - lse2)): +inf sink 0, -inf sink 1.
                factor = factor / (1.0 + cute.math.exp2(mSink[h] * LOG2_E - lse2, fastmath=True))
        out = cute.make_rmem_tensor((self.cols,), self.dtype)
        out.store((acc.load() * factor).to(self.dtype))
        cute.autovec_copy(out, cute.local_tile(mOut[b, s, h, None], (self.cols,), (lane,)))
        if lane == 0:
            mLse[b, h, s] = lse
