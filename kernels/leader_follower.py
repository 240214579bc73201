"""The leader-follower consumer: one warpgroup computes S and P for the whole tile, the other
only multiplies P into its half of the output.

Per 64-token tile in a stage (the 64 x 512 output split into O_L, columns 0-255, of the leader
and O_R, 256-511, of the follower):

  leader:   S = Q K^T (64 x 64, all 576 features); row max m' = max(m, rowmax S); P = 2^(S - m');
            O_L = O_L * 2^(m - m') + P V_L (P from registers); P, 2^(m - m') and m' to shared memory
  follower: O_R = O_R * 2^(m - m') + P V_R (P from shared memory)

so the follower's P V of a tile runs on the tensor cores while the leader computes the next
tile's S and softmax.  Against the serial consumer (``serial_consumer.py``: each warpgroup S over 32
tokens, both meet twice a tile) S is one 64 x 64 MMA per k-block, which reads Q once instead of
twice, and the follower waits for nothing but P.

Named barriers (``SparseBarrier``): P_READY (leader -> follower: sP and sScale of this tile
written), P_FREE (follower -> leader: done with sP and sScale; after the follower's epilogue of
a request, done with sSum too), ROW_SUM (the shared epilogue's sums), OUT_STAGED (both halves of a
request's final rows are in the staging bytes, ``consumer.StagedRows``), OUT_COPIED (the follower
only: its threads have copied them out).  The follower arrives on
P_FREE after every tile but a request's last, and after each request's epilogue but the last;
the leader waits on it before every tile's publication but its first.

The row sums live with the leader; the follower's stay 0, so the shared epilogue's sum of the
two warpgroups' sums is the leader's.  The follower reads the running max from sScale with
each tile's factor, so both warpgroups have the final max for the lse.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import warpgroup

from .barriers import SparseBarrier
from .constants import BLOCK_M, BLOCK_N, HALF_V
from .serial_consumer import ConsumerBarriers, SplitKVConsumer, qk_blocks, rope_qk
from .softmax import MAX_SLACK, rescale_o


class LeaderFollowerConsumer(SplitKVConsumer):
    """Leader and follower methods; a kernel class sets ``dtype``, ``kv_stages``, ``qk_stage_copies``,
    ``causal``, ``group``, ``s_q``."""

    @cute.jit
    def lf_view(self, mmas, sQ, sK, sV, sP, wg: cutlass.Constexpr, tid, rope=None) -> "LeaderFollowerView":
        """This thread's operands: the leader's (wg 0) S over all 64 tokens and V_L; the follower's
        (wg 1) P from shared memory and V_R (``rope``: a ``consumer.RopeQK`` of shared-memory tiles for S's
        RoPE k-blocks in another operand type)."""
        thr_qk = mmas.qk.get_slice(tid)
        thr_pv_rs = mmas.pv_rs.get_slice(tid)
        thr_pv_ss = mmas.pv_ss.get_slice(tid)
        sV_half = cute.local_tile(sV, (HALF_V, BLOCK_N, self.kv_stages), (wg, 0, 0))
        acc_s = thr_qk.make_fragment_C(thr_qk.partition_shape_C((BLOCK_M, BLOCK_N)))
        rPa = thr_pv_rs.make_fragment_A(thr_pv_rs.partition_shape_A((BLOCK_M, BLOCK_N)))
        rope_frags = None
        if cutlass.const_expr(rope is not None):
            rope_frags = rope.fragments(tid, rope.k)
        return LeaderFollowerView(
            mmas=mmas,
            tSrQ=thr_qk.make_fragment_A(thr_qk.partition_A(sQ)),
            tSrK=thr_qk.make_fragment_B(thr_qk.partition_B(sK)),
            tOrV_rs=thr_pv_rs.make_fragment_B(thr_pv_rs.partition_B(sV_half)),
            tOrV_ss=thr_pv_ss.make_fragment_B(thr_pv_ss.partition_B(sV_half)),
            tOrP=thr_pv_ss.make_fragment_A(thr_pv_ss.partition_A(sP)),
            tPsP=thr_qk.partition_C(sP),
            tScS=thr_qk.partition_C(cute.make_identity_tensor((BLOCK_M, BLOCK_N))),
            tOcO=thr_pv_rs.partition_C(cute.make_identity_tensor((BLOCK_M, HALF_V))),
            acc_s=acc_s,
            acc_o=thr_pv_rs.make_fragment_C(thr_pv_rs.partition_shape_C((BLOCK_M, HALF_V))),
            rPa=rPa,
            # rPa's registers seen in the accumulator's layout: value e of S at (row, col) is
            # value e of the A fragment at (row, k = col).
            rPc=cute.make_tensor(rPa.iterator, acc_s.layout),
            wg=wg,
            tid=tid,
            rope=rope_frags,
        )

    @cute.jit
    def lf_barriers(self) -> "LeaderFollowerBarriers":
        def bar(bid):
            return pipeline.NamedBarrier(barrier_id=int(bid), num_threads=256)

        return LeaderFollowerBarriers(
            p_ready=bar(SparseBarrier.P_READY),
            p_free=bar(SparseBarrier.P_FREE),
            epilogue=ConsumerBarriers(row_max=None, p_ready=None, row_sum=bar(SparseBarrier.ROW_SUM)),
        )

    # ---------------------------------------------------------------- the leader
    @cute.jit
    def leader_qk(self, v, stage):
        """S = Q K^T over the stage's 64 tokens and 576 features (waits for the tensor cores).

        With ``qk_stage_copies`` (a kernel attribute): one copy of the 36 MMAs per stage, each with
        the stage a constant, so their K descriptors are constant offsets of the shared-memory base,
        in uniform registers (with the stage in a register, each MMA took an add, a move and two
        R2UR).  The copies are an if / else: without the else ptxas serialises every WGMMA of the
        kernel."""
        if cutlass.const_expr(self.qk_stage_copies):
            if stage == 0:
                self.leader_qk_stage(v, 0)
            else:
                self.leader_qk_stage(v, 1)
        else:
            self.leader_qk_stage(v, stage)

    @cute.jit
    def leader_qk_stage(self, v, stage):
        warpgroup.fence()
        cute.gemm(v.mmas.qk_first, v.acc_s, v.tSrQ[None, None, 0], v.tSrK[None, None, 0, stage], v.acc_s)
        for kb in cutlass.range_constexpr(1, qk_blocks(v)):
            cute.gemm(v.mmas.qk, v.acc_s, v.tSrQ[None, None, kb], v.tSrK[None, None, kb, stage], v.acc_s)
        rope_qk(v, v.acc_s, stage)
        warpgroup.commit_group()
        warpgroup.wait_group(0)

    @cute.jit
    def leader_softmax(self, v, rows, mask, scale_log2):
        """Mask S, update the running max and sum (and ``rows.exact_max`` where kept), P = 2^(S * scale - base)
        into ``v.rPc``, O_L rescaled; returns the factor 2^(old - new max) of the two rows."""
        cur = cute.make_rmem_tensor((2,), cutlass.Float32)
        for i in cutlass.range_constexpr(2):
            cur[i] = -cutlass.Float32.inf
        for e in cutlass.range_constexpr(cute.size(v.acc_s)):
            r, c = v.tScS[e]
            i = (e // 2) % 2  # accumulator value e sits in row row0 + 8 * i
            s = mask.apply(v.acc_s[e], c, i)
            v.acc_s[e] = s
            cur[i] = cute.arch.fmax(cur[i], s)
        alpha = cute.make_rmem_tensor((2,), cutlass.Float32)
        base = cute.make_rmem_tensor((2,), cutlass.Float32)
        for i in cutlass.range_constexpr(2):
            tile_max = cute.arch.warp_reduction_max(cur[i], threads_in_group=4)
            if cutlass.const_expr(rows.exact_max is not None):
                rows.exact_max[i] = cute.arch.fmax(rows.exact_max[i], tile_max)
            self.update_max(rows, i, tile_max, scale_log2, alpha, base, slack=MAX_SLACK)
        self.exp_scores(v.acc_s, rows, base, scale_log2)
        v.rPc.store(v.acc_s.load().to(v.rPc.element_type))
        rescale_o(v.acc_o, alpha)
        return alpha

    @cute.jit
    def leader_publish(self, v, rows, sScale, alpha):
        """P into sP, the factor and the new max into sScale, for the follower (after P_FREE)."""
        if v.tid % 4 == 0:
            for i in cutlass.range_constexpr(2):
                sScale[rows.row0 + 8 * i, 0] = alpha[i]
                sScale[rows.row0 + 8 * i, 1] = rows.row_max[i]
        cute.autovec_copy(v.rPc, v.tPsP)
        cute.arch.fence_view_async_shared()  # the follower's WGMMA reads sP through the async proxy

    @cute.jit
    def leader_pv(self, v, stage):
        """Issue O_L += P V_L with P from registers (asynchronous: the caller waits)."""
        warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(v.rPa, mode=[2])):
            cute.gemm(v.mmas.pv_rs, v.acc_o, v.rPa[None, None, kb], v.tOrV_rs[None, None, kb, stage], v.acc_o)
        warpgroup.commit_group()

    # -------------------------------------------------------------- the follower
    @cute.jit
    def follower_pv(self, v, rows, sScale, stage):
        """After P_READY: O_R rescaled by the leader's factor, then O_R += P V_R with P from sP (waits
        for the tensor cores).  Keeps the running max for the epilogue's lse."""
        alpha = cute.make_rmem_tensor((2,), cutlass.Float32)
        for i in cutlass.range_constexpr(2):
            alpha[i] = sScale[rows.row0 + 8 * i, 0]
            rows.row_max[i] = sScale[rows.row0 + 8 * i, 1]
        rescale_o(v.acc_o, alpha)
        warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(v.tOrP, mode=[2])):
            cute.gemm(v.mmas.pv_ss, v.acc_o, v.tOrP[None, None, kb], v.tOrV_ss[None, None, kb, stage], v.acc_o)
        warpgroup.commit_group()
        warpgroup.wait_group(0)


# ---------------------------------------------------------------- device-side records


@dataclasses.dataclass
class LeaderFollowerView:
    """One consumer thread's MMA operands, accumulators and accumulator coordinates."""

    mmas: Any
    tSrQ: Any
    tSrK: Any
    tOrV_rs: Any
    tOrV_ss: Any
    tOrP: Any
    tPsP: Any
    tScS: Any
    tOcO: Any
    acc_s: Any
    acc_o: Any
    rPa: Any
    rPc: Any
    wg: Any
    tid: Any
    rope: Any = None  # consumer.RopeQK of fragments, or None


@dataclasses.dataclass
class LeaderFollowerBarriers:
    p_ready: Any
    p_free: Any
    epilogue: Any
