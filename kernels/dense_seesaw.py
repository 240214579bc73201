"""Dense MLA decode over a paged cache, split-KV, seesaw schedule, on Hopper (SM90a).

Same work split, inputs and outputs as ``dense_decode.py`` (one CTA per SM part, 64-row M tile
and KV head; the scheduler record gives its requests and blocks).  What differs is how the two
warpgroups share a 64-token tile pair (K0 in buffer 0, K1 in buffer 1): the 64 x 512 output is
split into O_L (columns 0-255, warpgroup 0) and O_R (256-511, warpgroup 1), and

  WG0: S0 = Q K0^T; new max m0; P0; O_L = O_L * a + P0 V0_L (P0 from registers)
  WG1: S1 = Q K1^T (at the same time);     after m0: new max m1; P1; O_R = O_R * a + P1 V1_R
  WG0: P0 rescaled to m1 into sP0;          WG1: P1 into sP1
  WG0: O_L = O_L * a + P1 V1_L (P1 from sP1)   WG1: O_R += P0 V0_R (P0 from sP0)

so one warpgroup's softmax runs while the other's tensor cores work.  There is no producer
warpgroup: the warpgroup that frees a part of a buffer issues the TMA copy that refills it.
Each 64 x 576 tile arrives as nine 64 x 64 sub-tiles, each with its own mbarrier, and S = Q K^T
consumes sub-tile j as soon as it lands:
  K0 sub-tiles 0-3 (V0_L) refill after WG0's P0 V0_L; 4-8 after WG1's P0 V0_R;
  K1 sub-tiles 0-3 (V1_L) refill after WG0's P1 V1_L; 4-8 after WG1's P1 V1_R.

Warpgroup roles (256 threads, one CTA per SM, no register reallocation):
  WG0  S of the even tiles, O_L.  Its warp 0 issues each request's Q copy and first tile pair,
       and the refills of sub-tiles 0-3.
  WG1  S of the odd tiles, O_R.  Its warp 0 issues the refills of sub-tiles 4-8.

Shared-memory plan (16-bit q/cache; bytes):
  sQ      64 x 576                        73 728  (its last 64 x 64 sub-tile, the RoPE part of Q,
                                                   is held in registers once Q lands and the
                                                   bytes serve as sP1)
  sK      2 x 64 x 576                   147 456  (V is the first 512 columns of K)
  sP0     64 x 64                          8 192
  sM, sScale, sSum  3 x [64][2] fp32       1 536  (row max in log2 units in sM[:, 0]; the rescale
                                                   factors of WG0 and WG1; the epilogue's sums)
  mbarriers: Q; K sub-tiles [2][9]           160
About 226 KiB of the 227 KiB a CTA may have (``DenseDecodeSchedule.smem_bytes``).

Causal: the tiles no row of the M tile sees are skipped; the scores past a row's end are masked
only in a request's last two tiles (the rows of an M tile end less than 64 keys apart).

Named barriers (``SeesawBarrier``): SCALE0 (WG0 -> WG1: m0 and sScale0 written), SCALE1
(WG1 -> WG0: m1 and sScale1 written), P0_READY (WG0 -> WG1: sP0 written), P1_ISSUED
(WG1 -> WG0: sP1 written, and P0 V0_R issued), ROW_SUM (both: the epilogue's sums), MAX_INIT
(WG0 only: sM reset for a request).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from ..schedules.dense import DenseDecodeSchedule
from .consumer import (
    BLOCK_M,
    BLOCK_N,
    D_QK,
    HALF_V,
    ConsumerBarriers,
    LengthMask,
    OutputTile,
    SplitKVConsumer,
    SplitOutputs,
    WorkSlice,
    make_smem_layouts,
    operand_tiles,
    row_exchange,
)
from .layouts import lse_rows, out_rows

SUB = 64  # features per K sub-tile (one 128-byte swizzle atom wide)
NUM_SUB = D_QK // SUB  # 9 sub-tiles per tile; sub-tile 8 is the RoPE part
ROPE_SUB = NUM_SUB - 1
KB_PER_SUB = SUB // 16  # WGMMA k-blocks per sub-tile
# L2 cache-policy operand of a TMA load marking the lines evict-first (each tile is read once).
L2_EVICT_FIRST = 0x12F0000000000000


class SeesawBarrier(enum.IntEnum):
    """Named hardware barriers (0 is __syncthreads)."""

    SCALE0 = 1
    SCALE1 = 2
    P0_READY = 3
    P1_ISSUED = 4
    ROW_SUM = 5
    MAX_INIT = 6


class DenseSeesawKernel(SplitKVConsumer):
    """Static configuration of one compiled seesaw dense decode kernel."""

    num_threads = 256
    kv_stages = 2  # the tile pair

    def __init__(self, dtype, rows: int, group: int, s_q: int, causal: bool, page_size: int,
                 schedule: DenseDecodeSchedule):
        if page_size % BLOCK_N != 0:
            raise NotImplementedError(f"page_block_size {page_size}: the kernel needs a multiple of {BLOCK_N}")
        schedule.validate()
        if not schedule.seesaw:
            raise ValueError("DenseSeesawKernel needs a schedule with seesaw=True")
        self.dtype = dtype
        self.rows = rows
        self.group = group
        self.s_q = s_q
        self.causal = causal
        self.page_size = page_size
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
        q = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[1, 3, 2, 0]))
        k = cute.make_tensor(mKCache.iterator, cute.select(mKCache.layout, mode=[1, 3, 2, 0]))

        sQ_layout, sK_layout, sV_layout, sP_layout = make_smem_layouts(self.dtype, self.kv_stages)
        sub_layout = cute.slice_(
            sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (BLOCK_M, BLOCK_N, SUB), self.dtype, 1),
            (None, None, 0),
        )
        tma_atom_q, tma_q = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), q, sQ_layout, (BLOCK_M, D_QK))
        tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), k, sub_layout, (BLOCK_N, SUB))
        self.q_bytes = cute.size_in_bytes(self.dtype, sQ_layout)
        self.sub_bytes = cute.size_in_bytes(self.dtype, sub_layout)

        @cute.struct
        class SharedStorage:
            q_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            kv_mbar: cute.struct.MemRange[cutlass.Int64, 2 * NUM_SUB]
            row_max: cute.struct.MemRange[cutlass.Float32, 2 * BLOCK_M]  # row_exchange's pair; [:, 0] is sM
            row_sum: cute.struct.MemRange[cutlass.Float32, 2 * BLOCK_M]
            scale: cute.struct.MemRange[cutlass.Float32, 2 * BLOCK_M]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sP_layout)], 1024]

        self.shared_storage = SharedStorage

        num_parts = mSched.shape[0]
        h_kv = mQ.shape[2]
        mOut = out_rows(mOut, h_kv, self.group, self.s_q)
        mLse = lse_rows(mLse, h_kv, self.group, self.s_q)
        self.kernel(
            tma_atom_q, tma_q, tma_atom_k, tma_k,
            mBlockTable, mSeqlens, mSched, mNumSplits, mOut, mLse, mOAccum, mLseAccum,
            scale_log2, sQ_layout, sK_layout, sV_layout, sP_layout,
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
        wg = cute.arch.make_warp_uniform(tidx // 128)

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        q_bar = storage.q_mbar.data_ptr()
        kv_bar = storage.kv_mbar.data_ptr()
        if tidx == 0:
            cute.arch.mbarrier_init(q_bar, 1)
            for j in cutlass.range_constexpr(2 * NUM_SUB):
                cute.arch.mbarrier_init(kv_bar + j, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        # The warpgroup is a compile-time fact of each branch, so each gets its own code.  Every
        # record is built inside its branch: a branch may rebind what it uses.
        if wg == 0:
            self.run_warpgroup(
                0, storage, tma_atom_q, tma_q, tma_atom_k, tma_k, mBlockTable, mSeqlens, mSched, mNumSplits,
                mOut, mLse, mOAccum, mLseAccum, scale_log2, sQ_layout, sK_layout, sV_layout, sP_layout,
            )
        else:
            self.run_warpgroup(
                1, storage, tma_atom_q, tma_q, tma_atom_k, tma_k, mBlockTable, mSeqlens, mSched, mNumSplits,
                mOut, mLse, mOAccum, mLseAccum, scale_log2, sQ_layout, sK_layout, sV_layout, sP_layout,
            )

    @cute.jit
    def run_warpgroup(
        self, wg: cutlass.Constexpr, storage, tma_atom_q, tma_q, tma_atom_k, tma_k, mBlockTable, mSeqlens,
        mSched, mNumSplits, mOut, mLse, mOAccum, mLseAccum, scale_log2, sQ_layout, sK_layout, sV_layout,
        sP_layout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        part, m_tile, kv_head = cute.arch.block_idx()
        sQ, sK, sV, sP0 = operand_tiles(storage, sQ_layout, sK_layout, sV_layout, sP_layout)
        sMax, sSum = row_exchange(storage)
        sScale = storage.scale.get_tensor(cute.make_layout((BLOCK_M, 2)))
        q_bar = storage.q_mbar.data_ptr()
        kv_bar = storage.kv_mbar.data_ptr()
        loader = TileLoader.make(tma_atom_q, tma_q, tma_atom_k, tma_k, sQ, sK, q_bar, kv_bar,
                                 mBlockTable, m_tile, kv_head)
        outs = SplitOutputs(mNumSplits, mOut, mLse, mOAccum, mLseAccum)
        view = self.seesaw_view(make_seesaw_mmas(self.dtype), sQ, sK, sV, sP0, kv_bar, wg, tidx % 128)
        self.serve(view, sMax, sScale, sSum, loader, mSeqlens, WorkSlice.of(mSched, part), outs, scale_log2,
                   m_tile, kv_head, tidx, wg)

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

    # ------------------------------------------------------------- request loop
    @cute.jit
    def serve(self, v, sM, sScale, sSum, loader, mSeqlens, work, outs, scale_log2, m_tile, kv_head, tidx,
              wg: cutlass.Constexpr):
        rows = self.row_state(m_tile, v.tid)
        bars = SeesawBarriers.make()
        q_phase = cute.make_rmem_tensor((1,), cutlass.Int32)
        q_phase[0] = 0
        v.kphase[0] = 0
        # Causal: the tile's last row sees the most keys; blocks past them are skipped.
        common_shift = 0
        if cutlass.const_expr(self.causal):
            last_row = cutlass.min(m_tile * BLOCK_M + BLOCK_M - 1, self.rows - 1)
            common_shift = self.s_q - 1 - last_row // self.group
        for req in cutlass.range(work.begin_req, work.end_req + 1, unroll=1):
            seqlen = mSeqlens[req]
            first, last = work.blocks(req, seqlen)
            if cutlass.const_expr(self.causal):
                last = cutlass.min(last, (seqlen - common_shift + BLOCK_N - 1) // BLOCK_N)
            n = last - first
            if tidx < 32:
                self.load_q(loader, req)
                if n >= 1:
                    self.load_kv(loader, self.tile_location(loader, req, first), 0, 0, NUM_SUB)
                if n >= 2:
                    loc = self.tile_location(loader, req, first + 1)
                    self.load_kv(loader, loc, 1, 4, NUM_SUB)
                    self.load_kv(loader, loc, 1, 0, 4)
            self.start_request(v, rows, sM, sScale, loader, q_phase, tidx)
            # No dynamic branch may enclose the pair loops: a loop inside one would rebind the
            # records it carries in a region their later users cannot see.
            if cutlass.const_expr(wg == 0):
                bars.max_init.arrive_and_wait()
                self.wg0_request(v, rows, sM, sScale, bars, loader, req, first, last, seqlen, scale_log2)
            else:
                self.wg1_request(v, rows, sM, sScale, bars, loader, req, first, last, seqlen, scale_log2)
            max2 = self.final_max(rows, sM)
            tile = OutputTile(kv_head, m_tile * BLOCK_M, self.rows - m_tile * BLOCK_M)
            self.epilogue(v, rows, bars.epilogue, sSum, outs, work, scale_log2, req, tile, max2=max2)

    @cute.jit
    def start_request(self, v, rows, sM, sScale, loader, q_phase, tidx):
        """Reset O, the sums and the shared row max; wait for Q and keep its RoPE part in registers
        (its shared-memory bytes then serve as sP1)."""
        v.acc_o.fill(0.0)
        for i in cutlass.range_constexpr(2):
            rows.row_sum[i] = 0.0
        if tidx < BLOCK_M:
            sM[tidx, 0] = -cutlass.Float32.inf
        cute.arch.mbarrier_wait(loader.q_bar, q_phase[0])
        q_phase[0] = q_phase[0] ^ 1
        cute.autovec_copy(v.tSsQ_rope, v.rQ_rope)

    @cute.jit
    def final_max(self, rows, sM):
        """The rows' max in log2 units, read before the epilogue's barrier (WG0 resets it after)."""
        max2 = cute.make_rmem_tensor((2,), cutlass.Float32)
        for i in cutlass.range_constexpr(2):
            max2[i] = sM[rows.row0 + 8 * i, 0]
        return max2

    @cute.jit
    def wg0_request(self, v, rows, sM, sScale, bars, loader, req, first, last, seqlen, scale_log2):
        """Warpgroup 0's tiles of one request (none when last <= first)."""
        n = last - first
        if n >= 1:
            self.issue_qk(v, 0, tuple(range(NUM_SUB)))
            warpgroup.wait_group(0)
        pairs = cutlass.max(n - 1, 0) // 2
        for p in cutlass.range(pairs, unroll=1):
            self.wg0_pair(v, rows, sM, sScale, bars, loader, req, first + 2 * p, last, seqlen, scale_log2, False, False)
        blk = first + 2 * pairs
        if blk + 1 < last:
            self.wg0_pair(v, rows, sM, sScale, bars, loader, req, blk, last, seqlen, scale_log2, False, True)
        elif blk < last:
            self.wg0_pair(v, rows, sM, sScale, bars, loader, req, blk, last, seqlen, scale_log2, True, False)

    @cute.jit
    def wg1_request(self, v, rows, sM, sScale, bars, loader, req, first, last, seqlen, scale_log2):
        """Warpgroup 1's tiles of one request (none when last <= first)."""
        n = last - first
        if n >= 2:
            self.issue_qk(v, 1, (4, 5, 6, 7, 8, 0, 1, 2, 3))
            warpgroup.wait_group(0)
        pairs = cutlass.max(n - 2, 0) // 2
        for p in cutlass.range(pairs, unroll=1):
            self.wg1_pair(v, rows, sM, sScale, bars, loader, req, first + 2 * p, last, seqlen, scale_log2, False, False, False)
        blk = first + 2 * pairs
        if blk + 2 < last:
            self.wg1_pair(v, rows, sM, sScale, bars, loader, req, blk, last, seqlen, scale_log2, False, False, True)
            self.wg1_pair(v, rows, sM, sScale, bars, loader, req, blk + 2, last, seqlen, scale_log2, True, False, False)
        elif blk + 1 < last:
            self.wg1_pair(v, rows, sM, sScale, bars, loader, req, blk, last, seqlen, scale_log2, False, True, False)
        elif blk < last:
            self.wg1_pair(v, rows, sM, sScale, bars, loader, req, blk, last, seqlen, scale_log2, True, False, False)

    # ----------------------------------------------------------- one tile pair
    @cute.jit
    def wg0_pair(self, v, rows, sM, sScale, bars, loader, req, blk, last, seqlen, scale_log2,
                 blk0_last: cutlass.Constexpr, blk1_last: cutlass.Constexpr):
        """Tiles blk (buffer 0) and blk + 1 (buffer 1), warpgroup 0's side; leaves S of blk + 2."""
        if cutlass.const_expr(not blk0_last and not blk1_last):
            loc2 = self.tile_location(loader, req, blk + 2)
            loc3 = self.tile_location(loader, req, cutlass.min(blk + 3, last - 1))
        self.softmax_wg0(v, rows, sM, sScale, seqlen, blk, scale_log2, blk0_last or blk1_last)
        bars.scale0.arrive()
        if cutlass.const_expr(blk0_last):
            self.zero_tail_v(v, 0, seqlen - blk * BLOCK_N)
        self.issue_pv_local(v, 0)
        warpgroup.wait_group(0)

        bars.scale1.arrive_and_wait()
        if cutlass.const_expr(not blk0_last and not blk1_last):
            if v.tid < 32:
                self.load_kv(loader, loc2, 0, 0, 4)
        # P0 to the final max of the pair, for warpgroup 1's P0 V0_R.
        scale1 = cute.make_rmem_tensor((2,), cutlass.Float32)
        for i in cutlass.range_constexpr(2):
            scale1[i] = sScale[rows.row0 + 8 * i, 1]
        for e in cutlass.range_constexpr(cute.size(v.acc_s)):
            v.acc_s[e] = v.acc_s[e] * scale1[(e // 2) % 2]
        v.rPc.store(v.acc_s.load().to(self.dtype))
        cute.autovec_copy(v.rPc, v.tPsP0)
        cute.arch.fence_view_async_shared()
        bars.p0_ready.arrive()

        if cutlass.const_expr(not blk0_last):
            if cutlass.const_expr(blk1_last):
                self.zero_tail_v(v, 1, seqlen - (blk + 1) * BLOCK_N)
            bars.p1_issued.arrive_and_wait()
            for i in cutlass.range_constexpr(2):
                rows.row_sum[i] = rows.row_sum[i] * scale1[i]
            for e in cutlass.range_constexpr(cute.size(v.acc_o)):
                v.acc_o[e] = v.acc_o[e] * scale1[(e // 2) % 2]
            self.issue_pv_shared(v, v.tOrP1, 1)
        if cutlass.const_expr(not blk0_last and not blk1_last):
            # S of blk + 2: its first four sub-tiles were refilled first (above).
            self.issue_qk(v, 0, (0, 1, 2, 3), flip=False)
            warpgroup.wait_group(4)
            if v.tid < 32 and blk + 3 < last:
                self.load_kv(loader, loc3, 1, 0, 4)
            self.issue_qk(v, 0, (4, 5, 6, 7, 8), accumulate=True)
        warpgroup.wait_group(0)

    @cute.jit
    def wg1_pair(self, v, rows, sM, sScale, bars, loader, req, blk, last, seqlen, scale_log2,
                 blk0_last: cutlass.Constexpr, blk1_last: cutlass.Constexpr, blk2_last: cutlass.Constexpr):
        """Tiles blk and blk + 1, warpgroup 1's side; leaves S of blk + 3."""
        if cutlass.const_expr(not blk0_last and not blk1_last):
            loc2 = self.tile_location(loader, req, blk + 2)
        if cutlass.const_expr(not blk0_last and not blk1_last and not blk2_last):
            loc3 = self.tile_location(loader, req, blk + 3)
        bars.scale0.arrive_and_wait()
        self.softmax_wg1(v, rows, sM, sScale, seqlen, blk + 1, scale_log2, blk1_last or blk2_last, blk0_last)
        bars.scale1.arrive()
        if cutlass.const_expr(not blk0_last):
            cute.autovec_copy(v.rPc, v.tPsP1)
            if cutlass.const_expr(blk1_last):
                self.zero_tail_v(v, 1, seqlen - (blk + 1) * BLOCK_N)
            cute.arch.fence_view_async_shared()
            self.issue_pv_local(v, 1)

        bars.p0_ready.arrive_and_wait()
        if cutlass.const_expr(blk0_last):
            self.zero_tail_v(v, 0, seqlen - blk * BLOCK_N)
        self.issue_pv_shared(v, v.tOrP0, 0)
        if cutlass.const_expr(not blk0_last):
            bars.p1_issued.arrive()
        if cutlass.const_expr(not blk0_last and not blk1_last and not blk2_last):
            warpgroup.wait_group(1)
            if v.tid < 32:
                self.load_kv(loader, loc3, 1, 4, NUM_SUB)
        if cutlass.const_expr(not blk0_last and not blk1_last):
            warpgroup.wait_group(0)
            if v.tid < 32:
                self.load_kv(loader, loc2, 0, 4, NUM_SUB)
        if cutlass.const_expr(not blk0_last and not blk1_last and not blk2_last):
            self.issue_qk(v, 1, (4, 5, 6, 7, 8, 0, 1, 2, 3))
        warpgroup.wait_group(0)

    # ------------------------------------------------------------- TMA loads
    @cute.jit
    def load_q(self, ld, req):
        """Called by a whole warp: the TMA copy elects its own thread, the expectation one."""
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(ld.q_bar, self.q_bytes)
        cute.copy(ld.tma_atom_q, ld.tQgQ[None, ld.m_tile, 0, ld.kv_head, req], ld.tQsQ, tma_bar_ptr=ld.q_bar)

    @cute.jit
    def tile_location(self, ld, req, blk):
        """(tile within its page, physical page) of tile ``blk``: read from the block table ahead of
        the copy, so the copying warp does not wait for it."""
        page_idx = blk // self.tiles_per_page
        return blk - page_idx * self.tiles_per_page, ld.block_table[req, page_idx]

    @cute.jit
    def load_kv(self, ld, loc, buf: cutlass.Constexpr, lo: cutlass.Constexpr, hi: cutlass.Constexpr):
        """Sub-tiles [lo, hi) of the tile at ``loc`` into buffer ``buf`` (by a whole warp)."""
        tile_in_page, phys = loc
        for j in cutlass.range_constexpr(lo, hi):
            bar = ld.kv_bar + (buf * NUM_SUB + j)
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(bar, self.sub_bytes)
            src = ld.tKgK[None, tile_in_page, j, ld.kv_head, phys]
            dst = ld.tKsK[None, 0, j, buf]
            if cutlass.const_expr(self.kv_evict_first):
                cute.copy(ld.tma_atom_k, src, dst, tma_bar_ptr=bar, cache_policy=cutlass.Int64(L2_EVICT_FIRST))
            else:
                cute.copy(ld.tma_atom_k, src, dst, tma_bar_ptr=bar)

    # ------------------------------------------------------------- the pieces
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
    def issue_pv_local(self, v, buf: cutlass.Constexpr):
        """O += P V_half(buf) with P (this warpgroup's, 16-bit) from registers."""
        warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(v.rPa, mode=[2])):
            cute.gemm(v.mmas.pv_rs, v.acc_o, v.rPa[None, None, kb], v.tOrV_rs[None, None, kb, buf], v.acc_o)
        warpgroup.commit_group()

    @cute.jit
    def issue_pv_shared(self, v, tOrP, buf: cutlass.Constexpr):
        """O += P V_half(buf) with the other warpgroup's P from shared memory."""
        warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
            cute.gemm(v.mmas.pv_ss, v.acc_o, tOrP[None, None, kb], v.tOrV_ss[None, None, kb, buf], v.acc_o)
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
    def softmax_wg0(self, v, rows, sM, sScale, seqlen, blk, scale_log2, masked: cutlass.Constexpr):
        """S0 -> P0 against m0 = max(m, rowmax S0); publishes m0 and 2^(m - m0); rescales O_L."""
        cur = self.row_maxima(v, rows, seqlen, blk, scale_log2, masked)
        alpha = cute.make_rmem_tensor((2,), cutlass.Float32)
        base = cute.make_rmem_tensor((2,), cutlass.Float32)
        new_max = cute.make_rmem_tensor((2,), cutlass.Float32)
        for i in cutlass.range_constexpr(2):
            old = sM[rows.row0 + 8 * i, 0]
            new_max[i] = cute.arch.fmax(old, cur[i])
            alpha[i], base[i] = rescale_pair(old, new_max[i])
        cute.arch.sync_warp()  # every thread of the row read the old max before it changes
        if v.tid % 4 == 0:
            for i in cutlass.range_constexpr(2):
                sScale[rows.row0 + 8 * i, 0] = alpha[i]
                sM[rows.row0 + 8 * i, 0] = new_max[i]
        acc_o = v.acc_o  # a local: stores through a record's attribute inside a branch would rebind it
        if cutlass.min(alpha[0], alpha[1]) != 1.0:
            for e in cutlass.range_constexpr(cute.size(acc_o)):
                acc_o[e] = acc_o[e] * alpha[(e // 2) % 2]
        part = self.exp_rows(v, base, scale_log2)
        for i in cutlass.range_constexpr(2):
            rows.row_sum[i] = rows.row_sum[i] * alpha[i] + part[i]
        v.rPc.store(v.acc_s.load().to(self.dtype))

    @cute.jit
    def softmax_wg1(self, v, rows, sM, sScale, seqlen, blk, scale_log2, masked: cutlass.Constexpr, empty: cutlass.Constexpr):
        """S1 -> P1 against m1 = max(m0, rowmax S1); publishes m1 and 2^(m0 - m1); rescales O_R
        from the previous pair's max to m1.  ``empty``: there is no tile blk (P1 = 0)."""
        cur = cute.make_rmem_tensor((2,), cutlass.Float32)
        if cutlass.const_expr(empty):
            for i in cutlass.range_constexpr(2):
                cur[i] = -cutlass.Float32.inf
        else:
            cur = self.row_maxima(v, rows, seqlen, blk, scale_log2, masked)
        alpha = cute.make_rmem_tensor((2,), cutlass.Float32)
        base = cute.make_rmem_tensor((2,), cutlass.Float32)
        new_max = cute.make_rmem_tensor((2,), cutlass.Float32)
        total = cute.make_rmem_tensor((2,), cutlass.Float32)
        for i in cutlass.range_constexpr(2):
            old = sM[rows.row0 + 8 * i, 0]
            new_max[i] = cute.arch.fmax(old, cur[i])
            alpha[i], base[i] = rescale_pair(old, new_max[i])
            total[i] = alpha[i] * sScale[rows.row0 + 8 * i, 0]
        cute.arch.sync_warp()
        if v.tid % 4 == 0:
            for i in cutlass.range_constexpr(2):
                sScale[rows.row0 + 8 * i, 1] = alpha[i]
                sM[rows.row0 + 8 * i, 0] = new_max[i]
        acc_o = v.acc_o
        if cutlass.min(total[0], total[1]) != 1.0:
            for e in cutlass.range_constexpr(cute.size(acc_o)):
                acc_o[e] = acc_o[e] * total[(e // 2) % 2]
        if cutlass.const_expr(empty):
            for i in cutlass.range_constexpr(2):
                rows.row_sum[i] = rows.row_sum[i] * total[i]
        else:
            part = self.exp_rows(v, base, scale_log2)
            for i in cutlass.range_constexpr(2):
                rows.row_sum[i] = rows.row_sum[i] * total[i] + part[i]
            v.rPc.store(v.acc_s.load().to(self.dtype))

    @cute.jit
    def zero_tail_v(self, v, buf: cutlass.Constexpr, valid):
        """Zero this warpgroup's V rows (tokens) >= valid of buffer ``buf``: rows past the cache
        length may hold NaN, and 0 * NaN = NaN in P V."""
        if valid < BLOCK_N:
            self.zero_tail_rows(v.sV_half, buf, valid, v.tid)
            cute.arch.fence_view_async_shared()

    @cute.jit
    def zero_tail_rows(self, sV_half, stage, valid, tid):
        n = (BLOCK_N - valid) * HALF_V
        for idx in cutlass.range(tid, n, 128, unroll=1):
            tok = valid + idx // HALF_V
            col = idx % HALF_V
            sV_half[col, tok, stage] = self.dtype(0.0)


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
            max_init=bar(SeesawBarrier.MAX_INIT, 128),
            epilogue=ConsumerBarriers(row_max=None, p_ready=None, row_sum=bar(SeesawBarrier.ROW_SUM)),
        )


@dataclasses.dataclass
class TileLoader:
    """TMA copies of the Q tile and of K sub-tiles, each sub-tile completing its own barrier."""

    tma_atom_q: Any
    tQgQ: Any
    tQsQ: Any
    tma_atom_k: Any
    tKgK: Any
    tKsK: Any
    q_bar: Any
    kv_bar: Any
    block_table: Any
    m_tile: Any
    kv_head: Any

    @staticmethod
    def make(tma_atom_q, tma_q, tma_atom_k, tma_k, sQ, sK, q_bar, kv_bar, block_table, m_tile, kv_head):
        # ((64, 576), m_tiles, 1, h_kv, b) and ((64, 64), page/64, 9, h_kv, num_blocks)
        gQ = cute.flat_divide(tma_q, (BLOCK_M, D_QK))
        gK = cute.flat_divide(tma_k, (BLOCK_N, SUB))
        sK_sub = cute.flat_divide(sK, (BLOCK_N, SUB))  # (64, 64, 1, 9, 2)
        tQsQ, tQgQ = cpasync.tma_partition(
            tma_atom_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2)
        )
        tKsK, tKgK = cpasync.tma_partition(
            tma_atom_k, 0, cute.make_layout(1), cute.group_modes(sK_sub, 0, 2), cute.group_modes(gK, 0, 2)
        )
        return TileLoader(tma_atom_q, tQgQ, tQsQ, tma_atom_k, tKgK, tKsK, q_bar, kv_bar,
                          block_table, m_tile, kv_head)
