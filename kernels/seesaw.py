"""The seesaw consumer: two warpgroups on a pair of KV tiles, each owning half of the output.

Per pair (K0 in buffer 0, K1 in buffer 1; the 64 x 512 output split into O_L, columns 0-255, of
warpgroup 0 and O_R, 256-511, of warpgroup 1):

  WG0: S0 = Q K0^T; new max m0; P0; O_L = O_L * a + P0 V0_L (P0 from registers)
  WG1: S1 = Q K1^T (at the same time);     after m0: new max m1; P1; O_R = O_R * a + P1 V1_R
  WG0: P0 rescaled to m1 into sP0;          WG1: P1 into sP1
  WG0: O_L = O_L * a + P1 V1_L (P1 from sP1)   WG1: O_R += P0 V0_R (P0 from sP0)

so one warpgroup's softmax runs while the other's tensor cores work.  This module holds the
pieces a kernel strings together: the MMAs and each thread's operands (``SeesawView``), S = Q K^T
per 64 x 64 sub-tile as its bytes land (``issue_qk``), P V from registers or shared memory, the
two warpgroups' softmax steps, and the named barriers (``SeesawBarrier``).  The kernel
(``dense_seesaw.py``) owns the shared-memory plan, the loads and the order of the steps.

Q's last 64 x 64 sub-tile (its RoPE columns) is held in registers (``rQ_rope``) so that the bytes
can hold the second P; S over that sub-tile reads Q from registers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup

from .barriers import SeesawBarrier  # noqa: F401
from .constants import BLOCK_M, BLOCK_N, D_QK, HALF_V, MMA_K
from .serial_consumer import ConsumerBarriers, SplitKVConsumer
from .softmax import LengthMask, MAX_SLACK, rescale_o

SUB = 64  # features per K sub-tile (one 128-byte swizzle atom wide)
NUM_SUB = D_QK // SUB  # 9 sub-tiles per tile; sub-tile 8 is the RoPE part
ROPE_SUB = NUM_SUB - 1
KB_PER_SUB = SUB // MMA_K  # WGMMA k-blocks per sub-tile


class SeesawConsumer(SplitKVConsumer):
    """Seesaw consumer methods; a kernel class sets ``dtype``, ``kv_stages`` (2), ``causal``,
    ``group``, ``s_q``."""

    @cute.jit
    def seesaw_view(self, mmas, sQ, sK, sV, sP0, kv_bar, wg: cutlass.Constexpr, tid) -> "SeesawView":
        """This thread's operands: all 64 tokens of K for S, its warpgroup's 256 columns of V."""
        thr_qk = mmas.qk.get_slice(tid)
        thr_qk_rs = mmas.qk_rs.get_slice(tid)
        thr_pv_rs = mmas.pv_rs.get_slice(tid)
        thr_pv_ss = mmas.pv_ss.get_slice(tid)
        sQ_rope = cute.local_tile(sQ, (BLOCK_M, SUB), (0, ROPE_SUB))
        sP1 = sQ_rope  # the RoPE bytes of sQ, free once they are in registers
        sV_half = cute.local_tile(sV, (HALF_V, BLOCK_N, self.kv_stages), (wg, 0, 0))
        acc_s_shape = thr_qk.partition_shape_C((BLOCK_M, BLOCK_N))
        rQ_rope = thr_qk_rs.make_fragment_A(thr_qk_rs.partition_shape_A((BLOCK_M, SUB)))
        rPa = thr_pv_rs.make_fragment_A(thr_pv_rs.partition_shape_A((BLOCK_M, BLOCK_N)))
        acc_s = thr_qk.make_fragment_C(acc_s_shape)
        return SeesawView(
            mmas=mmas,
            tSrQ=thr_qk.make_fragment_A(thr_qk.partition_A(sQ)),
            tSrK=thr_qk.make_fragment_B(thr_qk.partition_B(sK)),
            tSrK_rs=thr_qk_rs.make_fragment_B(thr_qk_rs.partition_B(sK)),
            tSsQ_rope=thr_qk_rs.partition_A(sQ_rope),
            rQ_rope=rQ_rope,
            tOrV_rs=thr_pv_rs.make_fragment_B(thr_pv_rs.partition_B(sV_half)),
            tOrV_ss=thr_pv_ss.make_fragment_B(thr_pv_ss.partition_B(sV_half)),
            tOrP0=thr_pv_ss.make_fragment_A(thr_pv_ss.partition_A(sP0)),
            tOrP1=thr_pv_ss.make_fragment_A(thr_pv_ss.partition_A(sP1)),
            tPsP0=thr_qk.partition_C(sP0),
            tPsP1=thr_qk.partition_C(sP1),
            tScS=thr_qk.partition_C(cute.make_identity_tensor((BLOCK_M, BLOCK_N))),
            tOcO=thr_pv_rs.partition_C(cute.make_identity_tensor((BLOCK_M, HALF_V))),
            sV_half=sV_half,
            acc_s=acc_s,
            acc_o=thr_pv_rs.make_fragment_C(thr_pv_rs.partition_shape_C((BLOCK_M, HALF_V))),
            rPa=rPa,
            # rPa's registers seen in the accumulator's layout: the two orders are the same
            # (value e of S at (row, col) is value e of the A fragment at (row, k = col)).
            rPc=cute.make_tensor(rPa.iterator, acc_s.layout),
            kphase=cute.make_rmem_tensor((1,), cutlass.Int32),
            kv_bars=kv_bar,
            wg=wg,
            tid=tid,
        )

    @cute.jit
    def issue_qk(self, v, buf: cutlass.Constexpr, subtiles: cutlass.Constexpr, accumulate: cutlass.Constexpr = False,
                 flip: cutlass.Constexpr = True):
        """S (+)= Q K^T over ``subtiles`` of buffer ``buf``, each issued once its bytes land (one
        commit group per sub-tile).  ``flip``: this call waits the tile's last sub-tiles, so the
        buffer's barrier phase moves on."""
        for n, j in enumerate(subtiles):
            cute.arch.mbarrier_wait(v.kv_bar(buf, j), v.kphase[0])
            warpgroup.fence()
            for kk in cutlass.range_constexpr(KB_PER_SUB):
                kb = j * KB_PER_SUB + kk
                if cutlass.const_expr(j == ROPE_SUB):
                    cute.gemm(v.mmas.qk_rs, v.acc_s, v.rQ_rope[None, None, kk], v.tSrK_rs[None, None, kb, buf], v.acc_s)
                elif cutlass.const_expr(n == 0 and kk == 0 and not accumulate):
                    cute.gemm(v.mmas.qk_first, v.acc_s, v.tSrQ[None, None, kb], v.tSrK[None, None, kb, buf], v.acc_s)
                else:
                    cute.gemm(v.mmas.qk, v.acc_s, v.tSrQ[None, None, kb], v.tSrK[None, None, kb, buf], v.acc_s)
            warpgroup.commit_group()
        if cutlass.const_expr(flip):
            v.kphase[0] = v.kphase[0] ^ 1

    @cute.jit
    def issue_pv(self, v, mma, tOrP, tOrV, buf: cutlass.Constexpr):
        """O += P V_half(buf): P this warpgroup's from registers (``mma`` = ``v.mmas.pv_rs``, ``tOrP`` =
        ``v.rPa``) or the other's from shared memory (``v.mmas.pv_ss`` with ``v.tOrP0`` / ``v.tOrP1``)."""
        warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
            cute.gemm(mma, v.acc_o, tOrP[None, None, kb], tOrV[None, None, kb, buf], v.acc_o)
        warpgroup.commit_group()

    @cute.jit
    def row_maxima(self, v, rows, seqlen, blk, scale_log2, masked: cutlass.Constexpr):
        """Mask S (when the tile may hold keys past a row's end) and return the row maxima, in
        log2 units, reduced over the four threads of each row."""
        cur = cute.make_rmem_tensor((2,), cutlass.Float32)
        for i in cutlass.range_constexpr(2):
            cur[i] = -cutlass.Float32.inf
        if cutlass.const_expr(masked):
            limit = cute.make_rmem_tensor((2,), cutlass.Int32)
            for i in cutlass.range_constexpr(2):
                limit[i] = seqlen - rows.shift[i] - blk * BLOCK_N
            mask = LengthMask(limit)
            for e in cutlass.range_constexpr(cute.size(v.acc_s)):
                r, c = v.tScS[e]
                i = (e // 2) % 2
                v.acc_s[e] = mask.apply(v.acc_s[e], c, i)
        for e in cutlass.range_constexpr(cute.size(v.acc_s)):
            i = (e // 2) % 2
            cur[i] = cute.arch.fmax(cur[i], v.acc_s[e])
        for i in cutlass.range_constexpr(2):
            cur[i] = cute.arch.warp_reduction_max(cur[i], threads_in_group=4) * scale_log2
        return cur

    @cute.jit
    def exp_rows(self, v, base, scale_log2):
        """P = 2^(S * scale - base) in place; returns the row sums of this thread's values."""
        part = cute.make_rmem_tensor((2,), cutlass.Float32)
        for i in cutlass.range_constexpr(2):
            part[i] = 0.0
        for e in cutlass.range_constexpr(cute.size(v.acc_s)):
            i = (e // 2) % 2
            p = cute.math.exp2(v.acc_s[e] * scale_log2 - base[i], fastmath=True)
            v.acc_s[e] = p
            part[i] = part[i] + p
        return part

    @cute.jit
    def publish_row_max(self, v, rows, sM, sScale, cur, col: cutlass.Constexpr, chained=None):
        """Running max m = max(sM, cur) of this thread's rows (sM while cur is within ``MAX_SLACK`` of it):
        writes m to sM and the factor 2^(old - m) to column ``col`` of sScale (one thread per row),
        returns (factor, base for the exponent).
        ``chained``: also set to factor * sScale[:, 0] (warpgroup 0's factor of this pair), read
        before the row's thread publishes."""
        alpha = cute.make_rmem_tensor((2,), cutlass.Float32)
        base = cute.make_rmem_tensor((2,), cutlass.Float32)
        new_max = cute.make_rmem_tensor((2,), cutlass.Float32)
        for i in cutlass.range_constexpr(2):
            old = sM[rows.row0 + 8 * i, 0]
            new_max[i] = cute.arch.fmax(old, cur[i])
            # Within MAX_SLACK of the old max it stays (a first key moves it: inf > slack; no key at
            # all, NaN: stays -inf).
            if cur[i] - old <= MAX_SLACK:
                new_max[i] = old
            alpha[i], base[i] = rescale_pair(old, new_max[i])
            if cutlass.const_expr(chained is not None):
                chained[i] = alpha[i] * sScale[rows.row0 + 8 * i, 0]
        cute.arch.sync_warp()  # every thread of the row read the old max before it changes
        if v.tid % 4 == 0:
            for i in cutlass.range_constexpr(2):
                sScale[rows.row0 + 8 * i, col] = alpha[i]
                sM[rows.row0 + 8 * i, 0] = new_max[i]
        return alpha, base

    @cute.jit
    def softmax_wg0(self, v, rows, sM, sScale, seqlen, blk, scale_log2, masked: cutlass.Constexpr):
        """S0 -> P0 against m0 = max(m, rowmax S0); publishes m0 and 2^(m - m0); rescales O_L."""
        cur = self.row_maxima(v, rows, seqlen, blk, scale_log2, masked)
        alpha, base = self.publish_row_max(v, rows, sM, sScale, cur, 0)
        rescale_o(v.acc_o, alpha)
        part = self.exp_rows(v, base, scale_log2)
        for i in cutlass.range_constexpr(2):
            rows.row_sum[i] = rows.row_sum[i] * alpha[i] + part[i]
        v.rPc.store(v.acc_s.load().to(self.dtype))

    @cute.jit
    def softmax_wg1(self, v, rows, sM, sScale, seqlen, blk, scale_log2, masked: cutlass.Constexpr, empty: cutlass.Constexpr,
                    rescale: cutlass.Constexpr = True):
        """S1 -> P1 against m1 = max(m0, rowmax S1); publishes m1 and 2^(m0 - m1) and returns that factor.
        ``rescale``: also rescales O_R from the previous pair's max to m1 (off when P0 V0_R is in flight
        on O_R: the caller rescales).  ``empty``: there is no tile blk (P1 = 0)."""
        cur = cute.make_rmem_tensor((2,), cutlass.Float32)
        if cutlass.const_expr(empty):
            for i in cutlass.range_constexpr(2):
                cur[i] = -cutlass.Float32.inf
        else:
            cur = self.row_maxima(v, rows, seqlen, blk, scale_log2, masked)
        # O_R and the sums are still at the previous pair's max: m_prev -> m0 (warpgroup 0's factor) -> m1.
        total = cute.make_rmem_tensor((2,), cutlass.Float32)
        alpha, base = self.publish_row_max(v, rows, sM, sScale, cur, 1, chained=total)
        if cutlass.const_expr(rescale):
            rescale_o(v.acc_o, total)
        if cutlass.const_expr(empty):
            for i in cutlass.range_constexpr(2):
                rows.row_sum[i] = rows.row_sum[i] * total[i]
        else:
            part = self.exp_rows(v, base, scale_log2)
            for i in cutlass.range_constexpr(2):
                rows.row_sum[i] = rows.row_sum[i] * total[i] + part[i]
            v.rPc.store(v.acc_s.load().to(self.dtype))
        return alpha

    @cute.jit
    def zero_tail_v(self, v, buf: cutlass.Constexpr, valid):
        """Zero this warpgroup's V rows (tokens) >= valid of buffer ``buf``: rows past the cache
        length may hold NaN, and 0 * NaN = NaN in P V."""
        if valid < BLOCK_N:
            self.zero_tail_rows(v.sV_half, buf, valid, v.tid)
            cute.arch.fence_view_async_shared()

    @cute.jit
    def row_values(self, rows, table, col: cutlass.Constexpr):
        """Column ``col`` of a [64][2] fp32 table in shared memory (sM, sScale) at this thread's two
        rows, into registers."""
        vals = cute.make_rmem_tensor((2,), cutlass.Float32)
        for i in cutlass.range_constexpr(2):
            vals[i] = table[rows.row0 + 8 * i, col]
        return vals


@cute.jit
def rescale_pair(old, new):
    """(2^(old - new), the base to subtract from scaled scores): with no key seen yet (new is
    -inf) the factor is 1 and the base 0, so masked scores give exp2(-inf) = 0, never NaN."""
    alpha = cutlass.Float32(1.0)
    base = cutlass.Float32(0.0)
    if new != -cutlass.Float32.inf:
        alpha = cute.math.exp2(old - new, fastmath=True)
        base = new
    return alpha, base


def make_seesaw_mmas(dtype) -> "SeesawMmas":
    k_major, mn_major = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
    rmem = warpgroup.OperandSource.RMEM

    def mma(b_major, n, a_source=warpgroup.OperandSource.SMEM):
        return sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, k_major, b_major, cutlass.Float32, (1, 1, 1), (BLOCK_M, n), a_source
        )

    mmas = SeesawMmas(
        qk_first=mma(k_major, BLOCK_N),
        qk=mma(k_major, BLOCK_N),
        qk_rs=mma(k_major, BLOCK_N, rmem),
        pv_rs=mma(mn_major, HALF_V, rmem),
        pv_ss=mma(mn_major, HALF_V),
    )
    # Fixed flags: setting one inside staged control flow would leak the value.
    mmas.qk_first.set(warpgroup.Field.ACCUMULATE, False)
    for m in (mmas.qk, mmas.qk_rs, mmas.pv_rs, mmas.pv_ss):
        m.set(warpgroup.Field.ACCUMULATE, True)
    return mmas


# ---------------------------------------------------------------- device-side records


@dataclasses.dataclass
class SeesawMmas:
    """S = Q K^T (overwriting, accumulating, Q's RoPE part from registers); O += P V with P from
    registers (own) or shared memory (the other warpgroup's)."""

    qk_first: Any
    qk: Any
    qk_rs: Any
    pv_rs: Any
    pv_ss: Any


@dataclasses.dataclass
class SeesawView:
    mmas: Any
    tSrQ: Any
    tSrK: Any
    tSrK_rs: Any
    tSsQ_rope: Any
    rQ_rope: Any
    tOrV_rs: Any
    tOrV_ss: Any
    tOrP0: Any
    tOrP1: Any
    tPsP0: Any
    tPsP1: Any
    tScS: Any
    tOcO: Any
    sV_half: Any
    acc_s: Any
    acc_o: Any
    rPa: Any
    rPc: Any
    kphase: Any
    kv_bars: Any
    wg: Any
    tid: Any

    def kv_bar(self, buf, j):
        return self.kv_bars + (buf * NUM_SUB + j)


@dataclasses.dataclass
class SeesawBarriers:
    scale0: Any
    scale1: Any
    p0_ready: Any
    p1_issued: Any
    p0_read: Any
    max_init: Any
    epilogue: Any

    @staticmethod
    def make() -> "SeesawBarriers":
        def bar(bid, n=256):
            return pipeline.NamedBarrier(barrier_id=int(bid), num_threads=n)

        return SeesawBarriers(
            scale0=bar(SeesawBarrier.SCALE0),
            scale1=bar(SeesawBarrier.SCALE1),
            p0_ready=bar(SeesawBarrier.P0_READY),
            p1_issued=bar(SeesawBarrier.P1_ISSUED),
            p0_read=bar(SeesawBarrier.P0_READ),
            max_init=bar(SeesawBarrier.MAX_INIT, 128),
            epilogue=ConsumerBarriers(row_max=None, p_ready=None, row_sum=bar(SeesawBarrier.ROW_SUM)),
        )
