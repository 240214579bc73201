"""Dense MLA decode over a paged cache, split-KV, on Hopper (SM90a).

One CTA serves one (SM part, 64-row M tile, KV head).  Its part of the batch comes
from the split-KV scheduler record (``mla_cute.schedules.planner``): requests
``begin_req..end_req``, the first from ``begin_block``, the last up to ``end_block``.
The M tile packs the ``s_q * h_q / h_kv`` query rows of one KV head (row = s * group + head).

Warpgroup roles (384 threads):
  WG0      producer.  Warp 0 issues the TMA copies: the 64 x 576 Q tile once per request,
           then 64-token x 576 KV tiles, the physical rows taken from ``block_table``.
           Its registers go to the consumers (setmaxnreg).
  WG1, WG2 consumers c = 0, 1.  Per KV tile: S_c = Q K[32c : 32c+32]^T (64 x 32, WGMMA),
           the row max shared through shared memory, P_c (16-bit) into columns
           32c..32c+31 of sP, then O_c = O_c * alpha + P V[:, 256c : 256c+256]
           (64 x 256 fp32 accumulator, WGMMA).  The two halves of the output never
           meet: each warpgroup writes its 256 columns.

Shared-memory plan (16-bit q/cache; bytes):
  sQ    64 x 576                       73 728
  sKV   kv_stages x 64 x 576          73 728 each (V is the first 512 columns of K)
  sP    64 x 64                          8 192
  sMax, sSum  [2][64] fp32               1 024
  mbarriers: Q full/empty, KV full/empty per stage
All 16-bit tiles use the 128-byte swizzle; K and V share one buffer because the
K-major (token x feature) and MN-major (feature x token) swizzled layouts place
every element at the same byte.

Named barriers: see ``BarrierId``.

Output: requests served whole write ``out [b, s_q, h_q, 512]`` (q dtype) and
``lse [b, h_q, s_q]`` (natural log) in place (``layouts.py``); pieces of a split request
write fp32 partials normalised by their own sum, with a base-2 lse, to
``o_accum[num_splits[req] + split_idx]`` for the combine kernel.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup

from ..schedules.dense import DenseDecodeSchedule
from .layouts import lse_rows, out_rows

D_QK = 576
D_V = 512
BLOCK_M = 64  # query rows per CTA: one WGMMA M
BLOCK_N = 64  # tokens per KV tile
HALF_N = BLOCK_N // 2  # tokens of S per consumer warpgroup
HALF_V = D_V // 2  # output columns per consumer warpgroup
LOG2_E = math.log2(math.e)
# L2 cache-policy operand of a TMA load marking the lines evict-first (CUTLASS's
# CacheHintSm90::EVICT_FIRST): each KV tile is read once, so it should not push Q or the
# block table out of L2.
L2_EVICT_FIRST = 0x12F0000000000000
LN_2 = math.log(2.0)


class BarrierId(enum.IntEnum):
    """Named hardware barriers (0 is __syncthreads)."""

    ROW_MAX = 1  # both consumer warpgroups published their partial row max
    P_READY = 2  # both halves of P are in sP (and out-of-range V rows are zeroed)
    ROW_SUM = 3  # both consumer warpgroups published their partial row sum


class DenseDecodeKernel:
    """Static configuration of one compiled dense decode kernel."""

    num_threads = 384
    producer_regs = 40
    consumer_regs = 232

    def __init__(
        self,
        dtype,
        rows: int,
        group: int,
        s_q: int,
        causal: bool,
        page_size: int,
        schedule: DenseDecodeSchedule,
    ):
        if page_size % BLOCK_N != 0:
            raise NotImplementedError(f"page_block_size {page_size}: the kernel needs a multiple of {BLOCK_N}")
        schedule.validate()
        self.dtype = dtype
        self.rows = rows  # s_q * group query rows per KV head
        self.group = group  # h_q / h_kv
        self.s_q = s_q
        self.causal = causal
        self.page_size = page_size
        self.kv_stages = schedule.kv_stages
        self.qk_prefetch = schedule.qk_prefetch
        self.kv_evict_first = schedule.kv_evict_first
        self.m_tiles = (rows + BLOCK_M - 1) // BLOCK_M
        self.tiles_per_page = page_size // BLOCK_N

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [b, rows, h_kv, 576]
        mKCache: cute.Tensor,  # [num_blocks, page, h_kv, 576]
        mBlockTable: cute.Tensor,  # [b, max_blocks] int32
        mSeqlens: cute.Tensor,  # [b] int32
        mSched: cute.Tensor,  # [num_parts, 8] int32
        mNumSplits: cute.Tensor,  # [b + 1] int32
        mOut: cute.Tensor,  # [b, s_q, h_q, 512]
        mLse: cute.Tensor,  # [b, h_q, s_q] fp32
        mOAccum: cute.Tensor,  # [b + num_parts, h_kv, rows, 512] fp32
        mLseAccum: cute.Tensor,  # [b + num_parts, h_kv, rows] fp32
        scale_log2: cutlass.Float32,
        stream,
    ):
        # (rows, 576, h_kv, b) and (page, 576, h_kv, num_blocks): feature-contiguous, as TMA wants.
        q = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[1, 3, 2, 0]))
        k = cute.make_tensor(mKCache.iterator, cute.select(mKCache.layout, mode=[1, 3, 2, 0]))

        tiled_mma_qk, mma_qk_first = [
            sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype,
                cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
                cutlass.Float32, (1, 1, 1), (BLOCK_M, HALF_N),
            )
            for _ in range(2)
        ]
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype,
            cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN,
            cutlass.Float32, (1, 1, 1), (BLOCK_M, HALF_V),
        )
        k_major = LayoutEnum.ROW_MAJOR  # K-major operand (A or B)
        mn_major = LayoutEnum.COL_MAJOR
        sQ_layout = cute.slice_(
            sm90_utils.make_smem_layout_a(k_major, (BLOCK_M, BLOCK_N, D_QK), self.dtype, 1), (None, None, 0)
        )
        sK_layout = sm90_utils.make_smem_layout_b(
            k_major, (BLOCK_M, BLOCK_N, D_QK), self.dtype, self.kv_stages
        )
        # V viewed over the same bytes: N = 576 features (only 512 used), K = 64 tokens, MN-major.
        sV_layout = sm90_utils.make_smem_layout_b(
            mn_major, (BLOCK_M, D_QK, BLOCK_N), self.dtype, self.kv_stages
        )
        sP_layout = cute.slice_(
            sm90_utils.make_smem_layout_a(k_major, (BLOCK_M, HALF_V, BLOCK_N), self.dtype, 1), (None, None, 0)
        )

        sQ_tile = sQ_layout
        sK_tile = cute.slice_(sK_layout, (None, None, 0))
        tma_atom_q, tma_q = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), q, sQ_tile, (BLOCK_M, D_QK)
        )
        tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), k, sK_tile, (BLOCK_N, D_QK)
        )
        self.q_bytes = cute.size_in_bytes(self.dtype, sQ_tile)
        self.kv_bytes = cute.size_in_bytes(self.dtype, sK_tile)

        @cute.struct
        class SharedStorage:
            q_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            kv_mbar: cute.struct.MemRange[cutlass.Int64, self.kv_stages * 2]
            row_max: cute.struct.MemRange[cutlass.Float32, 2 * BLOCK_M]
            row_sum: cute.struct.MemRange[cutlass.Float32, 2 * BLOCK_M]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sP_layout)], 1024]

        self.shared_storage = SharedStorage

        num_parts = mSched.shape[0]
        h_kv = mQ.shape[2]
        mOut = out_rows(mOut, h_kv, self.group, self.s_q)
        mLse = lse_rows(mLse, h_kv, self.group, self.s_q)
        self.kernel(
            mma_qk_first, tiled_mma_qk, tiled_mma_pv,
            tma_atom_q, tma_q, tma_atom_k, tma_k,
            mBlockTable, mSeqlens, mSched, mNumSplits,
            mOut, mLse, mOAccum, mLseAccum,
            scale_log2,
            sQ_layout, sK_layout, sV_layout, sP_layout,
        ).launch(
            grid=[num_parts, self.m_tiles, h_kv],
            block=[self.num_threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=1,
        )

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        mma_qk_first: cute.TiledMma,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        tma_atom_q: cute.CopyAtom,
        tma_q: cute.Tensor,
        tma_atom_k: cute.CopyAtom,
        tma_k: cute.Tensor,
        mBlockTable: cute.Tensor,
        mSeqlens: cute.Tensor,
        mSched: cute.Tensor,
        mNumSplits: cute.Tensor,
        mOut: cute.Tensor,
        mLse: cute.Tensor,
        mOAccum: cute.Tensor,
        mLseAccum: cute.Tensor,
        scale_log2: cutlass.Float32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        part, m_tile, kv_head = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        q_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.q_mbar.data_ptr(),
            num_stages=1,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 8),
            tx_count=self.q_bytes,
            defer_sync=True,
        )
        kv_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.kv_mbar.data_ptr(),
            num_stages=self.kv_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 8),
            tx_count=self.kv_bytes,
            defer_sync=True,
        )
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = cute.make_tensor(cute.recast_ptr(sK.iterator, sV_layout.inner), sV_layout.outer)
        sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)

        work = WorkSlice(mSched[part, 0], mSched[part, 1], mSched[part, 2], mSched[part, 3], mSched[part, 4])

        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.produce(
                    tma_atom_q, tma_q, tma_atom_k, tma_k, sQ, sK, q_pipe, kv_pipe,
                    mBlockTable, mSeqlens, m_tile, kv_head, work,
                )
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            view = self.consumer_view(mma_qk_first, tiled_mma_qk, tiled_mma_pv, sQ, sK, sV, sP, wg_idx - 1, tidx % 128)
            self.consume(
                view,
                storage.row_max.get_tensor(cute.make_layout((BLOCK_M, 2))),
                storage.row_sum.get_tensor(cute.make_layout((BLOCK_M, 2))),
                q_pipe, kv_pipe, mSeqlens,
                SplitOutputs(mNumSplits, mOut, mLse, mOAccum, mLseAccum),
                scale_log2, m_tile, kv_head, work,
            )

    # -------------------------------------------------------------- TMA producer
    @cute.jit
    def produce(
        self, tma_atom_q, tma_q, tma_atom_k, tma_k, sQ, sK, q_pipe, kv_pipe,
        mBlockTable, mSeqlens, m_tile, kv_head, work,
    ):
        # ((64, 576), m_tiles, 1, h_kv, b) and ((64, 576), page/64, 1, h_kv, num_blocks)
        gQ = cute.flat_divide(tma_q, (BLOCK_M, D_QK))
        gK = cute.flat_divide(tma_k, (BLOCK_N, D_QK))
        tQsQ, tQgQ = cpasync.tma_partition(
            tma_atom_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2)
        )
        tKsK, tKgK = cpasync.tma_partition(
            tma_atom_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2)
        )
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.kv_stages)
        for req in cutlass.range(work.begin_req, work.end_req + 1, unroll=1):
            first, last = work.blocks(req, mSeqlens[req])
            q_pipe.producer_acquire(q_state)
            cute.copy(
                tma_atom_q, tQgQ[None, m_tile, 0, kv_head, req], tQsQ,
                tma_bar_ptr=q_pipe.producer_get_barrier(q_state),
            )
            q_state.advance()
            for blk in cutlass.range(first, last, unroll=1):
                page_idx = blk // self.tiles_per_page
                tile_in_page = blk - page_idx * self.tiles_per_page
                phys = mBlockTable[req, page_idx]
                kv_pipe.producer_acquire(kv_state)
                if cutlass.const_expr(self.kv_evict_first):
                    cute.copy(
                        tma_atom_k, tKgK[None, tile_in_page, 0, kv_head, phys], tKsK[None, kv_state.index],
                        tma_bar_ptr=kv_pipe.producer_get_barrier(kv_state),
                        cache_policy=cutlass.Int64(L2_EVICT_FIRST),
                    )
                else:
                    cute.copy(
                        tma_atom_k, tKgK[None, tile_in_page, 0, kv_head, phys], tKsK[None, kv_state.index],
                        tma_bar_ptr=kv_pipe.producer_get_barrier(kv_state),
                    )
                kv_state.advance()

    # ------------------------------------------------------------- consumers
    @cute.jit
    def consumer_view(self, mma_qk_first, tiled_mma_qk, tiled_mma_pv, sQ, sK, sV, sP, wg, tid) -> "ConsumerView":
        """This thread's MMA operands: its warpgroup's 32 tokens of K and 256 columns of V."""
        mma_qk_first.set(warpgroup.Field.ACCUMULATE, False)
        tiled_mma_qk.set(warpgroup.Field.ACCUMULATE, True)
        tiled_mma_pv.set(warpgroup.Field.ACCUMULATE, True)
        thr_qk = tiled_mma_qk.get_slice(tid)
        thr_pv = tiled_mma_pv.get_slice(tid)
        sK_half = cute.local_tile(sK, (HALF_N, D_QK, self.kv_stages), (wg, 0, 0))
        sV_half = cute.local_tile(sV, (HALF_V, BLOCK_N, self.kv_stages), (wg, 0, 0))
        sP_half = cute.local_tile(sP, (BLOCK_M, HALF_N), (0, wg))
        acc_s_shape = thr_qk.partition_shape_C((BLOCK_M, HALF_N))
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
            rP=cute.make_rmem_tensor_like(thr_qk.make_fragment_C(acc_s_shape), self.dtype),
            wg=wg,
            tid=tid,
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
    def consume(self, v, sMax, sSum, q_pipe, kv_pipe, mSeqlens, outs, scale_log2, m_tile, kv_head, work):
        rows = self.row_state(m_tile, v.tid)
        bars = ConsumerBarriers(
            row_max=pipeline.NamedBarrier(barrier_id=int(BarrierId.ROW_MAX), num_threads=256),
            p_ready=pipeline.NamedBarrier(barrier_id=int(BarrierId.P_READY), num_threads=256),
            row_sum=pipeline.NamedBarrier(barrier_id=int(BarrierId.ROW_SUM), num_threads=256),
        )
        acc_s, acc_s_next, acc_o = v.acc_s, v.acc_s_next, v.acc_o
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.kv_stages)
        for req in cutlass.range(work.begin_req, work.end_req + 1, unroll=1):
            seqlen = mSeqlens[req]
            first, last = work.blocks(req, seqlen)
            acc_o.fill(0.0)
            for i in cutlass.range_constexpr(2):
                rows.row_max[i] = -cutlass.Float32.inf
                rows.row_sum[i] = 0.0
            q_pipe.consumer_wait(q_state)
            if cutlass.const_expr(self.qk_prefetch):
                # The next tile's S is issued on the tensor cores before this tile's softmax.
                # The last tile is peeled so every wait in the loop has a fixed depth.
                if first < last:
                    kv_pipe.consumer_wait(kv_state)
                    self.mma_qk(v, acc_s, kv_state.index)
                    # Settle the first S before the loop: its registers enter the loop through a
                    # copy, and copying an in-flight accumulator would serialize every WGMMA.
                    warpgroup.wait_group(0)
                    for blk in cutlass.range(first, last - 1, unroll=1):
                        next_state = kv_state.clone()
                        next_state.advance()
                        kv_pipe.consumer_wait(next_state)
                        self.mma_qk(v, acc_s_next, next_state.index)
                        warpgroup.wait_group(1)
                        self.finish_tile(v, rows, bars, sMax, seqlen, blk, kv_state.index, scale_log2)
                        kv_pipe.consumer_release(kv_state)
                        kv_state.advance()
                        acc_s.store(acc_s_next.load())
                    warpgroup.wait_group(0)
                    self.finish_tile(v, rows, bars, sMax, seqlen, last - 1, kv_state.index, scale_log2)
                    kv_pipe.consumer_release(kv_state)
                    kv_state.advance()
            else:
                for blk in cutlass.range(first, last, unroll=1):
                    kv_pipe.consumer_wait(kv_state)
                    self.mma_qk(v, acc_s, kv_state.index)
                    warpgroup.wait_group(0)
                    self.finish_tile(v, rows, bars, sMax, seqlen, blk, kv_state.index, scale_log2)
                    kv_pipe.consumer_release(kv_state)
                    kv_state.advance()
            q_pipe.consumer_release(q_state)
            q_state.advance()
            self.epilogue(v, rows, bars, sSum, outs, work, scale_log2, req, m_tile, kv_head)

    @cute.jit
    def finish_tile(self, v, rows, bars, sMax, seqlen, blk, stage, scale_log2):
        """With S of tile ``blk`` in ``v.acc_s``: softmax, P into sP, O += P V (waits for the tensor cores)."""
        self.online_softmax(v, rows, bars, sMax, seqlen, blk * BLOCK_N + v.wg * HALF_N, scale_log2)
        # Rows of the last tile past the length may hold NaN, and 0 * NaN = NaN: zero them.
        valid = seqlen - blk * BLOCK_N
        if valid < BLOCK_N:
            self.zero_tail_rows(v.sV_half, stage, valid, v.tid)
        v.rP.store(v.acc_s.load().to(self.dtype))
        cute.autovec_copy(v.rP, v.tPsP)
        cute.arch.fence_view_async_shared()
        bars.p_ready.arrive_and_wait()
        warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(v.tOrP, mode=[2])):
            cute.gemm(v.mma_pv, v.acc_o, v.tOrP[None, None, kb], v.tOrV[None, None, kb, stage], v.acc_o)
        warpgroup.commit_group()
        warpgroup.wait_group(0)

    @cute.jit
    def mma_qk(self, v, acc_s, stage):
        """Issue S = Q K_half^T over the 576 features (asynchronous: the caller waits).

        ``v.mma_qk_first`` overwrites the accumulator, ``v.mma_qk`` adds to it: two objects with
        fixed flags, because setting a flag inside staged control flow would leak the value.
        """
        warpgroup.fence()
        cute.gemm(v.mma_qk_first, acc_s, v.tSrQ[None, None, 0], v.tSrK[None, None, 0, stage], acc_s)
        for kb in cutlass.range_constexpr(1, cute.size(v.tSrQ, mode=[2])):
            cute.gemm(v.mma_qk, acc_s, v.tSrQ[None, None, kb], v.tSrK[None, None, kb, stage], acc_s)
        warpgroup.commit_group()

    @cute.jit
    def online_softmax(self, v, rows, bars, sMax, seqlen, tok0, scale_log2):
        """Mask, share the row max with the other warpgroup, turn S into P, rescale O and the sums."""
        acc_s, acc_o, wg = v.acc_s, v.acc_o, v.wg
        row_max, row_sum, row0 = rows.row_max, rows.row_sum, rows.row0
        part_max = cute.make_rmem_tensor((2,), cutlass.Float32)
        for i in cutlass.range_constexpr(2):
            part_max[i] = -cutlass.Float32.inf
        for e in cutlass.range_constexpr(cute.size(acc_s)):
            r, c = v.tScS[e]
            i = (e // 2) % 2  # accumulator value e sits in row row0 + 8 * i
            s = acc_s[e]
            if tok0 + c >= seqlen - rows.shift[i]:
                s = -cutlass.Float32.inf
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
            other = sMax[row0 + 8 * i, 1 - wg]
            new_max = cute.arch.fmax(row_max[i], cute.arch.fmax(part_max[i], other))
            safe = new_max
            if new_max == -cutlass.Float32.inf:
                safe = 0.0
            base[i] = safe * scale_log2
            alpha[i] = cute.math.exp2(row_max[i] * scale_log2 - base[i], fastmath=True)
            row_max[i] = new_max
            row_sum[i] = row_sum[i] * alpha[i]
        for e in cutlass.range_constexpr(cute.size(acc_s)):
            i = (e // 2) % 2
            p = cute.math.exp2(acc_s[e] * scale_log2 - base[i], fastmath=True)
            acc_s[e] = p
            row_sum[i] = row_sum[i] + p
        # Once the row maxima settle, alpha is 1: skip the 128 multiplies.
        if cutlass.min(alpha[0], alpha[1]) != 1.0:
            for e in cutlass.range_constexpr(cute.size(acc_o)):
                acc_o[e] = acc_o[e] * alpha[(e // 2) % 2]

    @cute.jit
    def zero_tail_rows(self, sV_half, stage, valid, tid):
        """Zero V rows (tokens) >= valid in this warpgroup's 256 columns of the stage."""
        n = (BLOCK_N - valid) * HALF_V
        for idx in cutlass.range(tid, n, 128, unroll=1):
            tok = valid + idx // HALF_V
            col = idx % HALF_V
            sV_half[col, tok, stage] = self.dtype(0.0)

    @cute.jit
    def epilogue(self, v, rows, bars, sSum, outs, work, scale_log2, req, m_tile, kv_head):
        """Normalise and write this request's rows: final output, or an fp32 partial."""
        acc_o, wg, tid, row0 = v.acc_o, v.wg, v.tid, rows.row0
        row_sum = rows.row_sum
        for i in cutlass.range_constexpr(2):
            row_sum[i] = cute.arch.warp_reduction_sum(row_sum[i], threads_in_group=4)
            if tid % 4 == 0:
                sSum[row0 + 8 * i, wg] = row_sum[i]
        bars.row_sum.arrive_and_wait()
        inv = cute.make_rmem_tensor((2,), cutlass.Float32)
        lse2 = cute.make_rmem_tensor((2,), cutlass.Float32)
        for i in cutlass.range_constexpr(2):
            total = row_sum[i] + sSum[row0 + 8 * i, 1 - wg]
            inv[i] = 0.0
            lse2[i] = -cutlass.Float32.inf
            if total > 0.0:
                inv[i] = 1.0 / total
                lse2[i] = rows.row_max[i] * scale_log2 + cute.math.log2(total, fastmath=False)
        # Both warpgroups read sSum above; the next request's writes come after later barriers.

        n_splits = outs.num_splits[req + 1] - outs.num_splits[req]
        row_base = m_tile * BLOCK_M
        col_base = wg * HALF_V
        if n_splits == 1:
            for e in cutlass.range_constexpr(cute.size(acc_o)):
                r, c = v.tOcO[e]
                i = 0 if (e // 2) % 2 == 0 else 1
                if row_base + r < self.rows:
                    outs.out[req, kv_head, row_base + r, col_base + c] = (acc_o[e] * inv[i]).to(self.dtype)
            if wg == 0 and tid % 4 == 0:
                for i in cutlass.range_constexpr(2):
                    r = row_base + row0 + 8 * i
                    if r < self.rows:
                        lse = cutlass.Float32.inf
                        if lse2[i] != -cutlass.Float32.inf:
                            lse = lse2[i] * LN_2
                        outs.lse[req, kv_head, r] = lse
        else:
            split = outs.num_splits[req]
            if req == work.begin_req:
                split = split + work.begin_split
            for e in cutlass.range_constexpr(cute.size(acc_o)):
                r, c = v.tOcO[e]
                i = 0 if (e // 2) % 2 == 0 else 1
                if row_base + r < self.rows:
                    outs.o_accum[split, kv_head, row_base + r, col_base + c] = acc_o[e] * inv[i]
            if wg == 0 and tid % 4 == 0:
                for i in cutlass.range_constexpr(2):
                    r = row_base + row0 + 8 * i
                    if r < self.rows:
                        outs.lse_accum[split, kv_head, r] = lse2[i]


# ---------------------------------------------------------------- device-side records
# Plain containers: their fields are set once and never rebound inside staged control flow
# (register tensors are updated in place), so the DSL tracer sees through them.


@dataclasses.dataclass
class WorkSlice:
    """This CTA's share of the batch, from its scheduler record."""

    begin_req: Any
    end_req: Any
    begin_block: Any
    end_block: Any
    begin_split: Any

    @cute.jit
    def blocks(self, req, seqlen):
        """KV tiles [first, last) of request ``req`` that this CTA serves."""
        first = cutlass.Int32(0)
        if req == self.begin_req:
            first = self.begin_block
        last = (seqlen + BLOCK_N - 1) // BLOCK_N
        if req == self.end_req:
            last = self.end_block
        return first, last


@dataclasses.dataclass
class SplitOutputs:
    """Where results go: final out/lse (FlashMLA layouts seen per KV head) or fp32 partials."""

    num_splits: Any
    out: Any
    lse: Any
    o_accum: Any
    lse_accum: Any


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


@dataclasses.dataclass
class RowState:
    """The thread's two query rows (row0, row0 + 8): running max and sum, causal shift."""

    row0: Any
    row_max: Any
    row_sum: Any
    shift: Any


@dataclasses.dataclass
class ConsumerBarriers:
    row_max: Any
    p_ready: Any
    row_sum: Any
