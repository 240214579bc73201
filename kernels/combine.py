"""Combine kernel: merges the fp32 partials of split requests (log-sum-exp rule).

Grid (b, h_kv, ceil(rows / 4) * chunks); 4 warps, one query row per warp.  ``chunks`` is picked
at launch from the batch size: a batch of at most ``chunked_batch`` requests (the schedule's
``combine_chunked_batch``) splits each row into 4 column chunks of 128 on 4 CTAs, a larger batch
gives each warp the whole row.  Lane l owns the columns 4l + 128k of its chunk or row, read as
16-byte vectors.  Requests that were not split were written by the split kernel directly and
are skipped here.

Why chunks for a small batch only: at b = 1, h_q = 128 there are 128 rows with 66 partials each,
and whole-row CTAs left most SMs idle.  A large batch has rows enough, few partials a row, and
would pay 4x the (mostly empty) CTAs.

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
ROWS_PER_CTA = 4
VEC = 4
CHUNKS = 4  # column chunks of a row in a small batch
ROW_VECTORS = D_V // (32 * VEC)  # 16-byte vectors per lane for a whole row
VECTORS_IN_FLIGHT = 8  # 16-byte loads a thread issues as one group of partials
LN_2 = math.log(2.0)


class CombineKernel:
    num_threads = 32 * ROWS_PER_CTA

    def __init__(self, dtype, group: int, s_q: int, has_sink: bool = False, chunked_batch: int = 4):
        self.dtype = dtype
        self.has_sink = has_sink
        self.group = group
        self.s_q = s_q
        self.rows = group * s_q
        self.row_blocks = (self.rows + ROWS_PER_CTA - 1) // ROWS_PER_CTA
        self.chunked_batch = chunked_batch

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
        chunks = cutlass.Int32(cutlass.select_(mOut.shape[0] <= self.chunked_batch, CHUNKS, 1))
        self.kernel(mNumSplits, mOAccum, mLseAccum, mOut, mLse, mSink).launch(
            grid=[mOut.shape[0], h_kv, self.row_blocks * chunks],
            block=[self.num_threads, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mNumSplits, mOAccum, mLseAccum, mOut, mLse, mSink):
        tidx, _, _ = cute.arch.thread_idx()
        req, kv_head, block = cute.arch.block_idx()
        _, _, blocks = cute.arch.grid_dim()
        lane = tidx % 32
        chunks = blocks // self.row_blocks
        row = (block // chunks) * ROWS_PER_CTA + tidx // 32
        start = mNumSplits[req]
        n = mNumSplits[req + 1] - start
        if n > 1 and row < self.rows:
            if chunks == 1:
                self.merge_row(mOAccum, mLseAccum, mOut, mLse, mSink, req, kv_head, row, start, n, 0, lane,
                               ROW_VECTORS)
            else:
                self.merge_row(mOAccum, mLseAccum, mOut, mLse, mSink, req, kv_head, row, start, n,
                               (block % chunks) * 32, lane, ROW_VECTORS // CHUNKS)

    @cute.jit
    def merge_row(self, mOAccum, mLseAccum, mOut, mLse, mSink, req, kv_head, row, start, n, first_vec, lane,
                  vectors: cutlass.Constexpr):
        """out[row, columns of vectors first_vec + lane + 32k, k < vectors] and lse[row] of one split
        request, from its n partials."""
        vec = first_vec + lane
        # Register double buffer: a group's loads are issued before the previous group's
        # multiplies (the first group's before the row's lse pass), so a warp has a whole group
        # of partials in flight.  Written as one unrolled loop over the splits, the compiler
        # interleaved each load with its use: one partial at a time, a round trip to L2 each.
        lse, vals = self.group_buffers(vectors)
        group = cute.size(lse)
        groups = (n + group - 1) // group
        self.load_group(lse, vals, mOAccum, mLseAccum, start, start + n, kv_head, row, vec)
        lse2 = self.row_lse2(mLseAccum, start, n, kv_head, row, lane)
        factor = cutlass.Float32(1.0)
        if cutlass.const_expr(self.has_sink):
            factor = sink_factor(mSink[row % self.group] * LOG2_E, lse2)
        acc = cute.make_rmem_tensor((VEC, vectors), cutlass.Float32)
        acc.fill(0.0)
        for g in cutlass.range(1, groups, unroll=1):
            next_lse, next_vals = self.group_buffers(vectors)
            self.load_group(next_lse, next_vals, mOAccum, mLseAccum, start + g * group, start + n, kv_head, row, vec)
            self.accumulate(acc, lse, vals, lse2, factor)
            lse.store(next_lse.load())
            vals.store(next_vals.load())
        self.accumulate(acc, lse, vals, lse2, factor)
        dst = mOut[req, kv_head, row, None]
        for k in cutlass.range_constexpr(vectors):
            out = cute.local_tile(dst, (VEC,), (vec + 32 * k,))
            out.store(acc[None, k].load().to(self.dtype))
        if lane == 0 and first_vec == 0:
            mLse[req, kv_head, row] = lse2 * LN_2

    def group_buffers(self, vectors: int):
        """Registers for one group of partials (VECTORS_IN_FLIGHT 16-byte loads a thread): their lse
        and their 16-byte vectors."""
        group = VECTORS_IN_FLIGHT // vectors
        return (cute.make_rmem_tensor((group,), cutlass.Float32),
                cute.make_rmem_tensor((VEC, vectors, group), cutlass.Float32))

    @cute.jit
    def load_group(self, lse, vals, mOAccum, mLseAccum, split, end, kv_head, row, vec):
        """Partials split, split + 1, ... into the buffers.  Past the row's last partial (end - 1)
        the loads repeat it and its lse reads -inf (weight 0), so a short last group needs no
        serial tail."""
        vectors = cute.size(vals, mode=[1])
        for i in cutlass.range_constexpr(cute.size(lse)):
            s = cutlass.min(split + i, end - 1)
            lse[i] = mLseAccum[s, kv_head, row]
            if split + i >= end:
                lse[i] = -cutlass.Float32.inf
            src = mOAccum[s, kv_head, row, None]
            for k in cutlass.range_constexpr(vectors):
                vals[None, k, i].store(cute.local_tile(src, (VEC,), (vec + 32 * k,)).load())

    @cute.jit
    def accumulate(self, acc, lse, vals, lse2, factor):
        for i in cutlass.range_constexpr(cute.size(lse)):
            w = cute.math.exp2(lse[i] - lse2, fastmath=True) * factor
            for k in cutlass.range_constexpr(cute.size(acc, mode=[1])):
                for j in cutlass.range_constexpr(VEC):
                    acc[j, k] = acc[j, k] + w * vals[j, k, i]

    @cute.jit
    def row_lse2(self, mLseAccum, start, n, kv_head, row, lane):
        """log2 of the row's total softmax sum, in one pass: each lane keeps a running (max, sum)
        over its partials, then the warp merges them (a second pass was one more L2 round trip)."""
        top = -cutlass.Float32.inf
        total = cutlass.Float32(0.0)
        for s in cutlass.range(lane, n, 32, unroll=1):
            x = mLseAccum[start + s, kv_head, row]
            new_top = cute.arch.fmax(top, x)
            if new_top > -cutlass.Float32.inf:
                total = total * cute.math.exp2(top - new_top, fastmath=True) + cute.math.exp2(
                    x - new_top, fastmath=True)
            top = new_top
        row_top = cute.arch.warp_reduction_max(top)
        if top > -cutlass.Float32.inf:
            total = total * cute.math.exp2(top - row_top, fastmath=True)
        total = cute.arch.warp_reduction_sum(total)
        lse2 = cutlass.Float32.inf
        if total > 0.0:
            lse2 = cute.math.log2(total, fastmath=False) + row_top
        return lse2
