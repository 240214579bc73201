"""Sparse MLA prefill (``flash_mla_sparse_fwd``) on Hopper (SM90a): bf16 kv rows gathered by index.

Query token s attends to the ``topk`` rows of ``kv`` that ``indices[s]`` names (an index outside
[0, s_kv), or at or past ``topk_length[s]``, contributes nothing).  The CTA of grid (part p, head tile t)
serves the 64 heads 64 t .. 64 t + 63 of the query tokens of part p (a contiguous range, the tokens split
evenly over the parts: one CTA per SM, persistent), token after token, 64 indexed rows a tile.

The consumers are the dense seesaw kernel's (``dense_seesaw.py``, the steps in ``seesaw.py``): WG0
computes S of the even tiles and O_L, WG1 S of the odd tiles and O_R, the cross terms through sP0 /
sP1, each buffer half handed back to the loader once the last MMA reading it is done.  What differs:
  * a tile's rows come from a gather, not from the block table: the load warpgroup's 128 threads copy
    16 bytes each with cp.async (8 threads a 128-byte row segment, rows ``t / 8 + 16 r``, r < 4), an
    invalid row zero-filled (source size 0) and never read; each thread waits for its copies of a
    sub-tile are waited for, fenced for the async proxy (the consumers' WGMMA) and arrive on the sub-tile's
    barrier (128 arrivals), sub-tile after sub-tile as they land;
  * the scores carry a per-token bias (0, or -inf for an invalid token), written by the loader into
    ``sBias`` (one thread a row) before its arrivals on the tile, which release it; S's softmax adds it
    (``row_maxima``);
  * the true row max (the seesaw's shared max moves only past ``MAX_SLACK``) is kept per thread for
    ``max_logits``, and the epilogue writes out, lse and max_logits of every token (no split-KV);
  * d_qk = 512 (config ``d_qk``): Q's RoPE columns and the kv rows' are neither loaded nor
    multiplied (sub-tile 8 is left out of S).
A token with no tile (topk_length 0) writes out 0, lse +inf, max_logits -inf; a tile whose indices are
all invalid is computed (its P is 0).

Warpgroup roles (384 threads, one CTA per SM; setmaxnreg 232 / 232 / 40):
  WG0, WG1  the seesaw consumers (as in dense decode).
  WG2       the gather: indices of the next tile loaded while this tile's rows are copied; its first
            warp also issues Q's TMA load, once WG0 hands Q's bytes back after a token's epilogue.

Shared-memory plan (bf16; bytes):
  sQ      64 x 576                        73 728  (RoPE part in registers once Q lands, then sP1;
                                                   the final rows staged here for the bulk copies)
  sK      2 x 64 x 576                   147 456  (V is the first 512 columns of K)
  sP0     64 x 64                          8 192
  sM, sScale, sSum, sTrueMax  4 x [64][2] fp32   2 048
  sBias   [2][64] fp32                       512
  mbarriers: Q; K sub-tiles [2][9] (128 arrivals each); free [2][2]; Q free
Named barriers: ``barriers.SeesawBarrier`` (the consumers').
"""

from __future__ import annotations

import dataclasses
from typing import Any

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass._mlir.dialects import nvvm
from cutlass.cute.nvgpu import cpasync
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from ..schedules.configs import SparsePrefillConfig
from .barriers import SeesawBarrier
from .constants import BLOCK_M, BLOCK_N, D_QK, D_V, LN_2, LOG2_E
from .dense_seesaw import V_L_SUBS, V_R_SUBS, DenseSeesawKernel, half_of
from .epilogue import StagedRows
from .layouts import make_smem_layouts, operand_tiles, row_exchange, staged_rows_layout
from .seesaw import NUM_SUB, ROPE_SUB, SUB, SeesawBarriers, SeesawView, make_seesaw_mmas
from .softmax import sink_factor
from .work import OutputTile, WorkSlice

