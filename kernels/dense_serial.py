"""Dense MLA decode over a paged cache, split-KV, on Hopper (SM90a): the serial kernel, every step of a tile
waiting for the previous one.  No resolver picks it; it is kept as the baseline that the seesaw kernel
(``dense_seesaw.py``) is measured against (``benchmarks/experiments.py``).

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
  sKV   2 x 64 x 576                  73 728 each (V is the first 512 columns of K)
  sP    64 x 64                          8 192
  sMax, sSum  [2][64] fp32               1 024
  mbarriers: Q full/empty, KV full/empty per stage
All 16-bit tiles use the 128-byte swizzle; K and V share one buffer because the
K-major (token x feature) and MN-major (feature x token) swizzled layouts place
every element at the same byte.

Named barriers: ``barriers.SerialBarrier``.

Output: requests served whole write ``out [b, s_q, h_q, 512]`` (q dtype) and
``lse [b, h_q, s_q]`` (natural log) in place (``layouts.py``); pieces of a split request
write fp32 partials normalised by their own sum, with a base-2 lse, to
``o_accum[num_splits[req] + split_idx]`` for the combine kernel.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.memory import SmemAllocator
from cutlass.cute.nvgpu import cpasync, warpgroup

from ..schedules.configs import DenseSplitConfig
from .constants import BLOCK_M, BLOCK_N, D_QK, DTYPES, HALF_N, L2_EVICT_FIRST
from .layouts import lse_rows, make_q_pipeline, make_smem_layouts, operand_tiles, out_rows, row_exchange
from .serial_consumer import SplitKVConsumer, make_consumer_mmas
from .softmax import LengthMask
from .work import OutputTile, SplitOutputs, WorkSlice, load_splits




def set_dense_facts(kernel, config: DenseSplitConfig) -> None:
    """The static facts both dense decode kernels (this one and ``dense_seesaw.py``) compile from."""
    if config.page % BLOCK_N != 0:
        raise NotImplementedError(f"page_block_size {config.page}: the kernel needs a multiple of {BLOCK_N}")
    kernel.dtype = DTYPES[config.dtype]
    kernel.rows = config.rows  # s_q * group query rows per KV head
    kernel.group = config.group  # h_q / h_kv
    kernel.s_q = config.s_q
    kernel.causal = config.causal
    kernel.page_size = config.page
    kernel.m_tiles = config.m_tiles
    kernel.tiles_per_page = config.page // BLOCK_N


def feature_major(mQ: cute.Tensor, mKCache: cute.Tensor):
    """q (rows, 576, h_kv, b) and the cache (page, 576, h_kv, num_blocks): feature-contiguous, as TMA wants."""
    q = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[1, 3, 2, 0]))
    k = cute.make_tensor(mKCache.iterator, cute.select(mKCache.layout, mode=[1, 3, 2, 0]))
    return q, k


class DenseSerialKernel(SplitKVConsumer):
    """The serial dense decode kernel: the baseline the seesaw kernel is measured against."""

    num_threads = 384
    producer_regs = 40
    consumer_regs = 232

    kv_stages = 2

    def __init__(self, config: DenseSplitConfig):
        if config.kernel != "serial" or config.cluster_ctas != 1:
            raise ValueError(f"DenseSerialKernel takes configs of kernel 'serial' without clusters, got {config}")
        set_dense_facts(self, config)
        self.kv_evict_first = config.evict_first

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
        q, k = feature_major(mQ, mKCache)

        mma_qk_first, tiled_mma_qk, tiled_mma_pv = make_consumer_mmas(self.dtype)
        sQ_layout, sK_layout, sV_layout, sP_layout = make_smem_layouts(self.dtype, self.kv_stages)

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
        q_pipe = make_q_pipeline(storage, self.q_bytes)
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

        sQ, sK, sV, sP = operand_tiles(storage, sQ_layout, sK_layout, sV_layout, sP_layout)
        work = WorkSlice.of(mSched, part, mBlockTable.shape[1] * self.page_size)

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
                *row_exchange(storage),
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
            first, last = work.blocks(req, work.length(mSeqlens[req]))
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
    def consume(self, v, sMax, sSum, q_pipe, kv_pipe, mSeqlens, outs, scale_log2, m_tile, kv_head, work):
        rows = self.row_state(m_tile, v.tid)
        bars = self.consumer_barriers()
        acc_s = v.acc_s
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.kv_stages)
        for req in cutlass.range(work.begin_req, work.end_req + 1, unroll=1):
            seqlen = work.length(mSeqlens[req])
            splits = load_splits(outs, req)
            first, last = work.blocks(req, seqlen)
            self.start_rows(v, rows)
            q_pipe.consumer_wait(q_state)
            for blk in cutlass.range(first, last, unroll=1):
                kv_pipe.consumer_wait(kv_state)
                self.mma_qk(v, acc_s, kv_state.index)
                warpgroup.wait_group(0)
                self.finish_tile(v, rows, bars, sMax, seqlen, blk, kv_state.index, scale_log2)
                kv_pipe.consumer_release(kv_state)
                kv_state.advance()
            q_pipe.consumer_release(q_state)
            q_state.advance()
            tile = OutputTile(kv_head, m_tile * BLOCK_M, self.rows - m_tile * BLOCK_M)
            self.epilogue(v, rows, bars, sSum, outs, work, scale_log2, req, tile, splits)

    @cute.jit
    def finish_tile(self, v, rows, bars, sMax, seqlen, blk, stage, scale_log2):
        """With S of tile ``blk`` in ``v.acc_s``: softmax, P into sP, O += P V (waits for the tensor cores)."""
        limit = cute.make_rmem_tensor((2,), cutlass.Int32)
        for i in cutlass.range_constexpr(2):
            limit[i] = seqlen - rows.shift[i] - (blk * BLOCK_N + v.wg * HALF_N)
        self.online_softmax(v, rows, bars, sMax, LengthMask(limit), scale_log2)
        # Rows of the last tile past the length may hold NaN, and 0 * NaN = NaN: zero them.
        valid = seqlen - blk * BLOCK_N
        if valid < BLOCK_N:
            self.zero_tail_rows(v.sV_half, stage, valid, v.tid)
        self.mma_pv(v, bars, stage)
