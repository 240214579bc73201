"""Dense MLA decode over a paged cache, split-KV, seesaw schedule, on Hopper (SM90a).

Same work split, inputs and outputs as the serial baseline, ``dense_serial.py`` (one CTA per SM part, 64-row M tile
and KV head; the scheduler record gives its requests and blocks).  What differs is how the two
warpgroups share a 64-token tile pair (K0 in buffer 0, K1 in buffer 1): the 64 x 512 output is
split into O_L (columns 0-255, warpgroup 0) and O_R (256-511, warpgroup 1), and

  WG0: S0 = Q K0^T; new max m0; P0; O_L = O_L * a + P0 V0_L (P0 from registers)
  WG1: S1 = Q K1^T (at the same time);     after m0: new max m1; P1; O_R = O_R * a + P1 V1_R
  WG0: P0 rescaled to m1 into sP0;          WG1: P1 into sP1
  WG0: O_L = O_L * a + P1 V1_L (P1 from sP1)   WG1: O_R += P0 V0_R (P0 from sP0)

so one warpgroup's softmax runs while the other's tensor cores work (the steps are in
``seesaw.py``; this file orders them, loads the tiles and owns shared memory).  That is FlashMLA's
order, kept with two or more M tiles a KV head that tile multicast does not pair.  With one M tile a
KV head (the memory-bound rows) and with tile multicast (h_q = 128: a refill waits for both CTAs to
free a buffer half) the kernel takes the cross term first (config ``cross_term_first``): P0
leaves at m0, WG1 issues P0 V0_R before its softmax and P1 V1_R right behind it, and O_L / O_R move to
m1 only where the max moved, so the right half of K0 refills a step earlier.
Loads: a third warpgroup's first warp issues every TMA copy, in the consumers' order and a request ahead
across request boundaries; a consumer warpgroup that has waited for the last MMA reading a buffer half
hands it back with one mbarrier arrival.
Tile multicast (config ``cluster_ctas`` 2 or 4; with 128 query heads a KV head): the two M
tiles of a pair (grid y 2i and 2i + 1, which see the same tiles) run as a 2-CTA cluster, and each CTA
loads 32 of each sub-tile's 64 rows into both CTAs (TMA multicast), so each tile crosses from L2 once
for both.  A buffer half may be overwritten only once both CTAs freed it: its hand-back arrives on both
CTAs' ``free`` barrier of that half.  With 4-CTA clusters four M
tiles (grid y 4i .. 4i + 3) form the cluster, each CTA loads 16 of each sub-tile's rows into all four, and
each hand-back arrives on all four CTAs' barrier; causal, the four load the tiles of the cluster's last row.
Each 64 x 576 tile arrives as nine 64 x 64 sub-tiles, each with its own mbarrier, and S = Q K^T
consumes sub-tile j as soon as it lands:
  K0 sub-tiles 0-3 (V0_L) free after WG0's P0 V0_L; 4-8 after WG1's P0 V0_R;
  K1 sub-tiles 0-3 (V1_L) free after WG0's P1 V1_L; 4-8 after WG1's P1 V1_R.

Warpgroup roles (one CTA per SM):
  WG0  S of the even tiles, O_L; hands back sub-tiles 0-3 of both buffers, and Q's bytes after a
       request's epilogue.  Its thread 0 issues the bulk copies of a request's final rows.
  WG1  S of the odd tiles, O_R; hands back sub-tiles 4-8 of both buffers.
  WG2  the load warpgroup (setmaxnreg: 240 registers for WG0 and WG1, 24 for WG2): its first warp
       issues Q and every tile's copies; the other three warps idle.

Shared-memory plan (16-bit q/cache; bytes):
  sQ      64 x 576                        73 728  (its last 64 x 64 sub-tile, the RoPE part of Q,
                                                   is held in registers once Q lands and the
                                                   bytes serve as sP1; after a request's last
                                                   pair its final rows are
                                                   staged here, 64 rows of 520 elements, for the
                                                   bulk copies out)
  sK      2 x 64 x 576                   147 456  (V is the first 512 columns of K)
  sP0     64 x 64                          8 192
  sM, sScale, sSum  3 x [64][2] fp32       1 536  (row max in log2 units in sM[:, 0]; the rescale
                                                   factors of WG0 and WG1; the epilogue's sums)
  mbarriers: Q; K sub-tiles [2][9]           160
  free [2][2]                                 32  (per buffer and half: this CTA's consumers and, with
                                                   tile multicast, the peers' freed it)
  Q free                                       8  (Q's bytes may take the next request's Q)
About 226 KiB of the 227 KiB a CTA may have (``schedules.resolve.DENSE_SMEM_BYTES``).

Causal: the tiles no row of the M tile sees are skipped; the scores past a row's end are masked
only in a request's last two tiles (the rows of an M tile end less than 64 keys apart).

Named barriers (``seesaw.SeesawBarrier``): SCALE0 (WG0 -> WG1: m0 and sScale0 written; cross term
first: sP0 too), SCALE1 (WG1 -> WG0: m1 and sScale1 written; cross term first: sP1 too), P0_READY
(WG0 -> WG1: sP0 written), P1_ISSUED (WG1 -> WG0: sP1 written, and P0 V0_R issued), P0_READ (cross
term first, WG1 -> WG0: P0 V0_R has read sP0), ROW_SUM (both: the epilogue's sums), MAX_INIT (WG0
only: sM reset for a request), OUT_STAGED (both: the final rows are in sQ's bytes).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from ..schedules.configs import DenseSplitConfig
from .constants import BLOCK_M, BLOCK_N, D_QK, L2_EVICT_FIRST
from .dense_serial import feature_major, set_dense_facts
from .epilogue import StagedRows
from .layouts import lse_rows, make_smem_layouts, operand_tiles, out_rows, row_exchange, staged_rows_layout
from .softmax import rescale_o
from .work import OutputTile, SplitOutputs, WorkSlice, advance_lengths, lengths_ahead, load_splits
from .seesaw import NUM_SUB, SUB, SeesawBarrier, SeesawBarriers, SeesawConsumer, make_seesaw_mmas

# A buffer's sub-tiles by the warpgroup whose P V frees them: V_L (0-3) warpgroup 0's; V_R and the RoPE
# columns (4-8) warpgroup 1's.
V_L_SUBS = (0, 1, 2, 3)
V_R_SUBS = (4, 5, 6, 7, 8)

def half_of(subtiles) -> int:
    """The buffer half (hand-back barrier index) of a sub-tile group: 0 for V_L, 1 for V_R and RoPE."""
    return 0 if subtiles == V_L_SUBS else 1




class DenseSeesawKernel(SeesawConsumer):
    """Static configuration of one compiled seesaw dense decode kernel."""

    kv_stages = 2  # the tile pair
    # With the load warpgroup (384 threads, one CTA per SM): setmaxnreg moves registers within the CTA's
    # 384 x 168, so 2 x 128 x 240 + 128 x 24 = 64 512.
    launch_regs = 168
    consumer_regs = 240
    loader_regs = 24

    def __init__(self, config: DenseSplitConfig, fill_role: str = ""):
        if config.kernel != "seesaw" or config.cluster_ctas not in (1, 2, 4):
            raise ValueError(f"DenseSeesawKernel takes configs of kernel 'seesaw' with 1, 2 or 4 CTAs, got {config}")
        if config.cluster_ctas > 1 and (config.m_tiles % config.cluster_ctas or (config.causal and config.group % 128)):
            raise ValueError(f"a cluster of {config.cluster_ctas} CTAs shares each KV tile among M tiles that see the "
                             f"same tiles: it needs a multiple of {config.cluster_ctas} M tiles (got {config.m_tiles}) "
                             f"and, when causal, a multiple of 128 query heads a KV head (got {config.group})")
        set_dense_facts(self, config)
        self.kv_evict_first = config.evict_first
        self.tile_multicast = config.cluster_ctas > 1
        self.cluster_ctas = config.cluster_ctas
        self.cross_term_first = config.cross_term_first
        self.num_threads = 384
        # ``fill_role`` (see ``fill.py``): "clusters" lets the next kernel launch as soon as every CTA has
        # started; "fill" is that kernel: launched programmatically, each CTA waits for the clusters' grid
        # before it exits, so a kernel after this one finds both done.
        if fill_role not in ("", "clusters", "fill"):
            raise ValueError(f"fill_role must be '', 'clusters' or 'fill', got {fill_role!r}")
        self.fill_role = fill_role

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

        sQ_layout, sK_layout, sV_layout, sP_layout = make_smem_layouts(self.dtype, self.kv_stages)
        sub_layout = cute.slice_(
            sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (BLOCK_M, BLOCK_N, SUB), self.dtype, 1),
            (None, None, 0),
        )
        tma_atom_q, tma_q = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), q, sQ_layout, (BLOCK_M, D_QK))
        load_k = cpasync.CopyBulkTensorTileG2SMulticastOp() if self.tile_multicast else cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(load_k, k, sub_layout, (BLOCK_N, SUB),
                                                        num_multicast=self.cluster_ctas)
        self.q_bytes = cute.size_in_bytes(self.dtype, sQ_layout)
        self.sub_bytes = cute.size_in_bytes(self.dtype, sub_layout)

        @cute.struct
        class SharedStorage:
            q_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            kv_mbar: cute.struct.MemRange[cutlass.Int64, 2 * NUM_SUB]
            free_mbar: cute.struct.MemRange[cutlass.Int64, 4]  # [buffer][half]: freed by every CTA's consumers
            q_free_mbar: cute.struct.MemRange[cutlass.Int64, 1]  # Q's bytes free for the next request
            row_max: cute.struct.MemRange[cutlass.Float32, 2 * BLOCK_M]  # row_exchange's pair; [:, 0] is sM
            row_sum: cute.struct.MemRange[cutlass.Float32, 2 * BLOCK_M]
            scale: cute.struct.MemRange[cutlass.Float32, 2 * BLOCK_M]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sP_layout)], 1024]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()  # the occupancy query's (``DENSE_SMEM_BYTES``)

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
            use_pdl=self.fill_role == "fill",
            **({"cluster": [1, self.cluster_ctas, 1]} if self.tile_multicast else {}),
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
            # The loader's hand-backs: this CTA's consumers' and the peers'.
            for j in cutlass.range_constexpr(4):
                cute.arch.mbarrier_init(storage.free_mbar.data_ptr() + j, self.cluster_ctas)
            cute.arch.mbarrier_init(storage.q_free_mbar.data_ptr(), 1)
        cute.arch.mbarrier_init_fence()
        if cutlass.const_expr(self.tile_multicast):
            # The peer must see initialised barriers before it arrives or multicasts into them.
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()
        if cutlass.const_expr(self.fill_role == "clusters"):
            cute.arch.griddepcontrol_launch_dependents()

        # The warpgroup is a compile-time fact of each branch, so each gets its own code.  Every
        # record is built inside its branch: a branch may rebind what it uses.
        consumer_args = (storage, tma_atom_q, tma_q, tma_atom_k, tma_k, mBlockTable, mSeqlens, mSched, mNumSplits,
                         mOut, mLse, mOAccum, mLseAccum, scale_log2, sQ_layout, sK_layout, sV_layout, sP_layout)
        if wg < 2:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self.run_consumers(wg, *consumer_args)
        else:
            cute.arch.setmaxregister_decrease(self.loader_regs)
            if tidx // 32 == 8:
                part, m_tile, kv_head = cute.arch.block_idx()
                sQ, sK, _, _ = operand_tiles(storage, sQ_layout, sK_layout, sV_layout, sP_layout)
                loader = TileLoader.make(tma_atom_q, tma_q, tma_atom_k, tma_k, sQ, sK, q_bar, kv_bar,
                                         mBlockTable, m_tile, kv_head, self.cluster_ctas,
                                         storage.free_mbar.data_ptr(), storage.q_free_mbar.data_ptr())
                self.produce(loader, mSeqlens, self.work_slice(mSched, mBlockTable, part), m_tile)
        if cutlass.const_expr(self.tile_multicast):
            # Every multicast into this CTA was waited for, but neither CTA leaves before the other is done
            # with the cluster (with the load warpgroup the last hand-backs arrive on the peer unwaited).
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        if cutlass.const_expr(self.fill_role == "fill"):
            cute.arch.griddepcontrol_wait()

    @cute.jit
    def run_consumers(self, wg, *args):
        """Warpgroup 0's or 1's code: the warpgroup is a compile-time fact of each branch."""
        if wg == 0:
            self.run_warpgroup(0, *args)
        else:
            self.run_warpgroup(1, *args)

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
                                 mBlockTable, m_tile, kv_head, self.cluster_ctas,
                                 storage.free_mbar.data_ptr(), storage.q_free_mbar.data_ptr())
        outs = SplitOutputs(mNumSplits, mOut, mLse, mOAccum, mLseAccum)
        # Final rows leave through Q's bytes (dead after the request's last pair).  Thread 0 issues the
        # copies and waits for their reads before the next Q is loaded there (by its own warp, or by the
        # load warpgroup once it hands Q's bytes back).
        staged = StagedRows(
            rows=cute.make_tensor(storage.sQ.data_ptr(), staged_rows_layout()),
            written=pipeline.NamedBarrier(barrier_id=int(SeesawBarrier.OUT_STAGED), num_threads=256),
            issuer=0,
        )
        view = self.seesaw_view(make_seesaw_mmas(self.dtype), sQ, sK, sV, sP0, kv_bar, wg, tidx % 128)
        work = self.work_slice(mSched, mBlockTable, part)
        self.serve(view, sMax, sScale, sSum, loader, mSeqlens, work, outs, staged, scale_log2, m_tile, kv_head,
                   tidx, wg)

    def work_slice(self, mSched, mBlockTable, part):
        """This CTA's record, its requests' lengths taken within their block-table rows (the loader and the
        consumers alike)."""
        return WorkSlice.of(mSched, part, mBlockTable.shape[1] * self.page_size)

    # ------------------------------------------------------------- request loop
    @cute.jit
    def serve(self, v, sM, sScale, sSum, loader, mSeqlens, work, outs, staged, scale_log2, m_tile, kv_head, tidx,
              wg: cutlass.Constexpr):
        rows = self.row_state(m_tile, v.tid)
        bars = SeesawBarriers.make()
        q_phase = cute.make_rmem_tensor((1,), cutlass.Int32)
        q_phase[0] = 0
        v.kphase[0] = 0
        common_shift = self.common_shift(m_tile)
        lens = lengths_ahead(mSeqlens, work)
        for req in cutlass.range(work.begin_req, work.end_req + 1, unroll=1):
            # The next request's length and this one's split counts load now, under its tiles.
            seqlen = work.length(advance_lengths(lens, mSeqlens, work, req))
            splits = load_splits(outs, req)
            first, last = self.request_tiles(work, req, seqlen, common_shift)
            self.start_request(v, rows, sM, sScale, loader, q_phase, tidx)
            # No dynamic branch may enclose the pair loops: a loop inside one would rebind the
            # records it carries in a region their later users cannot see.
            if cutlass.const_expr(wg == 0):
                bars.max_init.arrive_and_wait()
                self.wg0_request(v, rows, sM, sScale, bars, loader, req, first, last, seqlen, scale_log2)
            else:
                self.wg1_request(v, rows, sM, sScale, bars, loader, req, first, last, seqlen, scale_log2)
            max2 = self.row_values(rows, sM, 0)  # before the epilogue's barrier: WG0 resets sM after it
            tile = OutputTile(kv_head, m_tile * BLOCK_M, self.rows - m_tile * BLOCK_M)
            self.epilogue(v, rows, bars.epilogue, sSum, outs, work, scale_log2, req, tile, max2=max2, splits=splits,
                          staged=staged)
            if cutlass.const_expr(wg == 0):
                # Past the epilogue's barrier both warpgroups are done with sQ (and sP1 in its bytes), and
                # thread 0 has waited for the staged rows' copies to read it: the next Q may land.
                if tidx == 0:
                    cute.arch.mbarrier_arrive(loader.q_free_bar)

    @cute.jit
    def common_shift(self, m_tile):
        """Causal: how many keys fewer than the request's length the M tile's last row sees (the tile's
        last row sees the most keys; blocks past them are skipped)."""
        shift = 0
        if cutlass.const_expr(self.causal):
            if cutlass.const_expr(self.cluster_ctas == 4):
                # The cluster's M tiles load the same tiles: those of its last row.
                m_tile = m_tile - m_tile % 4 + 3
            last_row = cutlass.min(m_tile * BLOCK_M + BLOCK_M - 1, self.rows - 1)
            shift = self.s_q - 1 - last_row // self.group
        return shift

    @cute.jit
    def request_tiles(self, work, req, seqlen, common_shift):
        """KV tiles [first, last) of request ``req`` this CTA computes (the consumers and the loader alike)."""
        first, last = work.blocks(req, seqlen)
        if cutlass.const_expr(self.causal):
            last = cutlass.min(last, (seqlen - common_shift + BLOCK_N - 1) // BLOCK_N)
        return first, last

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
    def wg0_request(self, v, rows, sM, sScale, bars, loader, req, first, last, seqlen, scale_log2):
        """Warpgroup 0's tiles of one request (none when last <= first): whole pairs, then the last one or two
        tiles through the same code with the tail's checks (one copy of it in the kernel)."""
        pair = self.wg0_pair_cross_first if self.cross_term_first else self.wg0_pair
        n = last - first
        if n >= 1:
            self.issue_qk(v, 0, V_L_SUBS + V_R_SUBS)
            warpgroup.wait_group(0)
        pairs = cutlass.max(n - 1, 0) // 2
        for p in cutlass.range(pairs, unroll=1):
            pair(v, rows, sM, sScale, bars, loader, req, first + 2 * p, last, seqlen, scale_log2, False)
        blk = first + 2 * pairs
        if blk < last:
            pair(v, rows, sM, sScale, bars, loader, req, blk, last, seqlen, scale_log2, True)

    @cute.jit
    def wg1_request(self, v, rows, sM, sScale, bars, loader, req, first, last, seqlen, scale_log2):
        """Warpgroup 1's tiles of one request (none when last <= first): whole pairs that end with S of the
        pair after, then one or two tail steps (the last two or three tiles: a masked pair, a lone last tile, or
        both), each step's code in the kernel once."""
        tiles, last_tile = ((self.wg1_tiles_cross_first, self.wg1_last_tile_cross_first) if self.cross_term_first
                            else (self.wg1_tiles, self.wg1_last_tile))
        n = last - first
        if n >= 2:
            self.issue_qk(v, 1, V_R_SUBS + V_L_SUBS)
            warpgroup.wait_group(0)
        pairs = cutlass.max(n - 2, 0) // 2
        for p in cutlass.range(pairs, unroll=1):
            tiles(v, rows, sM, sScale, bars, loader, first + 2 * p, seqlen, scale_log2, False)
        # The tail's two cases are whole branches: a branch join between this warpgroup's P V issues would
        # serialize them (FlashMLA's order) or cost registers (the cross term first).
        for blk in cutlass.range(first + 2 * pairs, last, 2, unroll=1):
            if blk + 1 < last:
                tiles(v, rows, sM, sScale, bars, loader, blk, seqlen, scale_log2, True)
            else:
                last_tile(v, rows, sM, sScale, bars, loader, blk, seqlen, scale_log2)

    # ----------------------------------------------------------- one tile pair
    # ``tail`` (compile time) False: tiles blk and blk + 1 are whole and S of the next pair is issued.  True: the
    # request's last tiles, masked; tile blk + 1 may not exist (``blk + 1 < last`` decides at run time), zero_tail_v
    # zeroes V rows past the cache length (a no-op on a whole tile), and no further S is issued.
    @cute.jit
    def wg0_pair(self, v, rows, sM, sScale, bars, loader, req, blk, last, seqlen, scale_log2, tail: cutlass.Constexpr):
        """Tiles blk (buffer 0) and blk + 1 (buffer 1), warpgroup 0's side; leaves S of blk + 2."""
        self.softmax_wg0(v, rows, sM, sScale, seqlen, blk, scale_log2, tail)
        bars.scale0.arrive()
        if cutlass.const_expr(tail):
            self.zero_tail_v(v, 0, seqlen - blk * BLOCK_N)
        self.issue_pv(v, v.mmas.pv_rs, v.rPa, v.tOrV_rs, 0)
        warpgroup.wait_group(0)
        self.hand_back(v, loader, 0, 0)

        bars.scale1.arrive_and_wait()
        # P0 to the final max of the pair, for warpgroup 1's P0 V0_R.
        scale1 = self.row_values(rows, sScale, 1)
        rescale_o(v.acc_s, scale1)
        v.rPc.store(v.acc_s.load().to(self.dtype))
        cute.autovec_copy(v.rPc, v.tPsP0)
        cute.arch.fence_view_async_shared()
        bars.p0_ready.arrive()

        if cutlass.const_expr(not tail):
            self.wg0_p1_v1(v, rows, bars, scale1)
            self.wg0_next_s(v, loader)
            warpgroup.wait_group(0)
        else:
            if blk + 1 < last:
                self.zero_tail_v(v, 1, seqlen - (blk + 1) * BLOCK_N)
                self.wg0_p1_v1(v, rows, bars, scale1)
                warpgroup.wait_group(0)
                self.hand_back(v, loader, 1, 0)  # K1's left half, read last by P1 V1_L (no next S)
            else:
                warpgroup.wait_group(0)

    @cute.jit
    def wg0_p1_v1(self, v, rows, bars, scale1):
        """(FlashMLA's order) Once warpgroup 1 has written sP1: O_L and the sums to m1, then O_L += P1 V1_L."""
        bars.p1_issued.arrive_and_wait()
        for i in cutlass.range_constexpr(2):
            rows.row_sum[i] = rows.row_sum[i] * scale1[i]
        rescale_o(v.acc_o, scale1)
        self.issue_pv(v, v.mmas.pv_ss, v.tOrP1, v.tOrV_ss, 1)

    @cute.jit
    def wg1_tiles(self, v, rows, sM, sScale, bars, loader, blk, seqlen, scale_log2, tail: cutlass.Constexpr):
        """(FlashMLA's order) Both tiles of the pair; ``tail``: masked, V rows past the length zeroed, no next S."""
        bars.scale0.arrive_and_wait()
        self.softmax_wg1(v, rows, sM, sScale, seqlen, blk + 1, scale_log2, tail, False)
        bars.scale1.arrive()
        cute.autovec_copy(v.rPc, v.tPsP1)
        if cutlass.const_expr(tail):
            self.zero_tail_v(v, 1, seqlen - (blk + 1) * BLOCK_N)
        cute.arch.fence_view_async_shared()
        self.issue_pv(v, v.mmas.pv_rs, v.rPa, v.tOrV_rs, 1)

        bars.p0_ready.arrive_and_wait()
        if cutlass.const_expr(tail):
            self.zero_tail_v(v, 0, seqlen - blk * BLOCK_N)
        self.issue_pv(v, v.mmas.pv_ss, v.tOrP0, v.tOrV_ss, 0)
        bars.p1_issued.arrive()
        # P1 V1_R was committed before P0 V0_R: K1's right half frees first.
        warpgroup.wait_group(1)
        self.hand_back(v, loader, 1, 1)
        warpgroup.wait_group(0)
        self.hand_back(v, loader, 0, 1)
        if cutlass.const_expr(not tail):
            self.issue_qk(v, 1, V_R_SUBS + V_L_SUBS)
            warpgroup.wait_group(0)

    @cute.jit
    def wg1_last_tile(self, v, rows, sM, sScale, bars, loader, blk, seqlen, scale_log2):
        """(FlashMLA's order) A request's lone last tile blk: no P1 (its max and sums still published)."""
        bars.scale0.arrive_and_wait()
        self.softmax_wg1(v, rows, sM, sScale, seqlen, blk + 1, scale_log2, False, True)
        bars.scale1.arrive()
        bars.p0_ready.arrive_and_wait()
        self.zero_tail_v(v, 0, seqlen - blk * BLOCK_N)
        self.issue_pv(v, v.mmas.pv_ss, v.tOrP0, v.tOrV_ss, 0)
        warpgroup.wait_group(0)
        self.hand_back(v, loader, 0, 1)

    @cute.jit
    def wg0_pair_cross_first(self, v, rows, sM, sScale, bars, loader, req, blk, last, seqlen, scale_log2,
                             tail: cutlass.Constexpr):
        """``wg0_pair`` in the cross-term-first order: P0 leaves at m0, before P0 V0_L, and O_L moves to
        m1 before P1 V1_L."""
        self.softmax_wg0(v, rows, sM, sScale, seqlen, blk, scale_log2, tail)
        cute.autovec_copy(v.rPc, v.tPsP0)
        if cutlass.const_expr(tail):
            self.zero_tail_v(v, 0, seqlen - blk * BLOCK_N)
        cute.arch.fence_view_async_shared()
        bars.scale0.arrive()
        self.issue_pv(v, v.mmas.pv_rs, v.rPa, v.tOrV_rs, 0)
        warpgroup.wait_group(0)
        self.hand_back(v, loader, 0, 0)

        bars.scale1.arrive_and_wait()
        if cutlass.const_expr(not tail):
            self.wg0_p1_v1_cross_first(v, rows, sScale)
            self.wg0_next_s(v, loader)
            # Warpgroup 1's P0 V0_R has read sP0 before the next pair writes it.
            bars.p0_read.arrive_and_wait()
            warpgroup.wait_group(0)
        else:
            if blk + 1 < last:
                self.zero_tail_v(v, 1, seqlen - (blk + 1) * BLOCK_N)
                self.wg0_p1_v1_cross_first(v, rows, sScale)
            bars.p0_read.arrive_and_wait()
            warpgroup.wait_group(0)
            if blk + 1 < last:
                self.hand_back(v, loader, 1, 0)  # K1's left half, read last by P1 V1_L (no next S)

    @cute.jit
    def wg0_p1_v1_cross_first(self, v, rows, sScale):
        """(Cross term first) O_L and the sums to m1, then O_L += P1 V1_L."""
        scale1 = cute.make_rmem_tensor((2,), cutlass.Float32)
        for i in cutlass.range_constexpr(2):
            scale1[i] = sScale[rows.row0 + 8 * i, 1]
            rows.row_sum[i] = rows.row_sum[i] * scale1[i]
        rescale_o(v.acc_o, scale1)
        self.issue_pv(v, v.mmas.pv_ss, v.tOrP1, v.tOrV_ss, 1)

    @cute.jit
    def wg1_tiles_cross_first(self, v, rows, sM, sScale, bars, loader, blk, seqlen, scale_log2,
                              tail: cutlass.Constexpr):
        """(Cross term first) Both tiles of the pair: O_R moves to m0 and P0 V0_R is issued before this
        warpgroup's softmax; P1 V1_R queues behind it.  ``tail``: masked, V rows past the length zeroed, no
        next S."""
        bars.scale0.arrive_and_wait()
        rescale_o(v.acc_o, self.row_values(rows, sScale, 0))
        if cutlass.const_expr(tail):
            self.zero_tail_v(v, 0, seqlen - blk * BLOCK_N)
        self.issue_pv(v, v.mmas.pv_ss, v.tOrP0, v.tOrV_ss, 0)
        scale1 = self.softmax_wg1(v, rows, sM, sScale, seqlen, blk + 1, scale_log2, tail, False, rescale=False)
        cute.autovec_copy(v.rPc, v.tPsP1)
        if cutlass.const_expr(tail):
            self.zero_tail_v(v, 1, seqlen - (blk + 1) * BLOCK_N)
        cute.arch.fence_view_async_shared()
        # Only a warp whose rows' max moved (rare past a request's first tiles) waits for P0 V0_R.
        if cute.arch.vote_any_sync(cutlass.min(scale1[0], scale1[1]) != 1.0):
            warpgroup.wait_group(0)
            rescale_o(v.acc_o, scale1)
        self.issue_pv(v, v.mmas.pv_rs, v.rPa, v.tOrV_rs, 1)
        bars.scale1.arrive()

        warpgroup.wait_group(1)  # P0 V0_R: sP0 and K0's right half are free
        bars.p0_read.arrive()
        self.hand_back(v, loader, 0, 1)
        warpgroup.wait_group(0)
        self.hand_back(v, loader, 1, 1)
        if cutlass.const_expr(not tail):
            self.issue_qk(v, 1, V_R_SUBS + V_L_SUBS)
            warpgroup.wait_group(0)

    @cute.jit
    def wg1_last_tile_cross_first(self, v, rows, sM, sScale, bars, loader, blk, seqlen, scale_log2):
        """(Cross term first) A request's lone last tile blk: P0 V0_R, no P1 (its max and sums still
        published)."""
        bars.scale0.arrive_and_wait()
        rescale_o(v.acc_o, self.row_values(rows, sScale, 0))
        self.zero_tail_v(v, 0, seqlen - blk * BLOCK_N)
        self.issue_pv(v, v.mmas.pv_ss, v.tOrP0, v.tOrV_ss, 0)
        self.softmax_wg1(v, rows, sM, sScale, seqlen, blk + 1, scale_log2, False, True, rescale=False)
        bars.scale1.arrive()
        warpgroup.wait_group(0)
        bars.p0_read.arrive()
        self.hand_back(v, loader, 0, 1)

    @cute.jit
    def wg0_next_s(self, v, loader):
        """Issue S of tile blk + 2 (its V_L sub-tiles, refilled first, first) and, once this pair's
        P1 V1_L has read K1's left half, hand it back for tile blk + 3."""
        self.issue_qk(v, 0, V_L_SUBS, flip=False)
        warpgroup.wait_group(len(V_L_SUBS))
        self.hand_back(v, loader, 1, 0)
        self.issue_qk(v, 0, V_R_SUBS, accumulate=True)

    @cute.jit
    def hand_back(self, v, ld, buf: cutlass.Constexpr, half: cutlass.Constexpr):
        """(load warpgroup) Half ``half`` of buffer ``buf`` (0: V_L, 1: V_R and the RoPE columns) is free in
        this CTA: the calling warpgroup has waited for the last MMA that reads it.  With tile multicast the
        peer's loader is told too, since its copies write into this CTA's buffer."""
        if v.tid == 0:
            cute.arch.mbarrier_arrive(ld.free_bar + (buf * 2 + half))
            if cutlass.const_expr(self.cluster_ctas == 2):
                cute.arch.mbarrier_arrive(ld.free_bar + (buf * 2 + half), ld.peer)
            elif cutlass.const_expr(self.tile_multicast):
                for i in cutlass.range_constexpr(1, self.cluster_ctas):
                    cute.arch.mbarrier_arrive(ld.free_bar + (buf * 2 + half), (ld.rank + i) % self.cluster_ctas)

    # ------------------------------------------------------------- the load warpgroup
    @cute.jit
    def produce(self, ld, mSeqlens, work, m_tile):
        """The loader's warp: every request's Q and tiles in the consumers' order, each buffer half once
        it is handed back.  A request's first two tiles go before its Q: their buffers free up during the
        previous request's last pair, Q's bytes only after its epilogue."""
        common_shift = self.common_shift(m_tile)
        # Phases of the hand-back barriers [buffer][half] and of Q's: a fresh barrier passes parity 1.
        free_phase = cute.make_rmem_tensor((4,), cutlass.Int32)
        free_phase.fill(1)
        q_phase = cute.make_rmem_tensor((1,), cutlass.Int32)
        q_phase[0] = 1
        for req in cutlass.range(work.begin_req, work.end_req + 1, unroll=1):
            first, last = self.request_tiles(work, req, work.length(mSeqlens[req]), common_shift)
            if req == work.begin_req:
                self.load_q_when_free(ld, req, q_phase)
            if first < last:
                self.load_tile(ld, req, first, 0, free_phase)
            if first + 1 < last:
                self.load_tile(ld, req, first + 1, 1, free_phase)
            if req != work.begin_req:
                self.load_q_when_free(ld, req, q_phase)
            for blk in cutlass.range(first + 2, last, 2, unroll=1):
                self.load_tile(ld, req, blk, 0, free_phase)
                if blk + 1 < last:
                    self.load_tile(ld, req, blk + 1, 1, free_phase)

    @cute.jit
    def load_q_when_free(self, ld, req, q_phase):
        """Request ``req``'s Q, once WG0 has handed back Q's bytes (a fresh barrier passes at once)."""
        cute.arch.mbarrier_wait(ld.q_free_bar, q_phase[0])
        q_phase[0] = q_phase[0] ^ 1
        self.load_q(ld, req)

    @cute.jit
    def load_tile(self, ld, req, blk, buf: cutlass.Constexpr, free_phase):
        """Tile ``blk`` into buffer ``buf``, half by half as each is handed back, in the order the consumers
        free them (buffer 1's right half, read by the P V issued first, before its left half)."""
        loc = self.tile_location(ld, req, blk)
        for subtiles in ((V_L_SUBS, V_R_SUBS) if buf == 0 else (V_R_SUBS, V_L_SUBS)):
            k = buf * 2 + half_of(subtiles)
            cute.arch.mbarrier_wait(ld.free_bar + k, free_phase[k])
            free_phase[k] = free_phase[k] ^ 1
            # Each expectation follows the hand-back: before it this CTA's consumers may still wait on the
            # sub-tile's previous phase.  The peer's multicast half may land before it (a barrier's
            # transaction count may run ahead of its expectation within a phase).
            self.expect_and_copy(ld, loc, buf, subtiles)

    @cute.jit
    def expect_and_copy(self, ld, loc, buf: cutlass.Constexpr, subtiles: cutlass.Constexpr):
        """Each of ``subtiles``: its barrier expects the whole sub-tile, then this CTA's copy (by a whole warp)."""
        for j in subtiles:
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(ld.kv_bar + (buf * NUM_SUB + j), self.sub_bytes)
            self.copy_sub_tile(ld, loc, buf, j)

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
    def copy_sub_tile(self, ld, loc, buf: cutlass.Constexpr, j: cutlass.Constexpr):
        """The TMA copy of sub-tile ``j`` of the tile at ``loc`` into buffer ``buf``, completing the
        sub-tile's barrier (with tile multicast: this CTA's rows, into both CTAs); evict-first when the
        config asks."""
        tile_in_page, phys = loc
        options = {}
        if cutlass.const_expr(self.tile_multicast):
            options["mcast_mask"] = cutlass.Int16((1 << self.cluster_ctas) - 1)
        if cutlass.const_expr(self.kv_evict_first):
            options["cache_policy"] = cutlass.Int64(L2_EVICT_FIRST)
        cute.copy(ld.tma_atom_k, ld.tKgK[None, tile_in_page, j, ld.kv_head, phys], ld.tKsK[None, 0, j, buf],
                  tma_bar_ptr=ld.kv_bar + (buf * NUM_SUB + j), **options)