PIECE = 16  # bytes per cp.async
LANES_PER_ROW = SUB * 2 // PIECE  # 8 threads copy one 128-byte row segment
ROWS_PER_PASS = 128 // LANES_PER_ROW  # 16 rows per pass of the load warpgroup
ROUNDS = BLOCK_N // ROWS_PER_PASS  # 4 rows per thread per tile
SUB_ELEMS = BLOCK_N * SUB  # one 64 x 64 sub-tile (a column block of a K stage)
STAGE_ELEMS = BLOCK_N * D_QK
NO_END = 1 << 30  # a part's last token is served whole


class SparsePrefillKernel(DenseSeesawKernel):
    """Static configuration of one compiled sparse prefill kernel."""

    launch_regs = 168
    consumer_regs = 232
    loader_regs = 40

    def __init__(self, config: SparsePrefillConfig):
        self.dtype = cutlass.BFloat16
        self.m_tiles = -(-config.h_q // BLOCK_M)
        self.rope = config.d_qk == D_QK
        self.d_qk = config.d_qk
        # The seesaw's order with the cross term first (FlashMLA's order, the cross term last, spills at 232
        # registers a consumer warpgroup).
        self.cross_term_first = True
        # The seesaw consumers' facts: one token per M tile, its heads the rows, no causal mask, no cluster.
        self.rows = config.h_q
        self.group = config.h_q
        self.s_q = 1
        self.causal = False
        self.cluster_ctas = 1
        self.tile_multicast = False
        self.num_threads = 384
        self.fill_role = ""
        self.qk_subs = tuple(range(NUM_SUB if self.rope else ROPE_SUB))
        assert 2 * 128 * self.consumer_regs + 128 * self.loader_regs <= self.launch_regs * self.num_threads

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [s_q, h_q, d_qk] bf16
        mKV: cute.Tensor,  # [s_kv, d_qk] bf16
        mIndices: cute.Tensor,  # [s_q, topk] int32
        mTopkLen: cute.Tensor,  # [s_q] int32, or None
        mSink: cute.Tensor,  # [h_q] fp32, or None
        mOut: cute.Tensor,  # [s_q, h_q, 512] bf16
        mMaxLogits: cute.Tensor,  # [s_q, h_q] fp32
        mLse: cute.Tensor,  # [s_q, h_q] fp32
        num_parts: cutlass.Int32,
        scale_log2: cutlass.Float32,
        stream,
    ):
        # (h_q, d_qk, s_q): feature-contiguous, as TMA wants; heads past h_q read as zeros.
        q = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[1, 2, 0]))
        sQ_layout, sK_layout, sV_layout, sP_layout = make_smem_layouts(self.dtype, self.kv_stages)
        # Q's TMA writes its d_qk columns (all of sQ, or the 512 latent ones: 64-column blocks are contiguous).
        sQ_load = cute.slice_(
            sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (BLOCK_M, BLOCK_N, self.d_qk), self.dtype, 1),
            (None, None, 0),
        )
        tma_atom_q, tma_q = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), q, sQ_load,
                                                        (BLOCK_M, self.d_qk))
        self.q_bytes = cute.size_in_bytes(self.dtype, sQ_load)

        @cute.struct
        class SharedStorage:
            q_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            kv_mbar: cute.struct.MemRange[cutlass.Int64, 2 * NUM_SUB]
            free_mbar: cute.struct.MemRange[cutlass.Int64, 4]  # [buffer][half]: freed by this CTA's consumers
            q_free_mbar: cute.struct.MemRange[cutlass.Int64, 1]  # Q's bytes free for the next token
            row_max: cute.struct.MemRange[cutlass.Float32, 2 * BLOCK_M]  # row_exchange's pair; [:, 0] is sM
            row_sum: cute.struct.MemRange[cutlass.Float32, 2 * BLOCK_M]
            scale: cute.struct.MemRange[cutlass.Float32, 2 * BLOCK_M]
            true_max: cute.struct.MemRange[cutlass.Float32, 2 * BLOCK_M]  # each warpgroup's exact row max
            bias: cute.struct.MemRange[cutlass.Float32, 2 * BLOCK_N]  # [buffer][token]: 0 or -inf
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sP_layout)], 1024]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()

        # out [s_q, h_q, 512] and lse / max_logits [s_q, h_q] as the epilogue's (token, 1, row) views.
        out = cute.make_tensor(mOut.iterator, cute.make_layout(
            (mOut.shape[0], 1, mOut.shape[1], D_V), stride=(mOut.stride[0], 0, mOut.stride[1], 1)))
        lse = cute.make_tensor(mLse.iterator, cute.make_layout(
            (mLse.shape[0], 1, mLse.shape[1]), stride=(mLse.stride[0], 0, 1)))
        max_logits = cute.make_tensor(mMaxLogits.iterator, cute.make_layout(
            (mMaxLogits.shape[0], 1, mMaxLogits.shape[1]), stride=(mMaxLogits.stride[0], 0, 1)))
        self.kernel(
            tma_atom_q, tma_q, mKV, mIndices, mTopkLen, mSink, out, lse, max_logits, scale_log2,
            sQ_layout, sK_layout, sV_layout, sP_layout, sQ_load,
        ).launch(
            grid=[num_parts, self.m_tiles, 1],
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
        mKV: cute.Tensor,
        mIndices: cute.Tensor,
        mTopkLen: cute.Tensor,
        mSink: cute.Tensor,
        mOut: cute.Tensor,
        mLse: cute.Tensor,
        mMaxLogits: cute.Tensor,
        scale_log2: cutlass.Float32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout,
        sQ_load: cute.ComposedLayout,
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
                cute.arch.mbarrier_init(kv_bar + j, 128)  # every gather thread arrives
            for j in cutlass.range_constexpr(4):
                cute.arch.mbarrier_init(storage.free_mbar.data_ptr() + j, 1)
            cute.arch.mbarrier_init(storage.q_free_mbar.data_ptr(), 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        # Every record is built inside its branch: a branch may rebind the fields of what it is passed.
        if wg < 2:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            if wg == 0:
                self.run_consumer(0, storage, tma_atom_q, tma_q, mIndices, mTopkLen, mSink, mOut, mLse, mMaxLogits,
                                  scale_log2, sQ_layout, sK_layout, sV_layout, sP_layout, sQ_load)
            else:
                self.run_consumer(1, storage, tma_atom_q, tma_q, mIndices, mTopkLen, mSink, mOut, mLse, mMaxLogits,
                                  scale_log2, sQ_layout, sK_layout, sV_layout, sP_layout, sQ_load)
        else:
            cute.arch.setmaxregister_decrease(self.loader_regs)
            ld = self.gather_record(storage, tma_atom_q, tma_q, sQ_load)
            sBias = storage.bias.get_tensor(cute.make_layout((BLOCK_N, 2)))
            rows = RowCopies.make(sK_layout, storage.sK.data_ptr(), tidx % 128)
            work = token_range(mIndices.shape[0], mIndices.shape[1])
            self.gather(ld, rows, sBias, mKV, mIndices, mTopkLen, work, tidx // 32 == 8)

    @cute.jit
    def gather_record(self, storage, tma_atom_q, tma_q, sQ_load):
        """The barriers and Q's TMA copy (the loader's and the consumers')."""
        _, m_tile, _ = cute.arch.block_idx()
        sQ_in = cute.make_tensor(storage.sQ.data_ptr(), sQ_load)
        gQ = cute.flat_divide(tma_q, (BLOCK_M, self.d_qk))  # ((64, d_qk), m_tiles, 1, s_q)
        tQsQ, tQgQ = cpasync.tma_partition(tma_atom_q, 0, cute.make_layout(1), cute.group_modes(sQ_in, 0, 2),
                                           cute.group_modes(gQ, 0, 2))
        return Gather(tma_atom_q, tQgQ, tQsQ, storage.q_mbar.data_ptr(), storage.kv_mbar.data_ptr(),
                      storage.free_mbar.data_ptr(), storage.q_free_mbar.data_ptr(), m_tile)

    @cute.jit
    def run_consumer(self, wg: cutlass.Constexpr, storage, tma_atom_q, tma_q, mIndices, mTopkLen, mSink, mOut, mLse,
                     mMaxLogits, scale_log2, sQ_layout, sK_layout, sV_layout, sP_layout, sQ_load):
        tidx, _, _ = cute.arch.thread_idx()
        _, m_tile, _ = cute.arch.block_idx()
        ld = self.gather_record(storage, tma_atom_q, tma_q, sQ_load)
        sQ, sK, sV, sP0 = operand_tiles(storage, sQ_layout, sK_layout, sV_layout, sP_layout)
        sBias = storage.bias.get_tensor(cute.make_layout((BLOCK_N, 2)))
        sMax, sSum = row_exchange(storage)
        sScale = storage.scale.get_tensor(cute.make_layout((BLOCK_M, 2)))
        sTrueMax = storage.true_max.get_tensor(cute.make_layout((BLOCK_M, 2)))
        outs = Outputs(mOut, mLse, mMaxLogits, mSink)
        staged = StagedRows(
            rows=cute.make_tensor(storage.sQ.data_ptr(), staged_rows_layout()),
            written=pipeline.NamedBarrier(barrier_id=int(SeesawBarrier.OUT_STAGED), num_threads=256),
            issuer=0,
        )
        view = self.gather_view(sQ, sK, sV, sP0, ld.kv_bar, sBias, wg, tidx % 128)
        work = token_range(mIndices.shape[0], mIndices.shape[1])
        self.serve_tokens(view, sMax, sScale, sSum, sTrueMax, ld, mTopkLen, work, outs, staged, scale_log2, m_tile,
                          tidx, wg)

    @cute.jit
    def gather_view(self, sQ, sK, sV, sP0, kv_bar, sBias, wg: cutlass.Constexpr, tid):
        v = self.seesaw_view(make_seesaw_mmas(self.dtype), sQ, sK, sV, sP0, kv_bar, wg, tid)
        return GatherView(**{f.name: getattr(v, f.name) for f in dataclasses.fields(v)}, bias=sBias)

    # ------------------------------------------------------------- the consumers' token loop
    @cute.jit
    def serve_tokens(self, v, sM, sScale, sSum, sTrueMax, loader, mTopkLen, work, outs, staged, scale_log2,
                     m_tile, tidx, wg: cutlass.Constexpr):
        rows = self.row_state(m_tile, v.tid)
        bars = SeesawBarriers.make()
        q_phase = cute.make_rmem_tensor((1,), cutlass.Int32)
        q_phase[0] = 0
        v.kphase[0] = 0
        lens = TokenLengths.start(mTopkLen, work)
        for req in cutlass.range(work.begin_req, work.end_req + 1, unroll=1):
            lens.advance(mTopkLen, work, req)
            length = lens.current()
            first, last = work.blocks(req, length)
            self.start_request(v, rows, sM, sScale, loader, q_phase, tidx)
            for i in cutlass.range_constexpr(2):
                rows.row_max[i] = -cutlass.Float32.inf
            if cutlass.const_expr(wg == 0):
                bars.max_init.arrive_and_wait()
                self.wg0_request(v, rows, sM, sScale, bars, loader, req, first, last, length, scale_log2)
            else:
                self.wg1_request(v, rows, sM, sScale, bars, loader, req, first, last, length, scale_log2)
            max2 = self.row_values(rows, sM, 0)  # before the epilogue's barrier: WG0 resets sM after it
            tile = OutputTile(0, m_tile * BLOCK_M, self.rows - m_tile * BLOCK_M, m_tile * BLOCK_M)
            self.token_epilogue(v, rows, bars.epilogue, sSum, sTrueMax, outs, scale_log2, req, tile, max2, staged)
            if cutlass.const_expr(wg == 0):
                if tidx == 0:
                    cute.arch.mbarrier_arrive(loader.q_free_bar)

    @cute.jit
    def start_request(self, v, rows, sM, sScale, loader, q_phase, tidx):
        """Reset O, the sums and the shared row max; wait for Q (its RoPE part into registers)."""
        v.acc_o.fill(0.0)
        for i in cutlass.range_constexpr(2):
            rows.row_sum[i] = 0.0
        if tidx < BLOCK_M:
            sM[tidx, 0] = -cutlass.Float32.inf
        cute.arch.mbarrier_wait(loader.q_bar, q_phase[0])
        q_phase[0] = q_phase[0] ^ 1
        if cutlass.const_expr(self.rope):
            cute.autovec_copy(v.tSsQ_rope, v.rQ_rope)

    @cute.jit
    def issue_qk(self, v, buf: cutlass.Constexpr, subtiles: cutlass.Constexpr, accumulate: cutlass.Constexpr = False,
                 flip: cutlass.Constexpr = True):
        """The seesaw's S over the sub-tiles this kernel loads (without RoPE, sub-tile 8 is left out)."""
        kept = tuple(j for j in subtiles if j in self.qk_subs)
        super().issue_qk(v, buf, kept, accumulate, flip)

    @cute.jit
    def row_maxima(self, v, rows, seqlen, blk, scale_log2, masked: cutlass.Constexpr):
        """S plus the tile's per-token bias (invalid tokens -inf), and its row maxima in log2 units reduced
        over each row's four threads; the thread's exact running max (``rows.row_max``) follows them."""
        cur = cute.make_rmem_tensor((2,), cutlass.Float32)
        for i in cutlass.range_constexpr(2):
            cur[i] = -cutlass.Float32.inf
        for e in cutlass.range_constexpr(cute.size(v.acc_s)):
            r, c = v.tScS[e]
            i = (e // 2) % 2
            s = v.acc_s[e] + v.bias[c, v.wg]
            v.acc_s[e] = s
            cur[i] = cute.arch.fmax(cur[i], s)
        for i in cutlass.range_constexpr(2):
            cur[i] = cute.arch.warp_reduction_max(cur[i], threads_in_group=4) * scale_log2
            rows.row_max[i] = cute.arch.fmax(rows.row_max[i], cur[i])
        return cur

    @cute.jit
    def zero_tail_v(self, v, buf: cutlass.Constexpr, valid):
        """Nothing to zero: the gather zero-fills every row it does not read."""
        pass

    # ------------------------------------------------------------------ epilogue
    @cute.jit
    def token_epilogue(self, v, rows, bars, sSum, sTrueMax, outs, scale_log2, req, tile, max2, staged):
        """Normalise and write the token's rows: out (through the staging rows), lse and max_logits (natural
        log; +inf / -inf for a row with nothing valid); the sink scales out only."""
        wg, tid, row0 = v.wg, v.tid, rows.row0
        row_sum = rows.row_sum
        for i in cutlass.range_constexpr(2):
            row_sum[i] = cute.arch.warp_reduction_sum(row_sum[i], threads_in_group=4)
            if tid % 4 == 0:
                sSum[row0 + 8 * i, wg] = row_sum[i]
                sTrueMax[row0 + 8 * i, wg] = rows.row_max[i]
        bars.row_sum.arrive_and_wait()
        inv = cute.make_rmem_tensor((2,), cutlass.Float32)
        lse2 = cute.make_rmem_tensor((2,), cutlass.Float32)
        top = cute.make_rmem_tensor((2,), cutlass.Float32)
        for i in cutlass.range_constexpr(2):
            total = row_sum[i] + sSum[row0 + 8 * i, 1 - wg]
            top[i] = cute.arch.fmax(rows.row_max[i], sTrueMax[row0 + 8 * i, 1 - wg])
            inv[i] = 0.0
            lse2[i] = -cutlass.Float32.inf
            if total > 0.0:
                inv[i] = 1.0 / total
                lse2[i] = max2[i] + cute.math.log2(total, fastmath=False)
        if cutlass.const_expr(outs.sink is not None):
            for i in cutlass.range_constexpr(2):
                if row0 + 8 * i < tile.row_count:
                    inv[i] = inv[i] * sink_factor(outs.sink[tile.head_base + row0 + 8 * i] * LOG2_E, lse2[i])
        self.store_staged(v, inv, staged, outs.out, req, tile, wg * (D_V // 2))
        if wg == 0 and tid % 4 == 0:
            for i in cutlass.range_constexpr(2):
                r = row0 + 8 * i
                if r < tile.row_count:
                    lse = cutlass.Float32.inf
                    top_ln = -cutlass.Float32.inf
                    if lse2[i] != -cutlass.Float32.inf:
                        lse = lse2[i] * LN_2
                        top_ln = top[i] * LN_2
                    outs.lse[req, 0, tile.row_base + r] = lse
                    outs.max_logits[req, 0, tile.row_base + r] = top_ln

    # ------------------------------------------------------------------ the gather
    @cute.jit
    def gather(self, ld, rows, sBias, mKV, mIndices, mTopkLen, work, q_warp):
        """Every token's Q (first warp) and tiles, in the consumers' order, each buffer half once it is
        handed back (``dense_seesaw.produce``'s order: a token's first two tiles before its Q)."""
        free_phase = cute.make_rmem_tensor((4,), cutlass.Int32)
        free_phase.fill(1)
        q_phase = cute.make_rmem_tensor((1,), cutlass.Int32)
        q_phase[0] = 1
        src = RowSource(mKV, mIndices, cute.make_rmem_tensor((ROUNDS,), cutlass.Int32),
                        cute.make_rmem_tensor((ROUNDS,), cutlass.Int32))
        lens = TokenLengths.start(mTopkLen, work)
        lens.advance(mTopkLen, work, work.begin_req)
        src.load_indices(rows.row0, work.begin_req, 0, lens.current())
        for req in cutlass.range(work.begin_req, work.end_req + 1, unroll=1):
            first, last = work.blocks(req, lens.current())
            # (this token's length, the next token, its length): where the lookahead goes.
            ahead = (lens.current(), work.clamp(req + 1), lens.peek())
            if req == work.begin_req:
                self.load_q_when_free(ld, req, q_phase, q_warp)
            if first < last:
                self.gather_tile(ld, rows, src, sBias, 0, free_phase, req, first, last, ahead, q_warp)
            if first + 1 < last:
                self.gather_tile(ld, rows, src, sBias, 1, free_phase, req, first + 1, last, ahead, q_warp)
            if req != work.begin_req:
                self.load_q_when_free(ld, req, q_phase, q_warp)
            for blk in cutlass.range(first + 2, last, 2, unroll=1):
                self.gather_tile(ld, rows, src, sBias, 0, free_phase, req, blk, last, ahead, q_warp)
                if blk + 1 < last:
                    self.gather_tile(ld, rows, src, sBias, 1, free_phase, req, blk + 1, last, ahead, q_warp)
            if last <= first:
                # No tile: the lookahead still moves on to the next token's first tile.
                src.load_indices(rows.row0, ahead[1], 0, ahead[2])
            lens.advance(mTopkLen, work, req + 1)

    @cute.jit
    def load_q_when_free(self, ld, req, q_phase, q_warp):
        """Token ``req``'s Q (the first warp's TMA copy), once WG0 has handed back Q's bytes."""
        if q_warp:
            cute.arch.mbarrier_wait(ld.q_free_bar, q_phase[0])
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(ld.q_bar, self.q_bytes)
            cute.copy(ld.tma_atom_q, ld.tQgQ[None, ld.m_tile, 0, req], ld.tQsQ, tma_bar_ptr=ld.q_bar)
        q_phase[0] = q_phase[0] ^ 1

    @cute.jit
    def gather_tile(self, ld, rows, src, sBias, buf: cutlass.Constexpr, free_phase, req, blk, last, ahead, q_warp):
        """Tile ``blk`` of token ``req`` into buffer ``buf``, half by half as each is handed back, in the
        consumers' order; loads the indices of the thread's next tile meanwhile.  At a token's last tile the
        first warp pulls the next token's Q into L2: its load waits for this token's epilogue, and then reads
        L2 instead of memory."""
        if q_warp:
            if (blk + 1 == last) & (ahead[1] != req):
                with cute.arch.elect_one():
                    cute.prefetch(ld.tma_atom_q, ld.tQgQ[None, ld.m_tile, 0, ahead[1]])
        idx = cute.make_rmem_tensor((ROUNDS,), cutlass.Int32)
        ok = cute.make_rmem_tensor((ROUNDS,), cutlass.Int32)
        idx.store(src.next_idx.load())
        ok.store(src.next_ok.load())
        # The next tile's indices: this token's, or the next token's first.
        n_req, n_blk, n_limit = req, blk + 1, ahead[0]
        if blk + 1 >= last:
            n_req, n_blk, n_limit = ahead[1], cutlass.Int32(0), ahead[2]
        src.load_indices(rows.row0, n_req, n_blk, n_limit)
        order = (V_L_SUBS, V_R_SUBS) if buf == 0 else (V_R_SUBS, V_L_SUBS)
        issued = []
        for n, subtiles in enumerate(order):
            k = buf * 2 + half_of(subtiles)
            cute.arch.mbarrier_wait(ld.free_bar + k, free_phase[k])
            free_phase[k] = free_phase[k] ^ 1
            if cutlass.const_expr(n == 0):
                # The bias's reader (this buffer's S) is done with it: the first half's hand-back follows
                # that warpgroup's softmax.
                row0, lane = rows.row0, rows.lane
                if lane == 0:
                    for r in cutlass.range_constexpr(ROUNDS):
                        bias = -cutlass.Float32.inf
                        if ok[r] != 0:
                            bias = 0.0
                        sBias[row0 + ROWS_PER_PASS * r, buf] = bias
            for j in subtiles:
                if cutlass.const_expr(j in self.qk_subs):
                    for r in cutlass.range_constexpr(ROUNDS):
                        row = src.mKV[idx[r], None]
                        cp_async_16(rows.dst(r, buf, j), (row.iterator + (j * SUB + rows.lane * 8)), ok[r])
                    cute.arch.cp_async_commit_group()
                    issued.append(j)
        # Sub-tile by sub-tile as this thread's copies land: fence them for the consumers' WGMMA (async proxy;
        # cp.async writes through the generic one) and arrive.  The arrival also releases the bias written
        # above to the consumers, who read it after waiting for the tile.
        for n, j in enumerate(issued):
            cute.arch.cp_async_wait_group(len(issued) - 1 - n)
            cute.arch.fence_view_async_shared()
            cute.arch.mbarrier_arrive(ld.kv_bar + (buf * NUM_SUB + j))


# ---------------------------------------------------------------- device-side records


@cute.jit
def token_range(s_q, topk):
    """This CTA's query tokens: part p's even share of the s_q tokens (p the grid's x), each served whole (its
    lengths within [0, topk])."""
    part, _, _ = cute.arch.block_idx()
    num_parts, _, _ = cute.arch.grid_dim()
    begin = (part * s_q) // num_parts
    end = ((part + 1) * s_q) // num_parts
    return WorkSlice(begin, end - 1, 0, NO_END, 0, topk)


@dataclasses.dataclass
class TokenLengths:
    """The tokens' lengths (``topk_length`` clamped to [0, topk], or topk), loaded a token ahead."""

    lens: Any

    @staticmethod
    @cute.jit
    def start(mTopkLen, work) -> "TokenLengths":
        lens = cute.make_rmem_tensor((2,), cutlass.Int32)
        lens[1] = work.max_len
        if cutlass.const_expr(mTopkLen is not None):
            lens[1] = work.length(mTopkLen[work.clamp(work.begin_req)])
        return TokenLengths(lens)

    @cute.jit
    def advance(self, mTopkLen, work, req):
        """Token ``req``'s length (loaded a token ago); starts loading token ``req + 1``'s."""
        self.lens[0] = self.lens[1]
        if cutlass.const_expr(mTopkLen is not None):
            self.lens[1] = work.length(mTopkLen[work.clamp(req + 1)])
        return self.lens[0]

    @cute.jit
    def current(self):
        """The current token's length."""
        return self.lens[0]

    @cute.jit
    def peek(self):
        """The next token's length (loaded by the last ``advance``)."""
        return self.lens[1]


@dataclasses.dataclass
class RowCopies:
    """A gather thread's place in a tile: rows ``row0 + 16 r`` (r < 4), the 16 bytes at column ``8 lane`` of
    each 64-column block, and their swizzled offsets in stage 0 of the K buffers.

    The 128-byte swizzle XORs byte-offset bits [4, 7) with bits [7, 10); a stage and a column block are
    multiples of 1 KiB and the rows of a thread are 16 apart, so one offset per row serves every stage and
    column block."""

    k_base: Any
    row0: Any
    lane: Any
    offsets: Any  # (ROUNDS,) int32 element offsets in stage 0, column block 0

    @staticmethod
    @cute.jit
    def make(sK_layout, k_base, tid) -> "RowCopies":
        row0 = tid // LANES_PER_ROW
        lane = tid % LANES_PER_ROW
        offsets = cute.make_rmem_tensor((ROUNDS,), cutlass.Int32)
        for r in cutlass.range_constexpr(ROUNDS):
            b = cute.crd2idx((row0 + ROWS_PER_PASS * r, lane * 8, 0), sK_layout.outer) * 2
            offsets[r] = (b ^ ((b >> 3) & 0x70)) >> 1
        return RowCopies(k_base, row0, lane, offsets)

    @cute.jit
    def dst(self, r: cutlass.Constexpr, buf: cutlass.Constexpr, j: cutlass.Constexpr):
        return self.k_base + cute.assume(self.offsets[r] + (buf * STAGE_ELEMS + j * SUB_ELEMS), divby=8)


@dataclasses.dataclass
class RowSource:
    """The kv rows and indices, and the indices (clamped into range) and validity of the thread's next
    tile."""

    mKV: Any  # [s_kv, d_qk]
    mIndices: Any  # [s_q, topk]
    next_idx: Any
    next_ok: Any

    def load_indices(self, row0, req, blk, limit):
        """The thread's rows of tile ``blk`` of token ``req`` (``load_indices``)."""
        load_indices(self.mIndices, self.mKV.shape[0], self.next_idx, self.next_ok, row0, req, blk, limit)


@cute.jit
def load_indices(mIndices, s_kv, dst_idx, dst_ok, row0, req, blk, limit):
    """Into ``dst_idx`` / ``dst_ok`` the indices and validity of a gather thread's rows of tile ``blk`` of token
    ``req``: an index outside [0, s_kv), or a position at or past ``limit`` (the token's length), is invalid
    and reads row 0's address (zero-filled).  A function of plain values: the tracer rebinds the fields of
    records used inside a staged branch."""
    for r in cutlass.range_constexpr(ROUNDS):
        pos = blk * BLOCK_N + row0 + ROWS_PER_PASS * r
        idx = cutlass.Int32(-1)
        if pos < limit:
            idx = mIndices[req, pos]
        ok = cutlass.Int32(0)
        if (idx >= 0) & (idx < s_kv):
            ok = cutlass.Int32(1)
        dst_ok[r] = ok
        dst_idx[r] = idx * ok


@dataclasses.dataclass
class Gather:
    """The load warpgroup's barriers and Q's TMA copy."""

    tma_atom_q: Any
    tQgQ: Any  # ((64, d_qk) partitioned, m_tiles, 1, s_q)
    tQsQ: Any
    q_bar: Any
    kv_bar: Any
    free_bar: Any  # [buffer][half] hand-backs
    q_free_bar: Any
    m_tile: Any


@dataclasses.dataclass
class Outputs:
    out: Any  # (s_q, 1, h_q, 512)
    lse: Any  # (s_q, 1, h_q)
    max_logits: Any  # (s_q, 1, h_q)
    sink: Any = None


@dataclasses.dataclass
class GatherView(SeesawView):
    """The seesaw view and the tiles' bias ([token][buffer]: 0, or -inf for an invalid token)."""

    bias: Any = None


@cutlass.dsl_user_op
def cp_async_16(dst, src, valid, *, loc=None, ip=None):
    """cp.async.cg of 16 bytes from global ``src`` to shared ``dst``; ``valid`` 0: nothing is read and the 16
    bytes are zeroed (source size 0)."""
    size = (cutlass.Int32(valid) * PIECE).ir_value(loc=loc, ip=ip)
    nvvm.cp_async_shared_global(dst.to_llvm_ptr(loc=loc, ip=ip), src.to_llvm_ptr(loc=loc, ip=ip), 16,
                                nvvm.LoadCacheModifierKind.CG, cp_size=size, loc=loc, ip=ip)
