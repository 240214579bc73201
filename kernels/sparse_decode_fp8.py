"""Sparse MLA decode over the FP8 caches, split-KV, on Hopper (SM90a).

The cache format is the config's ``kv_format`` (``cache_rows.py``: a token's loads and dequantization); the
plan below is V32's (656-byte rows, d_qk 576, a bf16 RoPE block of 64 columns); the d_qk-512 formats
(V32_NO_ROPE, V4, V41, V41_PAGED) have no RoPE block (the same storage; Q and S span 512 columns, and V4's RoPE values
are columns 448-511, fp16), and give registers 152 / 192 / 160.  With ``extra_cache`` a request's tiles run
over its main tokens, then over the extra cache's (``sparse_tiles.py``): the producer's indices name rows of
either cache, the consumers see one request.  The extra cache has the main one's format, or V41_FP4 beside
V41 / V41_PAGED: a second codec, which dequantizes the extra tiles' rows.

Each query token attends to the ``topk`` cache rows its ``indices`` name.  One CTA serves
one (SM part, query token s, 64-head tile); its part of the batch comes from the split-KV
scheduler record over the requests' ``topk_length`` (64-token blocks), as in dense decode.

Warpgroup roles (384 threads):
  WG0      producer (all 128 threads).  Per 64-token tile each thread gathers 4 token rows (2 with the
           crossover): thread t reads 16-byte piece ``t % 8`` of each 128-byte segment of its rows
           (coalesced 128-byte reads, 6 per row: 4 latent, the scales, 1 RoPE), rows ``16 k + t / 8`` (with
           the crossover ``32 rank + 8 (t / 32) + (t % 32) / 8`` and 4 further: a warp's rows consecutive),
           dequantizes fp8 x scale to fp16 (the scale rounded to it: exact for the quantizer's power-of-two
           scales from 2^-15 to 2^7), keeps the RoPE values bf16, and stores the row into the swizzled K
           tile.  An invalid token (index -1 or outside the cache, or past ``topk_length``) is not read: its
           row is written as zeros and its score bias is -inf.  A thread loads all its rows of a tile before
           converting the first.  The next tile's indices are loaded while this tile is gathered, in the
           order of the part's tiles across its requests, so a request's first tile finds its indices
           loaded and its rows in L2.  Producer halves (crossover plans that are not small): warps 0-1
           gather the part's even tiles, warps 2-3 the odd ones, 4 rows a thread (``32 rank + 16 (u / 32) +
           (u % 32) / 8`` and 4 further, u the thread's index in its half), so two tiles' loads are in flight
           and a warp's fences wait only for its own half's.
  WG1, WG2 leader and follower (``leader_follower.py``): WG1 computes S over the whole tile, the softmax
           and O_L, and hands P to WG2, which computes O_R.  WG2's first warp also loads Q: the first
           request's at the start, each next one's once Q's bytes are free (after the staged output rows
           were copied out).
  Registers (setmaxnreg, within 168 x 384): 144 / 200 / 160; the d_qk-512 formats 152 / 192 / 160.

Shared-memory plan (bytes; "op" is the operand type, fp16, and the RoPE columns are bf16):
  sQ     64 x 576 op                      73 728  (the TMA writes bf16; Q's readers convert it in place,
                                                   ``QConversion``; after a request's last S, its final
                                                   rows or 16-bit partial, 64 x 520 bf16, which the
                                                   follower's threads copy out)
  sKV    2 x 64 x 576 op                  73 728 each (V is the first 512 columns of K)
  sP     64 x 64 op                        8 192
  sMax, sSum  [2][64] fp32                 1 024  (sMax holds the leader's factor and running max per row)
  sBias  2 x 64 fp32 (0 or -inf)             256 each
  mbarriers: Q full (TMA), KV full (128 producer arrivals, 64 with producer halves) /
  empty (256 consumer arrivals) per stage.

Crossover (where the 64-head tiles of a token pair: h_q = 128, 256):
a 2-CTA cluster along the grid's y.  Each CTA gathers rows ``32 rank .. 32 rank + 31`` of
every tile (2 per thread) and stores them locally; the peer gets them at the same offsets,
completing bytes on its KV full barrier (one of its 128 local arrivals also expects the
``PEER_TX_BYTES``).  The hand-over: a producer warp stores its
8 consecutive rows (16 with producer halves) piece by piece, and after each piece (two 64-column blocks)
fences, syncs and two lanes issue one ``cp.async.bulk`` shared::cluster copy each (the warp's rows of a
block: one 1 KiB swizzle atom, or two); the RoPE block and the rows' bias go last.  KV empty counts 512 arrivals
(both CTAs' consumers), because the peer writes into this CTA's stages.  Cluster barriers after
the barrier setup and before exit (the consumers arrive before their last epilogue).

Named barriers (consumers only; the producer syncs on mbarriers): ``barriers.SparseBarrier``
(``OUT_STAGED``: both halves of the final rows are in sQ; ``OUT_COPIED``: the follower has copied
them out); and ``Q_CONVERTED`` (the leader's 128 threads: Q is in the operand type).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass._mlir.dialects import llvm, nvvm
from cutlass.cute.typing import AddressSpace
from cutlass.memory import SmemAllocator

from ..schedules.configs import SparseSplitConfig
from .constants import BLOCK_M, BLOCK_N, D_QK, D_V
from .epilogue import StagedRows
from .layouts import make_q_pipeline, make_smem_layouts, operand_tiles, row_exchange, staged_rows_layout
from .serial_consumer import RopeQK, make_consumer_mmas
from .work import OutputTile, SplitOutputs, WorkSlice, load_splits
from .sparse_tiles import RequestLengths, TileCursor
from .layouts import lse_rows, out_rows
from .barriers import SparseBarrier
from .cache_rows import LATENT_PIECES, PIECE, ROPE_SLOT, SLOTS, WORDS, cache_rows
from .leader_follower import LeaderFollowerConsumer
from .seesaw import make_seesaw_mmas

SUB_COLS = 64  # features per swizzle-atom column block of a K tile
LANES_PER_ROW = 8  # threads sharing one row: 8 x 16 B = one 128-byte segment per load
ROWS_PER_ROUND = 128 // LANES_PER_ROW  # 16 rows per pass of the producer warpgroup
ROUNDS = BLOCK_N // ROWS_PER_ROUND  # 4 rows per thread per tile (2 with the crossover, 4 with producer halves)
STAGE_ELEMS = BLOCK_N * D_QK  # one K stage
LATENT_STEP = 2 * BLOCK_N * SUB_COLS  # from a thread's latent piece to its next: 128 columns, two column blocks
# Q enters the fp16 MMAs times 2^-4 (the softmax scale times 2^4 undoes it): every bf16 value of magnitude
# from 2^-13 to below 2^20 converts exactly (smaller ones are rounded to multiples of 2^-20).  2^-8 would
# reach 2^24 but round values below 2^-9, which measurably moved the outputs of small q against large K.
Q_PRESCALE = 2.0**-4
Q_LATENT_CHUNKS = BLOCK_M * D_V * 2 // PIECE  # Q's first 512 columns in 16-byte chunks (column blocks are contiguous)


class SparseDecodeFp8Kernel(LeaderFollowerConsumer):
    """Static configuration of one compiled sparse FP8 decode kernel."""

    num_threads = 384
    # setmaxnreg moves registers within the CTA's launch allocation (168 x 384 = 64512): the
    # three warpgroups' budgets must not exceed it, or an increase waits forever.
    launch_regs = 168
    # (producer, leader, follower), each a multiple of 8: the leader holds half of O, S of 64 tokens and
    # P; the follower only half of O, so the producer gets more.
    LEADER_FOLLOWER_REGS = (144, 200, 160)
    LEADER_FOLLOWER_REGS_512 = (152, 192, 160)

    def __init__(self, config: SparseSplitConfig):
        self.dtype = cutlass.BFloat16  # q, the cache's RoPE values and the output
        # The MMAs' operands (Q, K = V, P) are fp16, so Q's readers convert it in place; S's RoPE k-blocks
        # stay bf16 (``RopeQK``).
        self.operand_dtype = cutlass.Float16
        self.h_q = config.h_q
        self.s_q = config.s_q
        self.has_sink = config.has_sink
        # The cache format's token bytes and their dequantization (``cache_rows.py``); q's head dimension.
        self.rows = cache_rows(config.kv_format)
        self.d_qk = self.rows.d_qk
        self.q_chunks = BLOCK_M * self.d_qk * 2 // PIECE  # Q's bytes in 16-byte chunks
        # Crossover: bytes the peer CTA stores into this CTA's stage a tile (its 32 rows of 16-bit K, their bias).
        self.peer_tx_bytes = (BLOCK_N // 2) * (self.rows.tile_cols * 2 + 4)
        # The leader keeps each row's exact max for max_logits (prefill from the FP8 cache: whole requests).
        self.max_logits = config.max_logits
        self.extra_cache = bool(config.extra_cache)
        # The extra cache's codec: the main cache's format, or V41_FP4 beside V41 / V41_PAGED (a second codec,
        # picked per row: a tile is all main rows or all extra ones).
        self.extra_rows = cache_rows(config.extra_cache) if config.extra_cache else None
        self.two_codecs = bool(config.extra_cache) and config.extra_cache != config.kv_format
        self.head_tiles = config.head_tiles
        self.kv_stages = 2
        # The two 64-head tiles of a pair share every token tile (2-CTA cluster); each CTA hands the peer its
        # rows with bulk copies once each producer warp has stored them.
        self.crossover = config.crossover
        if self.crossover and self.head_tiles % 2:
            raise ValueError(f"the crossover pairs 64-head tiles: h_q = {self.h_q} has an odd number of them")
        self.peer_bulk = self.crossover
        # Producer halves: warps 0-1 gather the even tiles of the part, warps 2-3 the odd ones, so two tiles'
        # loads are in flight and each warp's fences wait only for its own.
        self.halves = bool(self.crossover and config.producer_halves)
        # Rows a producer thread gathers of each of its tiles: 4, 2 with the crossover (each CTA gathers half a
        # tile), 4 again with producer halves (half the threads a tile).
        self.rounds = ROUNDS // 2 if self.crossover and not self.halves else ROUNDS
        # Rows a producer thread loads before converting them: all of its rows of a tile (144 registers).
        # V41's (and V41_PAGED's) whole-tile gather converts two at a time (its per-lane ue8m0 scales spill at
        # four).  From two caches (the second cache's addresses) V32_NO_ROPE's converts two at a time (it spills
        # 60 bytes at four); V4's spills 28 bytes at four, 36 at two, and four (twice the loads in flight) measured
        # 1-3% faster.
        self.rows_in_flight = self.rounds
        if not self.crossover:
            self.rows_in_flight = self.rows.whole_tile_rows_in_flight
            if config.extra_cache:
                self.rows_in_flight = self.rows.two_cache_rows_in_flight
        self.stream_threads = 64 if self.halves else 128  # producer threads that gather one tile
        self.stream_warps = self.stream_threads // 32
        self.warp_rows = self.rounds * 32 // LANES_PER_ROW  # consecutive rows a producer warp hands over
        # The leader's S as one copy per stage (``leader_follower.leader_qk``): 0.4-1.3% on the
        # crossover's rows; the whole-tile gather's kernel spills with the copies (2% slower).
        self.qk_stage_copies = self.crossover and self.kv_stages == 2
        self.row_step = 4 if self.peer_bulk else ROWS_PER_ROUND  # between a thread's rows of a tile
        # The d_qk-512 formats' producers take 8 more registers (their whole-tile gathers spill at 144), from
        # the leader, whose S has no RoPE k-blocks.
        self.regs = self.LEADER_FOLLOWER_REGS if self.rows.rope_bf16 else self.LEADER_FOLLOWER_REGS_512
        assert 128 * sum(self.regs) <= self.launch_regs * self.num_threads
        # SplitKVConsumer facts: one query token per M tile, no causal mask.
        self.causal = False
        self.group = config.h_q

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [b, s_q, h_q, d_qk] bf16
        mCache: cute.Tensor,  # [num_blocks, page, row_bytes / 4] int32 (page-blocked: the data rows; scales follow)
        mIndices: cute.Tensor,  # [b, s_q, topk] int32
        mTopkLen: cute.Tensor,  # [b] int32, or None: every request attends to topk tokens
        mExtraCache: cute.Tensor,  # with ``extra_cache``: the extra cache's rows as mCache's, else None
        mExtraIndices: cute.Tensor,  # with ``extra_cache``: [b, s_q, extra_topk] int32, else None
        mExtraLen: cute.Tensor,  # with ``extra_cache``: [b] int32 (mTopkLen given too), else None
        mSched: cute.Tensor,  # [num_parts, 8] int32
        mNumSplits: cute.Tensor,  # [b + 1] int32
        mOut: cute.Tensor,  # [b, s_q, h_q, 512] bf16
        mLse: cute.Tensor,  # [b, h_q, s_q] fp32
        mOAccum: cute.Tensor,  # [b + num_parts, 1, s_q * h_q, 512] fp32
        mLseAccum: cute.Tensor,  # [b + num_parts, 1, s_q * h_q] fp32
        mSink: cute.Tensor,  # [h_q] fp32, or None
        mMaxLogits: cute.Tensor,  # [b, h_q, s_q] fp32 with ``config.max_logits``, else None
        scale_log2: cutlass.Float32,
        stream,
    ):
        if cutlass.const_expr((mMaxLogits is not None) != self.max_logits):
            raise ValueError(f"max_logits: the kernel is built with max_logits={self.max_logits}")
        if cutlass.const_expr((mExtraCache is not None) != self.extra_cache):
            raise ValueError(f"extra_cache: the kernel is built with extra_cache={self.extra_cache}")
        extra_scales = None
        if cutlass.const_expr(self.extra_cache):
            extra_scales = self.extra_rows.scale_view(mExtraCache)
        # (h_q, d_qk, s_q, b): feature-contiguous, as TMA wants; heads past h_q read as zeros.
        q = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[2, 3, 1, 0]))
        mma_qk_first, tiled_mma_qk, tiled_mma_pv = make_consumer_mmas(self.operand_dtype)
        # The K stages are 576 columns wide in every format (d_qk 512 leaves the last block unused); sQ is
        # d_qk wide, in storage for 576 (the staged output rows pass through it).
        sQ_layout, sK_layout, sV_layout, sP_layout = make_smem_layouts(self.operand_dtype, self.kv_stages,
                                                                       self.d_qk)
        q_storage = make_smem_layouts(self.operand_dtype, self.kv_stages)[0]
        tma_atom_q, tma_q = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), q, sQ_layout, (BLOCK_M, self.d_qk)
        )
        self.q_bytes = cute.size_in_bytes(self.dtype, sQ_layout)

        @cute.struct
        class SharedStorage:
            q_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            kv_mbar: cute.struct.MemRange[cutlass.Int64, self.kv_stages * 2]
            row_max: cute.struct.MemRange[cutlass.Float32, 2 * BLOCK_M]
            row_sum: cute.struct.MemRange[cutlass.Float32, 2 * BLOCK_M]
            bias: cute.struct.MemRange[cutlass.Float32, self.kv_stages * BLOCK_N]
            sQ: cute.struct.Align[cute.struct.MemRange[self.operand_dtype, cute.cosize(q_storage)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.operand_dtype, cute.cosize(sK_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[self.operand_dtype, cute.cosize(sP_layout)], 1024]

        self.shared_storage = SharedStorage

        num_parts = mSched.shape[0]
        mOut = out_rows(mOut, 1, self.h_q, self.s_q)
        mLse = lse_rows(mLse, 1, self.h_q, self.s_q)
        if cutlass.const_expr(self.max_logits):
            mMaxLogits = lse_rows(mMaxLogits, 1, self.h_q, self.s_q)
        self.kernel(
            mma_qk_first, tiled_mma_qk, tiled_mma_pv,
            tma_atom_q, tma_q,
            mCache, self.rows.scale_view(mCache), mIndices, mTopkLen,
            mExtraCache, extra_scales, mExtraIndices, mExtraLen, mSched,
            SplitOutputs(mNumSplits, mOut, mLse, mOAccum, mLseAccum, mSink, mMaxLogits),
            scale_log2,
            sQ_layout, sK_layout, sV_layout, sP_layout,
        ).launch(
            grid=[num_parts, self.s_q * self.head_tiles, 1],
            block=[self.num_threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=1,
            cluster=[1, 2 if self.crossover else 1, 1],
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
        mCache: cute.Tensor,
        mScales: cute.Tensor,  # a page-blocked format's scale rows (V4, V41_PAGED), else None
        mIndices: cute.Tensor,
        mTopkLen: cute.Tensor,
        mExtraCache: cute.Tensor,
        mExtraScales: cute.Tensor,
        mExtraIndices: cute.Tensor,
        mExtraLen: cute.Tensor,
        mSched: cute.Tensor,
        outs: SplitOutputs,
        scale_log2: cutlass.Float32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        part, m_tile, _ = cute.arch.block_idx()
        s_idx = m_tile // self.head_tiles
        head_tile = m_tile - s_idx * self.head_tiles
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        q_pipe = make_q_pipeline(storage, self.q_bytes)
        kv_pipe = pipeline.PipelineAsync.create(
            barrier_storage=storage.kv_mbar.data_ptr(),
            num_stages=self.kv_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.stream_threads),
            # With the crossover the peer's consumers release this CTA's stages too: the peer
            # producer writes into them.
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 512 if self.crossover else 256),
            defer_sync=True,
        )
        cute.arch.mbarrier_init_fence()
        rank = cutlass.Int32(0)
        if cutlass.const_expr(self.crossover):
            rank = cute.arch.block_idx_in_cluster()
            # The peer must see initialised barriers before it stores or arrives remotely.
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()

        sQ, sK, sV, sP = operand_tiles(storage, sQ_layout, sK_layout, sV_layout, sP_layout)
        sBias = storage.bias.get_tensor(cute.make_layout((BLOCK_N, self.kv_stages)))


        # The TMA writes Q as bf16; with fp16 operands its readers convert it in place (``QConversion``), and
        # the softmax scale takes back Q_PRESCALE.
        sQ_in = cute.make_tensor(cute.recast_ptr(storage.sQ.data_ptr(), sQ_layout.inner, dtype=self.dtype),
                                 sQ_layout.outer)
        q_load = QLoad.make(tma_atom_q, tma_q, sQ_in, q_pipe, head_tile, s_idx)
        # The cache's RoPE values stay bf16 in the K stages: S's RoPE k-blocks read them as such (``RopeQK``).
        sK_in = cute.make_tensor(cute.recast_ptr(storage.sK.data_ptr(), sK_layout.inner, dtype=self.dtype),
                                 sK_layout.outer)
        scale_log2 = scale_log2 * (1.0 / Q_PRESCALE)
        q_words = cute.make_tensor(cute.recast_ptr(storage.sQ.data_ptr(), dtype=cutlass.Int32),
                                   cute.make_layout((self.q_chunks * WORDS,)))
        # S's RoPE k-blocks (bf16) beside fp16 operands (V32): made outside the role branches, like the MMAs below.
        rope = None
        if cutlass.const_expr(self.rows.rope_bf16):
            rope = RopeQK(make_seesaw_mmas(self.dtype).qk, sQ_in, sK_in)
        # Made once, outside the role branches: both consumers' views use them.  Each role gets
        # its own record of the outputs: a branch may rebind the fields of what it is passed.
        lf_mmas = make_seesaw_mmas(self.operand_dtype)
        outs_lead, outs_follow = dataclasses.replace(outs), dataclasses.replace(outs)
        # Final rows leave through Q's bytes: Q is dead after a request's last S.  The follower's
        # threads copy them out (it has registers to spare; 64 bulk copies a request queued behind
        # the producer's hand-over copies in the TMA unit: 1.6-7% slower) and then its first warp
        # loads the next request's Q.
        staged = StagedRows(
            rows=cute.make_tensor(cute.recast_ptr(storage.sQ.data_ptr(), dtype=self.dtype), staged_rows_layout()),
            written=pipeline.NamedBarrier(barrier_id=int(SparseBarrier.OUT_STAGED), num_threads=256),
            issuer=1,
            copied=pipeline.NamedBarrier(barrier_id=int(SparseBarrier.OUT_COPIED), num_threads=128),
        )
        # The scheduler record is read after the register split, so neither role carries it
        # across the reallocation (it spilled otherwise).
        if wg_idx == 0:
            set_registers(self.regs[0], self.launch_regs)
            work = WorkSlice.of(mSched, part)
            lengths = self.request_lengths(mIndices, mTopkLen, mExtraIndices, mExtraLen)
            extra = None
            if cutlass.const_expr(self.extra_cache):
                extra = ExtraRows(mExtraCache, mExtraScales, mExtraIndices, mExtraCache.shape[1],
                                  mExtraCache.shape[0] * mExtraCache.shape[1])
            stores = StageStores(sK_layout, storage.sK.data_ptr(), storage.bias.data_ptr(), rank)
            self.produce(
                q_load, sBias, q_pipe, kv_pipe,
                mCache, mScales, mIndices, lengths, extra, s_idx, head_tile, work, warp_idx, tidx, stores,
            )
        else:
            sScale, sSum = row_exchange(storage)  # sScale: the leader's factor and max per row
            if wg_idx == 1:
                set_registers(self.regs[1], self.launch_regs)
                work = WorkSlice.of(mSched, part)
                lengths = self.request_lengths(mIndices, mTopkLen, mExtraIndices, mExtraLen)
                view = self.lf_view(lf_mmas, sQ, sK, sV, sP, 0, tidx % 128, rope)
                q_conv = QConversion(q_words, pipeline.NamedBarrier(barrier_id=int(SparseBarrier.Q_CONVERTED), num_threads=128))
                self.lead(view, sScale, sSum, sBias, q_load.full, q_conv, staged, kv_pipe, lengths,
                          outs_lead, scale_log2, s_idx, head_tile, work, rank)
            else:
                set_registers(self.regs[2], self.launch_regs)
                work = WorkSlice.of(mSched, part)
                lengths = self.request_lengths(mIndices, mTopkLen, mExtraIndices, mExtraLen)
                view = self.lf_view(lf_mmas, sQ, sK, sV, sP, 1, tidx % 128)
                self.follow(view, sScale, sSum, q_load, staged, kv_pipe, lengths, outs_follow,
                            scale_log2, s_idx, head_tile, work, rank)
        if cutlass.const_expr(self.crossover):
            # Neither CTA may exit while the peer can still store or arrive into its shared memory.
            # The consumers arrive before their last epilogue (``consume``), after their last
            # remote arrival, so the arrive's release does not wait for the epilogue's stores.
            if wg_idx == 0:
                cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    def request_lengths(self, mIndices, mTopkLen, mExtraIndices, mExtraLen) -> RequestLengths:
        """What each role reads of the requests' lengths; made inside the role's branch (as its ``WorkSlice``)."""
        if cutlass.const_expr(self.extra_cache):
            return RequestLengths(mTopkLen, mIndices.shape[2], mExtraLen, mExtraIndices.shape[2])
        return RequestLengths(mTopkLen, mIndices.shape[2])

    # -------------------------------------------------------------- gather producer
    @cute.jit
    def produce(
        self, q_load, sBias, q_pipe, kv_pipe,
        mCache, mScales, mIndices, lengths, extra, s_idx, head_tile, work, warp_idx, tidx, stores,
    ):
        page = mCache.shape[1]
        num_rows = mCache.shape[0] * page
        if cutlass.const_expr(extra is not None):
            # This token's extra indices ([b, extra_topk]).
            extra = dataclasses.replace(extra, mIndices=extra.mIndices[None, s_idx, None], lane=tidx % LANES_PER_ROW)
        lane = tidx % LANES_PER_ROW
        # With producer halves, half ``half`` takes the part's tiles n with n % 2 == half; ``stream``: the thread's
        # index among those that gather its tiles.
        half = cutlass.Int32(0)
        stream = tidx
        if cutlass.const_expr(self.halves):
            half = warp_idx // self.stream_warps
            stream = tidx % self.stream_threads
        # This thread's first row of a tile; its r-th is ``row_step`` r further.  With the bulk hand-over
        # a warp's rows are contiguous, so each of their 64-column blocks goes over in one copy;
        # otherwise a thread's rows are 16 apart, the same row of the 128-byte swizzle pattern.
        if cutlass.const_expr(self.peer_bulk):
            row0 = stores.rank * (BLOCK_N // 2) + (stream // 32) * self.warp_rows + (stream % 32) // LANES_PER_ROW
        else:
            row0 = stores.rank * (BLOCK_N // 2) + tidx // LANES_PER_ROW
        src = RowSource(mCache, mScales, mIndices, lengths, s_idx, row0, lane, page, num_rows, work, extra)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.kv_stages)
        gather = RowGather(
            raw=cute.make_rmem_tensor((WORDS, SLOTS, self.rows_in_flight), cutlass.Int32),
            valid=cute.make_rmem_tensor((self.rows_in_flight,), cutlass.Int32),
        )
        # The indices of the next tile are loaded while this tile's rows are gathered, so a tile
        # waits for one round trip to memory per batch of rows instead of two.  With the
        # crossover they run two tiles ahead, and the next tile's rows are prefetched into L2
        # while this tile's are on their way (the whole-tile gather has no registers for that).
        # The lookahead runs over the part's tiles in order, across requests, so a request's first
        # tiles do not wait for their indices and rows at the boundary.  A producer half looks ahead
        # over its own tiles.
        look = Lookahead(
            next_idx=cute.make_rmem_tensor((self.rounds,), cutlass.Int32),
            ahead_idx=cute.make_rmem_tensor((self.rounds,), cutlass.Int32),
            cursor=TileCursor.start(work, lengths),
        )
        if cutlass.const_expr(self.halves):
            if half == 1:
                look.cursor.advance(work, lengths)
        self.load_indices(look.next_idx, src, look.cursor)
        if cutlass.const_expr(self.crossover):
            self.advance_stream(look.cursor, src)
            self.load_indices(look.ahead_idx, src, look.cursor)
        lens = lengths.ahead(work)
        tile_no = cutlass.Int32(0)  # the part's tiles so far (producer halves)
        for req in cutlass.range(work.begin_req, work.end_req + 1, unroll=1):
            first, last = lengths.next(lens, work, req)
            for blk in cutlass.range(first, last, unroll=1):
                if cutlass.const_expr(self.halves):
                    if tile_no % 2 == half:
                        self.gather_tile(src, look, gather, kv_pipe, kv_state, stores, sBias, warp_idx, stream)
                    tile_no = tile_no + 1
                else:
                    self.gather_tile(src, look, gather, kv_pipe, kv_state, stores, sBias, warp_idx, stream)
                kv_state.advance()

    @cute.jit
    def advance_stream(self, cursor, src):
        """``cursor`` to this thread's next tile: the next one, or with producer halves the one after."""
        cursor.advance(src.work, src.lengths)
        if cutlass.const_expr(self.halves):
            cursor.advance(src.work, src.lengths)

    @cute.jit
    def gather_tile(self, src, look, gather, kv_pipe, kv_state, stores, sBias, warp_idx, stream):
        """Gather, dequantize and hand over this thread's rows of the tile whose indices ``look`` holds, into
        ``kv_state``'s stage; move the lookahead on by one of this thread's tiles."""
        row0, lane = src.row0, src.lane
        cur_idx = cute.make_rmem_tensor((self.rounds,), cutlass.Int32)
        cur_idx.store(look.next_idx.load())
        self.advance_stream(look.cursor, src)
        if cutlass.const_expr(self.crossover):
            look.next_idx.store(look.ahead_idx.load())
            self.load_indices(look.ahead_idx, src, look.cursor)
        else:
            self.load_indices(look.next_idx, src, look.cursor)
        if cutlass.const_expr(not self.crossover):
            # Whole-tile gather: loading first measured no faster here, and makes ptxas
            # spill in some configurations.
            kv_pipe.producer_acquire(kv_state)
        for g in cutlass.range_constexpr(self.rounds // self.rows_in_flight):
            for k in cutlass.range_constexpr(self.rows_in_flight):
                idx = cur_idx[g * self.rows_in_flight + k]
                ok = self.row_valid(src, idx)
                self.load_row(gather, k, src, idx, ok)
            if cutlass.const_expr(self.crossover and g == 0):
                # This thread's next tile, of this request or the next (past the part's last tile: -1).
                self.prefetch_rows(src, look.next_idx)
                # The rows are on their way while the consumers of both CTAs still use
                # the stage (1.04-1.05x).
                kv_pipe.producer_acquire(kv_state)
            if cutlass.const_expr(self.peer_bulk):
                # Piece by piece over the rows in flight: each two column blocks go to the peer
                # as soon as the warp has stored them.
                for m in cutlass.range_constexpr(LATENT_PIECES):
                    for k in cutlass.range_constexpr(self.rows_in_flight):
                        tok = row0 + self.row_step * (g * self.rows_in_flight + k)
                        self.store_latent(gather, k, m, tok, kv_state.index, lane, stores,
                                          kv_pipe.producer_get_barrier(kv_state))
                        if cutlass.const_expr(m == LATENT_PIECES - 1 and not self.rows.rope_bf16):
                            # V4's RoPE columns are the last block's: stored before it goes over.
                            self.store_rope(gather, k, sBias, tok, kv_state.index, lane, stores,
                                            kv_pipe.producer_get_barrier(kv_state))
                    self.hand_over(stores, kv_state.index, kv_pipe.producer_get_barrier(kv_state),
                                   warp_idx % self.stream_warps, stream % 32, 2 * m)
                if cutlass.const_expr(self.rows.rope_bf16):
                    for k in cutlass.range_constexpr(self.rows_in_flight):
                        tok = row0 + self.row_step * (g * self.rows_in_flight + k)
                        self.store_rope(gather, k, sBias, tok, kv_state.index, lane, stores,
                                        kv_pipe.producer_get_barrier(kv_state))
            else:
                # Row by row: the whole-tile gather (no crossover), piece after piece of each row.
                for k in cutlass.range_constexpr(self.rows_in_flight):
                    tok = row0 + self.row_step * (g * self.rows_in_flight + k)
                    for m in cutlass.range_constexpr(LATENT_PIECES):
                        self.store_latent(gather, k, m, tok, kv_state.index, lane, stores,
                                          kv_pipe.producer_get_barrier(kv_state))
                    self.store_rope(gather, k, sBias, tok, kv_state.index, lane, stores,
                                    kv_pipe.producer_get_barrier(kv_state))
        if cutlass.const_expr(self.peer_bulk):
            # The RoPE block (V32) and the bias.
            self.hand_over(stores, kv_state.index, kv_pipe.producer_get_barrier(kv_state),
                           warp_idx % self.stream_warps, stream % 32, 2 * LATENT_PIECES,
                           0 if self.rows.rope_bf16 else 1)
        else:
            # The consumers read the tile with WGMMA (async proxy).
            cute.arch.fence_view_async_shared()
        if cutlass.const_expr(self.crossover):
            # One of the arrivals also expects the peer's bytes (its stores or copies complete them).
            if stream == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(kv_pipe.producer_get_barrier(kv_state), self.peer_tx_bytes)
            else:
                kv_pipe.producer_commit(kv_state)
        else:
            kv_pipe.producer_commit(kv_state)

    @cute.jit
    def load_indices(self, dst, src, at):
        """The cache indices of this thread's rows of the tile ``at`` (a ``TileCursor``) points to (-1 past
        the request's length, and past the part's last tile; positions past topk, when topk is not a
        multiple of 64, are never read).  With an extra cache a request's tiles past its main tokens' take
        the extra indices, as ids ``num_rows + e`` (an index out of its cache's range becomes -1)."""
        req, blk, limit = at.pos[0], at.pos[1], at.pos[3]
        if cutlass.const_expr(src.extra is None):
            for r in cutlass.range_constexpr(self.rounds):
                pos = blk * BLOCK_N + src.row0 + self.row_step * r
                dst[r] = -1
                if pos < limit:
                    dst[r] = src.mIndices[req, src.s_idx, pos]
        else:
            main_len = at.pos[4]
            main_tiles = (main_len + BLOCK_N - 1) // BLOCK_N
            extra_blk = blk - main_tiles
            for r in cutlass.range_constexpr(self.rounds):
                row = src.row0 + self.row_step * r
                dst[r] = -1
                if extra_blk < 0:
                    if blk * BLOCK_N + row < main_len:
                        idx = src.mIndices[req, src.s_idx, blk * BLOCK_N + row]
                        if (idx >= 0) & (idx < src.num_rows):
                            dst[r] = idx
                else:
                    if extra_blk * BLOCK_N + row < limit - main_tiles * BLOCK_N:
                        idx = src.extra.mIndices[req, extra_blk * BLOCK_N + row]
                        if (idx >= 0) & (idx < src.extra.num_rows):
                            dst[r] = idx + src.num_rows

    @cute.jit
    def row_valid(self, src, idx):
        """Whether a tile's index names a row: in [0, rows of the cache) (with an extra cache ``load_indices``
        has checked each against its own cache and left -1 for the rest)."""
        ok = idx >= 0
        if cutlass.const_expr(src.extra is None):
            ok = (idx >= 0) & (idx < src.num_rows)
        return ok

    @cute.jit
    def prefetch_rows(self, src, idx_regs):
        """Pull this thread's rows of a later tile into L2: lane l the 128-byte line at byte 128 l of each
        row (lanes 6 and 7 its last byte's line, which a row not aligned to 128 bytes reaches)."""
        for r in cutlass.range_constexpr(self.rounds):
            idx = idx_regs[r]
            if self.row_valid(src, idx):
                word = cutlass.min(src.lane * (128 // 4), self.rows.row_words - 1)
                if cutlass.const_expr(src.extra is None):
                    blk_id = idx // src.page
                    row = src.mCache[blk_id, idx - blk_id * src.page, None]
                    cute.arch.prefetch((row.iterator + word).llvm_ptr, cache_level="L2")
                else:
                    if idx < src.num_rows:
                        blk_id = idx // src.page
                        row = src.mCache[blk_id, idx - blk_id * src.page, None]
                        cute.arch.prefetch((row.iterator + word).llvm_ptr, cache_level="L2")
                    else:
                        e = idx - src.num_rows
                        blk_id = e // src.extra.page
                        row = src.extra.mCache[blk_id, e - blk_id * src.extra.page, None]
                        extra_word = cutlass.min(src.lane * (128 // 4), self.extra_rows.row_words - 1)
                        cute.arch.prefetch((row.iterator + extra_word).llvm_ptr, cache_level="L2")

    @cute.jit
    def load_row(self, gather, k, src, idx, ok):
        """Start the 16-byte loads of this thread's share of cache token ``idx`` (V32: six; ``cache_rows.py``);
        nothing for an invalid token (``ok`` false).

        The run-time branches store through local names only.  A store through ``gather``'s fields in one
        (``gather.valid[k] = 1``) makes the DSL carry ``gather`` out of the branch and rebind the fields of the
        caller's record to the branch's results: values inside the branch's region, which a second instantiation
        of the gather elsewhere (a loop over the other cache's tiles) cannot use ("operand #0 does not dominate
        this use")."""
        raw, valid = gather.raw, gather.valid
        valid[k] = 0
        for j in cutlass.range_constexpr(SLOTS):
            for w in cutlass.range_constexpr(WORDS):
                raw[w, j, k] = 0
        if ok:
            valid[k] = 1
            if cutlass.const_expr(src.extra is None):
                blk_id = idx // src.page
                self.rows.load(raw, k, src, blk_id, idx - blk_id * src.page)
            else:
                if idx < src.num_rows:
                    blk_id = idx // src.page
                    self.rows.load(raw, k, src, blk_id, idx - blk_id * src.page)
                else:
                    e = idx - src.num_rows
                    blk_id = e // src.extra.page
                    self.extra_rows.load(raw, k, src.extra, blk_id, e - blk_id * src.extra.page)
                    valid[k] = 2  # an extra row: with two codecs, the extra one dequantizes it

    @cute.jit
    def hand_over(self, stores, stage, full_bar, warp, lane_w, first, skip: cutlass.Constexpr = 0):
        """Bulk hand-over of the warp's stored rows: column blocks ``first`` and ``first + 1`` (or, for the
        RoPE block, the block and the rows' bias), one copy per lane; ``skip``: 1 leaves the first out (no
        RoPE block).  The stores are generic-proxy writes that the copies and WGMMA read through the async
        proxy: fence, then the warp's sync."""
        cute.arch.fence_view_async_shared()
        cute.arch.sync_warp()
        if (lane_w >= skip) & (lane_w < 2):
            # Through the class: a method call on ``stores`` in a run-time branch would rebind the caller's
            # record to the branch's results (``load_row``).
            StageStores.copy_warp_block(stores, stage, full_bar, warp, self.warp_rows, first + lane_w)

    @cute.jit
    def store_latent(self, gather, k, m, tok, stage, lane, stores, full_bar):
        """Dequantize latent piece ``m`` of this thread's share of a row into the K tile (zeros for an invalid
        token).  The scale is rounded to the operand type
        and multiplied in it (bf16: as FlashMLA does): exact for the quantizer's power-of-two scales (in fp16
        within the range the module docstring states), and one multiply per two values."""
        if cutlass.const_expr(self.rows.piece_lanes(m) == LANES_PER_ROW):
            self.store_piece(gather, k, m, tok, stage, lane, stores)
        else:
            if lane < self.rows.piece_lanes(m):
                self.store_piece(gather, k, m, tok, stage, lane, stores)

    @cute.jit
    def store_piece(self, gather, k, m, tok, stage, lane, stores):
        raw = gather.raw
        piece = cute.make_rmem_tensor((PIECE,), self.operand_dtype)
        if cutlass.const_expr(self.two_codecs):
            if gather.valid[k] == 2:
                piece.store(self.extra_rows.piece(raw, k, m, lane, self.operand_dtype))
            else:
                piece.store(self.rows.piece(raw, k, m, lane, self.operand_dtype))
        else:
            piece.store(self.rows.piece(raw, k, m, lane, self.operand_dtype))
        words = cute.recast_tensor(piece, cutlass.Int32)
        for h in cutlass.range_constexpr(2):
            # The swizzled offset of the thread's first piece: the others are whole blocks further.
            off = stores.offset(tok, lane * PIECE + h * (PIECE // 2)) + m * LATENT_STEP
            stores.store_local(off, stage, words, 4 * h)

    @cute.jit
    def store_rope(self, gather, k, sBias, tok, stage, lane, stores, full_bar):
        """This thread's RoPE piece of a row, where the format has one (bf16 as the cache holds it beside the
        latent's operand type for V32's S-only RoPE block; V4's, which V reads, in the operand type), and
        (lane 0) the row's bias: 0, or -inf for an invalid token."""
        if cutlass.const_expr(self.rows.rope_col is not None):
            rope = gather.raw[None, ROPE_SLOT, k]
            off = stores.offset(tok, self.rows.rope_col + (PIECE // 2) * lane)
            if cutlass.const_expr(self.rows.rope_bf16):
                stores.store_local(off, stage, rope, 0)
            else:
                vals = cute.make_rmem_tensor((PIECE // 2,), self.operand_dtype)
                vals.store(cute.recast_tensor(rope, cutlass.BFloat16).load().to(self.operand_dtype))
                stores.store_local(off, stage, cute.recast_tensor(vals, cutlass.Int32), 0)
        if lane == 0:
            bias = -cutlass.Float32.inf
            if gather.valid[k] != 0:
                bias = 0.0
            sBias[tok, stage] = bias

    # ------------------------------------------------------------- consumers
    @cute.jit
    def lead(self, v, sScale, sSum, sBias, q_full, q_conv, staged, kv_pipe, lengths, outs, scale_log2, s_idx,
             head_tile, work, rank):
        """The leader (``leader_follower.py``): S, softmax and O_L of every tile, P for the follower; the
        only reader of Q, which arrives on ``q_full`` once a request (``follow`` loads it)."""
        rows, _, kv_state, tile = self.consumer_state(v, s_idx, head_tile)
        bars = self.lf_barriers()
        # The follower frees sP after every tile but this CTA's last: wait from the second tile on.
        seen = cute.make_rmem_tensor((1,), cutlass.Int32)
        seen[0] = 0
        q_phase = cute.make_rmem_tensor((1,), cutlass.Int32)
        q_phase[0] = 0
        lens = lengths.ahead(work)
        for req in cutlass.range(work.begin_req, work.end_req + 1, unroll=1):
            first, last = lengths.next(lens, work, req)
            splits = load_splits(outs, req)
            self.start_rows(v, rows)
            cute.arch.mbarrier_wait(q_full, q_phase[0])
            q_phase[0] = q_phase[0] ^ 1
            q_conv.run(v.tid, self.q_chunks)
            for blk in cutlass.range(first, last, unroll=1):
                self.wait_stage(kv_pipe, kv_state)
                self.leader_qk(v, kv_state.index)
                alpha = self.leader_softmax(v, rows, BiasMask(sBias, kv_state.index, 0), scale_log2)
                # O_L's update goes to the tensor cores before the wait for the follower.
                self.leader_pv(v, kv_state.index)
                if seen[0] != 0:
                    bars.p_free.arrive_and_wait()
                seen[0] = 1
                self.leader_publish(v, rows, sScale, alpha)
                bars.p_ready.arrive()
                warpgroup.wait_group(0)
                self.release_stage(kv_pipe, kv_state, rank)
                kv_state.advance()
            self.exit_arrive_after(req, work)
            self.epilogue(v, rows, bars.epilogue, sSum, outs, work, scale_log2, req, tile, splits=splits,
                          staged=staged)
        self.exit_arrive_if_idle(work)

    @cute.jit
    def follow(self, v, sScale, sSum, q_load, staged, kv_pipe, lengths, outs, scale_log2, s_idx,
               head_tile, work, rank):
        """The follower: O_R of every tile from the leader's P.  Its first warp also loads the leader's Q:
        the first request's at the start, each next one's once the follower's threads have copied the
        staged rows out of Q's bytes (the leader's last S of a request precedes the P the follower waits
        for), prefetched into L2 at the start of the request's last tile."""
        rows, _, kv_state, tile = self.consumer_state(v, s_idx, head_tile)
        if v.tid < 32:
            if work.begin_req <= work.end_req:
                q_load.copy(work.begin_req, self.q_bytes)
        bars = self.lf_barriers()
        lens = lengths.ahead(work)
        for req in cutlass.range(work.begin_req, work.end_req + 1, unroll=1):
            first, last = lengths.next(lens, work, req)
            splits = load_splits(outs, req)
            self.start_rows(v, rows)
            for blk in cutlass.range(first, last, unroll=1):
                if v.tid < 32:
                    if (blk + 1 == last) & (req < work.end_req):
                        q_load.prefetch(req + 1)
                bars.p_ready.arrive_and_wait()
                self.wait_stage(kv_pipe, kv_state)  # already full: the leader read this stage
                self.follower_pv(v, rows, sScale, kv_state.index)
                self.release_stage(kv_pipe, kv_state, rank)
                kv_state.advance()
                if blk + 1 < last:
                    bars.p_free.arrive()
            self.exit_arrive_after(req, work)
            # The next Q goes into Q's bytes once nothing reads them: here (the leader's last S came
            # before the P this warpgroup waited for) when the rows leave from registers (a split's fp32
            # partials); after the copies of the staged rows otherwise (final rows, 16-bit partials).
            n_splits = splits[1] - splits[0]
            fp32_partials = outs.o_accum.element_type == cutlass.Float32
            if cutlass.const_expr(fp32_partials):
                if v.tid < 32:
                    if (req < work.end_req) & (n_splits != 1):
                        q_load.copy(req + 1, self.q_bytes)
            self.epilogue(v, rows, bars.epilogue, sSum, outs, work, scale_log2, req, tile, splits=splits,
                          staged=staged)
            load_after = req < work.end_req
            if cutlass.const_expr(fp32_partials):
                load_after = load_after & (n_splits == 1)
            if v.tid < 32:  # after the warpgroup met at OUT_COPIED
                if load_after:
                    cute.arch.sync_warp()  # the copy elects a lane of a converged warp
                    q_load.copy(req + 1, self.q_bytes)
            # A request's last P_FREE waits for the epilogue: the leader's next sums go into sSum.
            if (req != work.end_req) & (last > first):
                bars.p_free.arrive()
        self.exit_arrive_if_idle(work)

    @cute.jit
    def exit_arrive_after(self, req, work):
        """With the crossover, after the part's last tile (request ``req`` the last): arrive on the exit
        cluster barrier (see ``kernel``).  No remote access follows, and arriving before the epilogue
        keeps the arrive's release from waiting for the epilogue's stores."""
        if cutlass.const_expr(self.crossover):
            if req == work.end_req:
                cute.arch.cluster_arrive()

    @cute.jit
    def exit_arrive_if_idle(self, work):
        """With the crossover, a part with no request still arrives on the exit cluster barrier."""
        if cutlass.const_expr(self.crossover):
            if work.begin_req > work.end_req:
                cute.arch.cluster_arrive()

    @cute.jit
    def consumer_state(self, v, s_idx, head_tile):
        """A consumer thread's rows, its Q and KV pipeline states and its output tile."""
        head0 = head_tile * BLOCK_M
        rows = self.row_state(0, v.tid)
        if cutlass.const_expr(self.max_logits):
            rows = dataclasses.replace(rows, exact_max=cute.make_rmem_tensor((2,), cutlass.Float32))
        return (
            rows,
            pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1),
            pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.kv_stages),
            OutputTile(0, s_idx * self.h_q + head0, self.h_q - head0, head0),
        )

    @cute.jit
    def wait_stage(self, kv_pipe, kv_state):
        """Wait until the stage is full; with the crossover the peer's half arrived through the cluster,
        and WGMMA reads it through the async proxy."""
        kv_pipe.consumer_wait(kv_state)
        if cutlass.const_expr(self.crossover):
            cute.arch.fence_view_async_shared()

    @cute.jit
    def release_stage(self, kv_pipe, kv_state, rank):
        """This thread is done with the stage (the caller advances the state); with the crossover the
        peer's producer writes into it too, so the peer's barrier hears it as well."""
        kv_pipe.consumer_release(kv_state)
        if cutlass.const_expr(self.crossover):
            cute.arch.mbarrier_arrive(kv_pipe.consumer_get_barrier(kv_state), 1 - rank)


@dataclasses.dataclass
class QConversion:
    """Q's bytes, which the TMA fills with bf16, turned in place into the MMAs' operands times ``Q_PRESCALE``
    (the latent block fp16, the RoPE block bf16) by the threads that read Q (the leader) before their first S
    of a request."""

    words: Any  # Q's bytes as int32, flat: the conversion is element-wise, so the swizzle does not matter
    done: Any  # named barrier over the converting threads (its thread count splits the chunks)

    @cute.jit
    def run(self, tid, chunks: cutlass.Constexpr):
        """``tid``: the thread's index among ``done``'s threads; ``chunks``: Q's 16-byte chunks (d_qk 576: the
        last 64 columns' are the bf16 RoPE block)."""
        threads = self.done.num_threads
        # The first 512 columns into fp16; V32's RoPE block stays bf16 (S's RoPE k-blocks are bf16 MMAs), scaled
        # alike.
        for i in cutlass.range(Q_LATENT_CHUNKS // threads, unroll=4):
            self.convert(tid + threads * i, cutlass.Float16)
        if cutlass.const_expr(chunks > Q_LATENT_CHUNKS):
            for i in cutlass.range((chunks - Q_LATENT_CHUNKS) // threads, unroll=4):
                self.convert(Q_LATENT_CHUNKS + tid + threads * i, cutlass.BFloat16)
        cute.arch.fence_view_async_shared()  # the WGMMAs read Q through the async proxy
        self.done.arrive_and_wait()

    @cute.jit
    def convert(self, c, dtype: cutlass.Constexpr):
        chunk = cute.local_tile(self.words, (WORDS,), (c,))
        raw = cute.make_rmem_tensor((WORDS,), cutlass.Int32)
        cute.autovec_copy(chunk, raw)
        vals = cute.recast_tensor(raw, cutlass.BFloat16).load().to(cutlass.Float32) * Q_PRESCALE
        out = cute.make_rmem_tensor((2 * WORDS,), dtype)
        out.store(vals.to(dtype))
        cute.autovec_copy(cute.recast_tensor(out, cutlass.Int32), chunk)


@dataclasses.dataclass
class QLoad:
    """The TMA load of a request's Q tile (64 heads x 576 of token ``s_idx``), completing on ``full``."""

    atom: Any
    tQgQ: Any  # ((64, 576) partitioned, head_tiles, 1, s_q, b)
    tQsQ: Any
    full: Any
    head_tile: Any
    s_idx: Any

    @staticmethod
    def make(tma_atom_q, tma_q, sQ, q_pipe, head_tile, s_idx) -> "QLoad":
        gQ = cute.flat_divide(tma_q, (BLOCK_M, cute.size(sQ, mode=[1])))
        tQsQ, tQgQ = cpasync.tma_partition(
            tma_atom_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2)
        )
        full = q_pipe.producer_get_barrier(pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1))
        return QLoad(tma_atom_q, tQgQ, tQsQ, full, head_tile, s_idx)

    @cute.jit
    def copy(self, req, expect_bytes: cutlass.Constexpr = 0):
        """Request ``req``'s Q.  Called by a whole warp: the TMA copy elects one lane of a converged warp.
        After the Q pipeline's ``producer_acquire``, which expects the bytes itself, ``expect_bytes`` is
        0; otherwise lane 0 arrives expecting them."""
        if cutlass.const_expr(expect_bytes > 0):
            if cute.arch.lane_idx() == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(self.full, expect_bytes)
        cute.copy(self.atom, self.tQgQ[None, self.head_tile, 0, self.s_idx, req], self.tQsQ, tma_bar_ptr=self.full)

    @cute.jit
    def prefetch(self, req):
        """Request ``req``'s Q into L2 (one lane of the calling warp).  Issued as the follower begins the
        previous request's last tile, a few microseconds before the load at the boundary, which then
        reads L2 instead of memory (about 1% at four requests a part; earlier, at a request's start, the
        gathered rows would evict it)."""
        with cute.arch.elect_one():
            cute.prefetch(self.atom, self.tQgQ[None, self.head_tile, 0, self.s_idx, req])


@dataclasses.dataclass
class RowSource:
    """Where a producer thread's rows come from: the cache, the indices of token ``s_idx`` of the part's
    requests (``work``), and the thread's place in a tile (first row ``row0``, 16-byte piece ``lane``)."""

    mCache: Any  # [num_blocks, page, row words] int32
    scales: Any  # a page-blocked format's scale rows [num_blocks, page, words] int32, else None
    mIndices: Any
    lengths: Any  # ``RequestLengths``
    s_idx: Any
    row0: Any
    lane: Any
    page: Any
    num_rows: Any  # num_blocks x page: an index at or past it is out of range (the extra cache's rows follow)
    work: Any
    extra: Any = None  # ``ExtraRows``, or None


@dataclasses.dataclass
class ExtraRows:
    """The extra cache (its own format, page size and blocks): its rows, scales (page-blocked formats),
    this token's indices and its row count; ``lane`` as the main source's.  Its row ``e`` is id
    ``num_rows + e`` in a tile's indices (``num_rows``: the main cache's)."""

    mCache: Any
    scales: Any
    mIndices: Any
    page: Any
    num_rows: Any
    lane: Any = None


@dataclasses.dataclass
class Lookahead:
    """The producer thread's indices ahead of its current tile: its next tile's (``next_idx``) and, with the
    crossover, the one after (``ahead_idx``), which ``cursor`` points to."""

    next_idx: Any
    ahead_idx: Any
    cursor: Any


@dataclasses.dataclass
class RowGather:
    """Registers of the rows a producer thread has in flight: raw bytes and validity."""

    raw: Any  # (4, 6, rows in flight) int32: 16 bytes each of 4 latent pieces, the scales, 1 RoPE piece
    valid: Any  # (rows in flight,) int32


@dataclasses.dataclass
class BiasMask:
    """Adds the tile's per-token bias (0, or -inf for an invalid token) to the scores."""

    bias: Any
    stage: Any
    offset: Any  # first token of the warpgroup's 32

    @cute.jit
    def apply(self, s, c, i):
        return s + self.bias[self.offset + c, self.stage]


@dataclasses.dataclass
class StageStores:
    """The producer's stores into the swizzled K stages: this CTA's, and with the crossover the peer CTA's
    at the same byte offsets (bulk copies of each producer warp's rows).

    The 128-byte swizzle XORs byte-offset bits [4, 7) with bits [7, 10).  A stage (73 728 bytes) and a
    64-column block (8 KiB) are multiples of 1 KiB, so a row's swizzled offsets in stage 0 hold in every
    stage and column block: a thread computes them once per row, not once per store."""

    sK_layout: Any  # the swizzled K layout (the swizzle is applied here, on byte offsets)
    k_base: Any  # pointer to this CTA's K stages, in the operand type
    bias_base: Any  # fp32 pointer to this CTA's bias
    rank: Any  # this CTA's rank in the cluster (the peer is 1 - rank)

    @cute.jit
    def offset(self, tok, col):
        """Element offset of K[tok, col : col + 8] in stage 0."""
        b = cute.crd2idx((tok, col, 0), self.sK_layout.outer) * 2
        return (b ^ ((b >> 3) & 0x70)) >> 1

    @cute.jit
    def store_local(self, off, stage, words, w0):
        """words[w0 : w0 + 4] (8 16-bit values) at element ``off`` of this CTA's stage."""
        dst = cute.make_tensor(
            cute.recast_ptr(self.k_base + cute.assume(off + stage * STAGE_ELEMS, divby=8), dtype=cutlass.Int32),
            cute.make_layout((WORDS,)),
        )
        cute.autovec_copy(cute.local_tile(words, (WORDS,), (w0 // WORDS,)), dst)

    @cute.jit
    def copy_warp_block(self, stage, full_bar, warp, rows: cutlass.Constexpr, j):
        """Copy the ``rows`` (8 or 16) rows of producer warp ``warp`` (32 rank + rows warp onwards: whole 8-row
        swizzle atoms, swizzled the same way in both CTAs) of column block ``j`` into the same bytes of the
        peer's stage, completing bytes on the peer's ``full_bar``; j = 9: the rows' bias."""
        row = self.rank * (BLOCK_N // 2) + rows * warp
        if j < D_QK // SUB_COLS:
            off = cute.crd2idx((row, j * SUB_COLS, stage), self.sK_layout.outer)
            bulk_copy_to_peer(self.k_base + cute.assume(off, divby=512), full_bar, rows * SUB_COLS * 2, 1 - self.rank)
        else:
            bulk_copy_to_peer(self.bias_base + cute.assume(stage * BLOCK_N + row, divby=8), full_bar, rows * 4,
                              1 - self.rank)


def set_registers(count: int, launch: int) -> None:
    """setmaxnreg to ``count`` for the calling warpgroup (nothing when it is the launch count)."""
    if count > launch:
        cute.arch.setmaxregister_increase(count)
    elif count < launch:
        cute.arch.setmaxregister_decrease(count)


@cutlass.dsl_user_op
def bulk_copy_to_peer(src, mbar, nbytes: int, peer_rank, *, loc=None, ip=None):
    """cp.async.bulk from this CTA's shared memory at ``src`` to the same offset in CTA ``peer_rank`` of
    the cluster, completing ``nbytes`` on the peer's copy of barrier ``mbar``."""
    dsmem = llvm.PointerType.get(AddressSpace.dsmem)
    rank = cutlass.Int32(peer_rank).ir_value(loc=loc, ip=ip)
    src_ptr = src.to_llvm_ptr(loc=loc, ip=ip)
    dst = nvvm.mapa(dsmem, src_ptr, rank, loc=loc, ip=ip)
    bar = nvvm.mapa(dsmem, mbar.to_llvm_ptr(loc=loc, ip=ip), rank, loc=loc, ip=ip)
    # The op's verifier wants the barrier in the shared state space (the PTX names it in the
    # cluster's window all the same).
    bar = llvm.addrspacecast(llvm.PointerType.get(AddressSpace.smem), bar, loc=loc, ip=ip)
    nvvm.cp_async_bulk_shared_cluster_shared_cta(
        dst, src_ptr, bar, cutlass.Int32(nbytes).ir_value(loc=loc, ip=ip), loc=loc, ip=ip
    )
