"""Combine kernel: merges the partials of split requests (log-sum-exp rule).

Three launches, picked at run time from the batch size b and the parts the workspace was sized for:
- whole rows (b > ``chunked_batch``, the schedule's ``combine_chunked_batch``): grid
  (b, h_kv, ceil(rows / 4)), 4 warps, one query row a warp, its partials loaded in groups of 8
  behind a register double buffer;
- column chunks (a small batch): the same, but each row split into 4 column chunks of 128 on 4
  CTAs;
- spread chunks (a small batch whose requests may each span ``spread_partials`` parts or more, the
  schedule's ``combine_spread_partials``: b = 1 with 66 or 132 parts): grid (b, h_kv, rows * 4), one
  CTA of 8 warps a row chunk.  Warp w merges partials w, w + 8, ... into a running (max, sum, O)
  of its own, 8 loads in flight; the warps meet in shared memory, where warp 0 merges their results
  and writes the chunk.  A row of up to 64 partials waits for one group of loads instead of eight.
Each launch is a programmatic dependent launch: a CTA reads the split
counts (the scheduler wrote them before the split kernel ran; the spread launch its sink too), then waits
for the split grid (``griddepcontrol.wait``) before it reads a partial.  Every thread waits, split request
or not, so the combine's completion still implies the split kernel's for the work behind it in the stream.
Lane l owns the columns 4l + 128k of its chunk or row, read as vectors of 4 (16 bytes of fp32 partials,
8 of 16-bit ones) and summed in fp32.  Requests that were not split were written by the split kernel
directly and are skipped here.

Why chunks for a small batch only: at b = 1, h_q = 128 there are 128 rows with 66 partials each;
whole-row CTAs left most SMs idle.  A large batch has rows enough, few partials a row, and would
pay 4x the (mostly empty) CTAs.  Why spread only where the partials are many: with 33 a row (b = 4,
66 parts) the spread kernel's 8x the warps and its barrier cost more than they save (H200, the
combine alone: 9.3 us against 7.9 one warp a chunk, partials in L2); with 66 or 132 a row (b = 1)
one warp a chunk waits for 9 or 17 groups of loads in turn, and the spread calls were 3-11% faster
(docs/log/dense_decode.md, entry 31).

Partial i of a row carries O_i (normalised by its own sum; fp32, or bf16 for sparse decode's small
plans) and lse_i in base 2, fp32 (-inf when it saw no token).  With
L = log2(sum_i 2^lse_i):  out = sum_i 2^(lse_i - L) O_i,
lse = L * ln 2; L = -inf (nothing attended anywhere) gives out 0 and lse +inf.  With an
attention sink (sparse decode), out is further scaled by 2^L / (2^L + 2^sink); lse is not.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.memory import SmemAllocator

from ..schedules.configs import CombineConfig
from .constants import D_V, DTYPES, LN_2, LOG2_E
from .softmax import sink_factor
from .layouts import lse_rows, out_rows

ROWS_PER_CTA = 4
VEC = 4
CHUNKS = 4  # column chunks of a row in a small batch
ROW_VECTORS = D_V // (32 * VEC)  # 16-byte vectors per lane for a whole row
VECTORS_IN_FLIGHT = 8  # 16-byte loads a thread issues as one group of partials
CHUNK_COLS = D_V // CHUNKS
SPREAD_WARPS = 8  # warps sharing one row chunk's partials in the spread kernel


class CombineKernel:
    num_threads = 32 * ROWS_PER_CTA

    def __init__(self, config: CombineConfig):
        self.dtype = DTYPES[config.dtype]
        self.spread_partials = config.spread_partials
        self.has_sink = config.has_sink
        self.group = config.group
        self.s_q = config.s_q
        self.rows = config.group * config.s_q
        self.row_blocks = (self.rows + ROWS_PER_CTA - 1) // ROWS_PER_CTA
        self.chunked_batch = config.chunked_batch

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

        @cute.struct
        class SpreadRow:
            """A spread row's shared memory: each warp's running max and sum, and its O of the chunk."""

            top: cute.struct.MemRange[cutlass.Float32, SPREAD_WARPS]
            total: cute.struct.MemRange[cutlass.Float32, SPREAD_WARPS]
            acc: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, SPREAD_WARPS * CHUNK_COLS], 16]

        self.spread_row = SpreadRow
        batch = mOut.shape[0]
        small = batch <= self.chunked_batch
        # The partials a request may have: one per part it spans (the workspace holds b + parts).
        parts = mOAccum.shape[0] - batch
        spread = small & (parts >= self.spread_partials * batch)
        if cutlass.const_expr(self.spread_partials == 0):
            spread = cutlass.Boolean(False)
        if spread:
            self.spread_kernel(mNumSplits, mOAccum, mLseAccum, mOut, mLse, mSink).launch(
                grid=[batch, h_kv, self.rows * CHUNKS],
                block=[32 * SPREAD_WARPS, 1, 1],
                smem=SpreadRow.size_in_bytes(),
                stream=stream,
                use_pdl=True,
            )
        else:
            chunks = cutlass.Int32(cutlass.select_(small, CHUNKS, 1))
            self.kernel(mNumSplits, mOAccum, mLseAccum, mOut, mLse, mSink).launch(
                grid=[batch, h_kv, self.row_blocks * chunks],
                block=[self.num_threads, 1, 1],
                stream=stream,
                use_pdl=True,
            )

    @cute.kernel
    def kernel(self, mNumSplits, mOAccum, mLseAccum, mOut, mLse, mSink):
        """Four rows a CTA, one a warp: whole rows, or (a small batch) one column chunk of each."""
        tidx, _, _ = cute.arch.thread_idx()
        req, kv_head, block = cute.arch.block_idx()
        _, _, blocks = cute.arch.grid_dim()
        lane = tidx % 32
        chunks = blocks // self.row_blocks
        row = (block // chunks) * ROWS_PER_CTA + tidx // 32
        start = mNumSplits[req]
        n = mNumSplits[req + 1] - start
        cute.arch.griddepcontrol_wait()
        if n > 1 and row < self.rows:
            if chunks == 1:
                self.merge_row(mOAccum, mLseAccum, mOut, mLse, mSink, req, kv_head, row, start, n, 0, lane,
                               ROW_VECTORS)
            else:
                self.merge_row(mOAccum, mLseAccum, mOut, mLse, mSink, req, kv_head, row, start, n,
                               (block % chunks) * 32, lane, ROW_VECTORS // CHUNKS)

    @cute.kernel
    def spread_kernel(self, mNumSplits, mOAccum, mLseAccum, mOut, mLse, mSink):
        """One row's column chunk, its partials spread over the CTA's warps (a small batch)."""
        tidx, _, _ = cute.arch.thread_idx()
        req, kv_head, block = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32
        row = block // CHUNKS
        chunk = block - row * CHUNKS
        vec = chunk * (CHUNK_COLS // VEC) + lane
        start = mNumSplits[req]
        n = mNumSplits[req + 1] - start
        sink2 = cutlass.Float32(0.0)
        if cutlass.const_expr(self.has_sink):
            sink2 = mSink[row % self.group] * LOG2_E  # loaded with the partials, not after them
        cute.arch.griddepcontrol_wait()
        if n > 1:  # the same for the whole CTA: its barrier below is reached by every thread or none
            storage = SmemAllocator().allocate(self.spread_row)
            sTop = storage.top.get_tensor(cute.make_layout(SPREAD_WARPS))
            sTotal = storage.total.get_tensor(cute.make_layout(SPREAD_WARPS))
            sAcc = storage.acc.get_tensor(cute.make_layout((VEC, 32, SPREAD_WARPS), stride=(1, VEC, CHUNK_COLS)))
            top, total, acc = self.merge_spread(mOAccum, mLseAccum, kv_head, row, start, n, warp, vec)
            if lane == 0:
                sTop[warp] = top
                sTotal[warp] = total
            cute.autovec_copy(acc, sAcc[None, lane, warp])
            cute.arch.sync_threads()
            if warp == 0:
                self.finish_spread(sTop, sTotal, sAcc, mOut, mLse, sink2, req, kv_head, row, vec, lane, chunk == 0)

    @cute.jit
    def merge_spread(self, mOAccum, mLseAccum, kv_head, row, start, n, warp, vec):
        """This warp's partials (warp, warp + 8, ...) merged: their max lse, the sum of 2^(lse_i - max),
        and sum 2^(lse_i - max) O_i over the lane's 4 columns.  A group's 8 loads are issued together (a
        partial past the row's last is not loaded: lse -inf, weight 0)."""
        top = -cutlass.Float32.inf
        total = cutlass.Float32(0.0)
        acc = cute.make_rmem_tensor((VEC,), cutlass.Float32)
        acc.fill(0.0)
        stride = SPREAD_WARPS * VECTORS_IN_FLIGHT
        for first in cutlass.range(warp, n, stride, unroll=1):
            lse = cute.make_rmem_tensor((VECTORS_IN_FLIGHT,), cutlass.Float32)
            vals = cute.make_rmem_tensor((VEC, VECTORS_IN_FLIGHT), cutlass.Float32)
            for i in cutlass.range_constexpr(VECTORS_IN_FLIGHT):
                s = first + i * SPREAD_WARPS
                lse[i] = -cutlass.Float32.inf
                vals[None, i].fill(0.0)
                if s < n:
                    lse[i] = mLseAccum[start + s, kv_head, row]
                    src = cute.local_tile(mOAccum[start + s, kv_head, row, None], (VEC,), (vec,))
                    vals[None, i].store(load_fp32(src))
            new_top = top
            for i in cutlass.range_constexpr(VECTORS_IN_FLIGHT):
                new_top = cute.arch.fmax(new_top, lse[i])
            if new_top > -cutlass.Float32.inf:
                scale = cute.math.exp2(top - new_top, fastmath=True)
                total = total * scale
                for j in cutlass.range_constexpr(VEC):
                    acc[j] = acc[j] * scale
                for i in cutlass.range_constexpr(VECTORS_IN_FLIGHT):
                    w = cute.math.exp2(lse[i] - new_top, fastmath=True)
                    total = total + w
                    for j in cutlass.range_constexpr(VEC):
                        acc[j] = acc[j] + w * vals[j, i]
            top = new_top
        return top, total, acc

    @cute.jit
    def finish_spread(self, sTop, sTotal, sAcc, mOut, mLse, sink2, req, kv_head, row, vec, lane, writes_lse):
        """Warp 0: the warps' results merged into the chunk's output (and, for chunk 0, the row's lse)."""
        row_top = -cutlass.Float32.inf
        for w in cutlass.range_constexpr(SPREAD_WARPS):
            row_top = cute.arch.fmax(row_top, sTop[w])
        total = cutlass.Float32(0.0)
        if row_top > -cutlass.Float32.inf:
            for w in cutlass.range_constexpr(SPREAD_WARPS):
                total = total + sTotal[w] * cute.math.exp2(sTop[w] - row_top, fastmath=True)
        lse2 = cutlass.Float32.inf
        if total > 0.0:
            lse2 = cute.math.log2(total, fastmath=False) + row_top
        factor = cutlass.Float32(1.0)
        if cutlass.const_expr(self.has_sink):
            factor = sink_factor(sink2, lse2)
        out = cute.make_rmem_tensor((VEC,), cutlass.Float32)
        out.fill(0.0)
        for w in cutlass.range_constexpr(SPREAD_WARPS):
            weight = cute.math.exp2(sTop[w] - lse2, fastmath=True) * factor
            part = sAcc[None, lane, w].load()
            out.store(out.load() + weight * part)
        dst = cute.local_tile(mOut[req, kv_head, row, None], (VEC,), (vec,))
        dst.store(out.load().to(self.dtype))
        if lane == 0 and writes_lse:
            mLse[req, kv_head, row] = lse2 * LN_2

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
                vals[None, k, i].store(load_fp32(cute.local_tile(src, (VEC,), (vec + 32 * k,))))

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


@cute.jit
def load_fp32(src):
    """A vector of partial O as fp32 (the partials are fp32, or 16-bit for sparse decode's small plans)."""
    if cutlass.const_expr(src.element_type == cutlass.Float32):
        return src.load()
    return src.load().to(cutlass.Float32)