# ---------------------------------------------------------------- device-side records


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
    free_bar: Any = None  # [buffer][half] mbarriers: the consumers' hand-backs (every CTA's of the cluster)
    q_free_bar: Any = None  # Q's bytes are free for the next request
    peer: Any = None  # tile multicast in pairs: the other CTA's rank in the cluster
    rank: Any = None  # tile multicast: this CTA's rank in the cluster

    @staticmethod
    def make(tma_atom_q, tma_q, tma_atom_k, tma_k, sQ, sK, q_bar, kv_bar, block_table, m_tile, kv_head,
             cluster_ctas: cutlass.Constexpr = 1, free_bar=None, q_free_bar=None):
        # ((64, 576), m_tiles, 1, h_kv, b) and ((64, 64), page/64, 9, h_kv, num_blocks)
        gQ = cute.flat_divide(tma_q, (BLOCK_M, D_QK))
        gK = cute.flat_divide(tma_k, (BLOCK_N, SUB))
        sK_sub = cute.flat_divide(sK, (BLOCK_N, SUB))  # (64, 64, 1, 9, 2)
        tQsQ, tQgQ = cpasync.tma_partition(
            tma_atom_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2)
        )
        # With multicast each CTA of the cluster copies its share of every sub-tile (its rank's rows).
        multicast = cluster_ctas > 1
        rank = cute.arch.block_idx_in_cluster() if multicast else 0
        tKsK, tKgK = cpasync.tma_partition(
            tma_atom_k, rank, cute.make_layout(cluster_ctas), cute.group_modes(sK_sub, 0, 2),
            cute.group_modes(gK, 0, 2)
        )
        loader = TileLoader(tma_atom_q, tQgQ, tQsQ, tma_atom_k, tKgK, tKsK, q_bar, kv_bar, block_table, m_tile, kv_head,
                            free_bar, q_free_bar)
        if cutlass.const_expr(multicast):
            if cutlass.const_expr(cluster_ctas == 2):
                loader.peer = 1 - rank
            loader.rank = rank
        return loader
