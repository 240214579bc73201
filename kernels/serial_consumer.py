"""The serial split-KV consumer: two warpgroups on one 64-row M tile (the dense baseline kernel's; the
sparse leader-follower builds on its views and epilogue).

Per 64-token KV tile in shared memory (K-major 64 x 576; V is the MN-major view of its
first 512 columns): consumer warpgroup c computes S_c = Q K[32c : 32c+32]^T (64 x 32,
WGMMA), the two share the row max through shared memory (``SerialBarrier.ROW_MAX``), write
P_c (16-bit) into columns 32c..32c+31 of sP, and after ``SerialBarrier.P_READY`` compute
O_c = O_c * alpha + P V[:, 256c : 256c+256] (64 x 256 fp32 accumulator).  The halves of
the output never meet: each warpgroup writes its 256 columns.  A kernel passes a mask record
(``softmax.LengthMask``, or the sparse kernel's bias mask) to ``online_softmax``; the epilogue is
``epilogue.py``'s.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup

from .barriers import SerialBarrier
from .constants import BLOCK_M, BLOCK_N, D_QK, D_V, HALF_N, HALF_V, MMA_K
from .epilogue import EpilogueMethods
from .softmax import RowState, rescale_o

ROPE_KB = D_V // MMA_K  # S's first k-block over the RoPE features


def make_consumer_mmas(dtype):
    """(QK^T overwriting, QK^T accumulating, PV) tiled MMAs of one consumer warpgroup."""
    mma_qk_first, mma_qk = [
        sm90_utils.make_trivial_tiled_mma(
            dtype, dtype,
            cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
            cutlass.Float32, (1, 1, 1), (BLOCK_M, HALF_N),
        )
        for _ in range(2)
    ]
    mma_pv = sm90_utils.make_trivial_tiled_mma(
        dtype, dtype,
        cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN,
        cutlass.Float32, (1, 1, 1), (BLOCK_M, HALF_V),
    )
    return mma_qk_first, mma_qk, mma_pv


class SplitKVConsumer(EpilogueMethods):
    """Consumer methods; a kernel class sets ``dtype`` (the output's), ``kv_stages``, ``causal``, ``group``,
    ``s_q``.  The MMA operands' type is the shared-memory tiles' (the sparse kernel's fp16 by default)."""

    @cute.jit
    def consumer_view(self, mma_qk_first, tiled_mma_qk, tiled_mma_pv, sQ, sK, sV, sP, wg, tid,
                      rope=None) -> "ConsumerView":
        """This thread's MMA operands: its warpgroup's 32 tokens of K and 256 columns of V (``rope``: a
        ``RopeQK`` of shared-memory tiles for S's RoPE k-blocks in another operand type)."""
        mma_qk_first.set(warpgroup.Field.ACCUMULATE, False)
        tiled_mma_qk.set(warpgroup.Field.ACCUMULATE, True)
        tiled_mma_pv.set(warpgroup.Field.ACCUMULATE, True)
        thr_qk = tiled_mma_qk.get_slice(tid)
        thr_pv = tiled_mma_pv.get_slice(tid)
        sK_half = cute.local_tile(sK, (HALF_N, D_QK, self.kv_stages), (wg, 0, 0))
        sV_half = cute.local_tile(sV, (HALF_V, BLOCK_N, self.kv_stages), (wg, 0, 0))
        sP_half = cute.local_tile(sP, (BLOCK_M, HALF_N), (0, wg))
        acc_s_shape = thr_qk.partition_shape_C((BLOCK_M, HALF_N))
        rope_frags = None
        if cutlass.const_expr(rope is not None):
            rope.mma.set(warpgroup.Field.ACCUMULATE, True)
            rope_frags = rope.fragments(tid, cute.local_tile(rope.k, (HALF_N, D_QK, self.kv_stages), (wg, 0, 0)))
        return ConsumerView(
            mma_qk_first=mma_qk_first,
            mma_qk=tiled_mma_qk,
            mma_pv=tiled_mma_pv,
            tSrQ=thr_qk.make_fragment_A(thr_qk.partition_A(sQ)),
            tSrK=thr_qk.make_fragment_B(thr_qk.partition_B(sK_half)),
            tOrP=thr_pv.make_fragment_A(thr_pv.partition_A(sP)),
            tOrV=thr_pv.make_fragment_B(thr_pv.partition_B(sV_half)),
            tPsP=thr_qk.partition_C(sP_half),
            tScS=thr_qk.partition_C(cute.make_identity_tensor((BLOCK_M, HALF_N))),
            tOcO=thr_pv.partition_C(cute.make_identity_tensor((BLOCK_M, HALF_V))),
            sV_half=sV_half,
            acc_s=thr_qk.make_fragment_C(acc_s_shape),
            acc_s_next=thr_qk.make_fragment_C(acc_s_shape),
            acc_o=thr_pv.make_fragment_C(thr_pv.partition_shape_C((BLOCK_M, HALF_V))),
            rP=cute.make_rmem_tensor_like(thr_qk.make_fragment_C(acc_s_shape), sP.element_type),
            wg=wg,
            tid=tid,
            rope=rope_frags,
        )

    @cute.jit
    def consumer_barriers(self) -> "ConsumerBarriers":
        return ConsumerBarriers(
            row_max=pipeline.NamedBarrier(barrier_id=int(SerialBarrier.ROW_MAX), num_threads=256),
            p_ready=pipeline.NamedBarrier(barrier_id=int(SerialBarrier.P_READY), num_threads=256),
            row_sum=pipeline.NamedBarrier(barrier_id=int(SerialBarrier.ROW_SUM), num_threads=256),
        )

    @cute.jit
    def row_state(self, m_tile, tid) -> "RowState":
        """The two query rows this thread owns in the WGMMA accumulator: row0 and row0 + 8."""
        row0 = (tid // 32) * 16 + (tid % 32) // 4
        # Causal: row r (query token r // group) sees keys [0, seqlen - shift).
        shift = cute.make_rmem_tensor((2,), cutlass.Int32)
        for i in cutlass.range_constexpr(2):
            shift[i] = 0
            if cutlass.const_expr(self.causal):
                grow = m_tile * BLOCK_M + row0 + 8 * i
                s_idx = cutlass.min(grow // self.group, self.s_q - 1)
                shift[i] = self.s_q - 1 - s_idx
        return RowState(
            row0=row0,
            row_max=cute.make_rmem_tensor((2,), cutlass.Float32),
            row_sum=cute.make_rmem_tensor((2,), cutlass.Float32),
            shift=shift,
        )

    @cute.jit
    def start_rows(self, v, rows):
        """Reset the accumulator and the running max and sum for a new request."""
        v.acc_o.fill(0.0)
        for i in cutlass.range_constexpr(2):
            rows.row_max[i] = -cutlass.Float32.inf
            rows.row_sum[i] = 0.0
            if cutlass.const_expr(rows.exact_max is not None):
                rows.exact_max[i] = -cutlass.Float32.inf

    @cute.jit
    def mma_qk(self, v, acc_s, stage):
        """Issue S = Q K_half^T over the 576 features (asynchronous: the caller waits).

        ``v.mma_qk_first`` overwrites the accumulator, ``v.mma_qk`` adds to it: two objects with
        fixed flags, because setting a flag inside staged control flow would leak the value.
        """
        warpgroup.fence()
        cute.gemm(v.mma_qk_first, acc_s, v.tSrQ[None, None, 0], v.tSrK[None, None, 0, stage], acc_s)
        for kb in cutlass.range_constexpr(1, qk_blocks(v)):
            cute.gemm(v.mma_qk, acc_s, v.tSrQ[None, None, kb], v.tSrK[None, None, kb, stage], acc_s)
        rope_qk(v, acc_s, stage)
        warpgroup.commit_group()

    @cute.jit
    def online_softmax(self, v, rows, bars, sMax, mask, scale_log2):
        """Mask, share the row max with the other warpgroup, turn S into P, rescale O and the sums."""
        acc_s, acc_o, wg, row0 = v.acc_s, v.acc_o, v.wg, rows.row0
        part_max = cute.make_rmem_tensor((2,), cutlass.Float32)
        for i in cutlass.range_constexpr(2):
            part_max[i] = -cutlass.Float32.inf
        for e in cutlass.range_constexpr(cute.size(acc_s)):
            r, c = v.tScS[e]
            i = (e // 2) % 2  # accumulator value e sits in row row0 + 8 * i
            s = mask.apply(acc_s[e], c, i)
            acc_s[e] = s
            part_max[i] = cute.arch.fmax(part_max[i], s)
        for i in cutlass.range_constexpr(2):
            part_max[i] = cute.arch.warp_reduction_max(part_max[i], threads_in_group=4)
            if v.tid % 4 == 0:
                sMax[row0 + 8 * i, wg] = part_max[i]
        bars.row_max.arrive_and_wait()

        alpha = cute.make_rmem_tensor((2,), cutlass.Float32)
        base = cute.make_rmem_tensor((2,), cutlass.Float32)
        for i in cutlass.range_constexpr(2):
            self.update_max(rows, i, cute.arch.fmax(part_max[i], sMax[row0 + 8 * i, 1 - wg]), scale_log2, alpha, base)
        self.exp_scores(acc_s, rows, base, scale_log2)
        rescale_o(acc_o, alpha)

    @cute.jit
    def update_max(self, rows, i: cutlass.Constexpr, tile_max, scale_log2, alpha, base, slack: cutlass.Constexpr = 0.0):
        """Row ``i``'s running max after a tile whose row max (raw score) is ``tile_max``: sets ``alpha[i]``
        = 2^(old - new max) (the factor for O and the sum, applied to the sum here) and ``base[i]``, the
        exponent's offset.

        With ``slack`` > 0 the max moves only when the tile's exceeds it by more than ``slack`` (log2
        units): P stays below 2^slack, and most tiles' factor is exactly 1, so the caller skips
        rescaling O.  The lse and the output use the same max, so only rounding changes."""
        new_max = cute.arch.fmax(rows.row_max[i], tile_max)
        if cutlass.const_expr(slack > 0.0):
            # A first key (old max -inf) always moves it: inf > slack.  No key at all: NaN, kept at -inf.
            if (tile_max - rows.row_max[i]) * scale_log2 <= slack:
                new_max = rows.row_max[i]
        # No key seen yet (new max -inf): base 0, so masked scores give 2^-inf = 0, never NaN.
        safe = new_max
        if new_max == -cutlass.Float32.inf:
            safe = 0.0
        base[i] = safe * scale_log2
        alpha[i] = cute.math.exp2(rows.row_max[i] * scale_log2 - base[i], fastmath=True)
        rows.row_max[i] = new_max
        rows.row_sum[i] = rows.row_sum[i] * alpha[i]

    @cute.jit
    def exp_scores(self, acc_s, rows, base, scale_log2):
        """S -> P = 2^(S * scale - base) in place, added to the row sums."""
        for e in cutlass.range_constexpr(cute.size(acc_s)):
            i = (e // 2) % 2
            p = cute.math.exp2(acc_s[e] * scale_log2 - base[i], fastmath=True)
            acc_s[e] = p
            rows.row_sum[i] = rows.row_sum[i] + p

    @cute.jit
    def mma_pv(self, v, bars, stage):
        """P (in ``v.acc_s``) into sP, then O += P V over the stage (waits for the tensor cores)."""
        v.rP.store(v.acc_s.load().to(v.rP.element_type))
        cute.autovec_copy(v.rP, v.tPsP)
        cute.arch.fence_view_async_shared()
        bars.p_ready.arrive_and_wait()
        warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(v.tOrP, mode=[2])):
            cute.gemm(v.mma_pv, v.acc_o, v.tOrP[None, None, kb], v.tOrV[None, None, kb, stage], v.acc_o)
        warpgroup.commit_group()
        warpgroup.wait_group(0)

    @cute.jit
    def zero_tail_rows(self, sV_half, stage, valid, tid):
        """Zero V rows (tokens) >= valid in this warpgroup's 256 columns of the stage: rows past the
        cache length may hold NaN, and 0 * NaN = NaN in P V."""
        n = (BLOCK_N - valid) * HALF_V
        for idx in cutlass.range(tid, n, 128, unroll=1):
            tok = valid + idx // HALF_V
            col = idx % HALF_V
            sV_half[col, tok, stage] = sV_half.element_type(0.0)


# ---------------------------------------------------------------- device-side records
# Plain containers: their fields are set once and never rebound inside staged control flow
# (register tensors are updated in place), so the DSL tracer sees through them.


@dataclasses.dataclass
class ConsumerView:
    """One consumer thread's MMA operands, accumulators and accumulator coordinates."""

    mma_qk_first: Any
    mma_qk: Any
    mma_pv: Any
    tSrQ: Any
    tSrK: Any
    tOrP: Any
    tOrV: Any
    tPsP: Any
    tScS: Any
    tOcO: Any
    sV_half: Any
    acc_s: Any
    acc_s_next: Any
    acc_o: Any
    rP: Any
    wg: Any
    tid: Any
    rope: Any = None  # RopeQK of fragments, or None


@dataclasses.dataclass
class RopeQK:
    """S's RoPE k-blocks (features D_V to D_QK) in another operand type than the rest of S: the sparse
    kernel's fp16 MMAs leave the cache's bf16 RoPE values as they are.  ``mma`` accumulates; ``q`` and
    ``k`` are Q's and K's shared-memory tiles seen in its type, or (in a view) this thread's fragments."""

    mma: Any
    q: Any
    k: Any

    def fragments(self, tid, sK) -> "RopeQK":
        thr = self.mma.get_slice(tid)
        return RopeQK(self.mma, thr.make_fragment_A(thr.partition_A(self.q)), thr.make_fragment_B(thr.partition_B(sK)))


def qk_blocks(v) -> int:
    """S's k-blocks in the view's main operand type: all, or those before the RoPE features."""
    return ROPE_KB if v.rope is not None else cute.size(v.tSrQ, mode=[2])


@cute.jit
def rope_qk(v, acc_s, stage):
    """S's RoPE k-blocks through ``v.rope`` (nothing without one)."""
    if cutlass.const_expr(v.rope is not None):
        for kb in cutlass.range_constexpr(ROPE_KB, cute.size(v.tSrQ, mode=[2])):
            cute.gemm(v.rope.mma, acc_s, v.rope.q[None, None, kb], v.rope.k[None, None, kb, stage], acc_s)


@dataclasses.dataclass
class ConsumerBarriers:
    row_max: Any
    p_ready: Any
    row_sum: Any
