"""The split-KV consumer shared by the decode kernels: two warpgroups, one 64-row M tile.

Per 64-token KV tile in shared memory (K-major 64 x 576; V is the MN-major view of its
first 512 columns): consumer warpgroup c computes S_c = Q K[32c : 32c+32]^T (64 x 32,
WGMMA), the two share the row max through shared memory (``BarrierId.ROW_MAX``), write
P_c (16-bit) into columns 32c..32c+31 of sP, and after ``BarrierId.P_READY`` compute
O_c = O_c * alpha + P V[:, 256c : 256c+256] (64 x 256 fp32 accumulator).  The halves of
the output never meet: each warpgroup writes its 256 columns.

What differs between kernels is where the tiles come from (the producer) and which scores
are masked: a kernel passes a mask record (``LengthMask``, or the sparse kernel's bias
mask) to ``online_softmax``.  The epilogue writes final rows (FlashMLA's layouts, through
``layouts.py``) or fp32 partials with a base-2 lse for the combine kernel, optionally
scaled by an attention sink.  Final rows leave from registers, or (``StagedRows``: the sparse
leader-follower and the dense seesaw kernels) through shared memory: under a busy memory system
64 stores per thread took 4-8 us and held up the loads of the next request's tiles.  From the
staging rows the dense kernel issues one bulk copy per row; the sparse kernel's follower copies
them with 16-byte loads and stores, because its TMA unit also carries the producer's hand-over
copies, behind which 64 bulk copies a request waited.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass._mlir.dialects import nvvm
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum

D_QK = 576
D_V = 512
BLOCK_M = 64  # query rows per CTA: one WGMMA M
BLOCK_N = 64  # tokens per KV tile
HALF_N = BLOCK_N // 2  # tokens of S per consumer warpgroup
HALF_V = D_V // 2  # output columns per consumer warpgroup
MMA_K = 16  # features per WGMMA k-block (16-bit operands)
ROPE_KB = D_V // MMA_K  # S's first k-block over the RoPE features
LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


class BarrierId(enum.IntEnum):
    """Named hardware barriers of the consumer warpgroups (0 is __syncthreads)."""

    ROW_MAX = 1  # both consumer warpgroups published their partial row max
    P_READY = 2  # both halves of P are in sP (and out-of-range V rows are zeroed)
    ROW_SUM = 3  # both consumer warpgroups published their partial row sum


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


def make_smem_layouts(dtype, kv_stages: int):
    """Swizzled layouts (sQ, sK, sV, sP): sQ 64 x 576; sK kv_stages x (64 tokens x 576), K-major;
    sV the MN-major view of the same bytes (576 features x 64 tokens, only 512 used); sP 64 x 64."""
    k_major = LayoutEnum.ROW_MAJOR  # K-major operand (A or B)
    mn_major = LayoutEnum.COL_MAJOR
    sQ = cute.slice_(sm90_utils.make_smem_layout_a(k_major, (BLOCK_M, BLOCK_N, D_QK), dtype, 1), (None, None, 0))
    sK = sm90_utils.make_smem_layout_b(k_major, (BLOCK_M, BLOCK_N, D_QK), dtype, kv_stages)
    sV = sm90_utils.make_smem_layout_b(mn_major, (BLOCK_M, D_QK, BLOCK_N), dtype, kv_stages)
    sP = cute.slice_(sm90_utils.make_smem_layout_a(k_major, (BLOCK_M, HALF_V, BLOCK_N), dtype, 1), (None, None, 0))
    return sQ, sK, sV, sP


def make_q_pipeline(storage, q_bytes: int):
    """The Q tile's barrier pair: one TMA producer thread, the 8 consumer warps release it."""
    return pipeline.PipelineTmaAsync.create(
        barrier_storage=storage.q_mbar.data_ptr(),
        num_stages=1,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 8),
        tx_count=q_bytes,
        defer_sync=True,
    )


def operand_tiles(storage, sQ_layout, sK_layout, sV_layout, sP_layout):
    """sQ, sK, sV (the MN-major view of sK's bytes) and sP over a kernel's shared storage."""
    sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
    sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
    sV = cute.make_tensor(cute.recast_ptr(sK.iterator, sV_layout.inner), sV_layout.outer)
    sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)
    return sQ, sK, sV, sP


def row_exchange(storage):
    """(sMax, sSum): each consumer warpgroup's partial row max and row sum, [64 rows][2]."""
    layout = cute.make_layout((BLOCK_M, 2))
    return storage.row_max.get_tensor(layout), storage.row_sum.get_tensor(layout)


class SplitKVConsumer:
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
            row_max=pipeline.NamedBarrier(barrier_id=int(BarrierId.ROW_MAX), num_threads=256),
            p_ready=pipeline.NamedBarrier(barrier_id=int(BarrierId.P_READY), num_threads=256),
            row_sum=pipeline.NamedBarrier(barrier_id=int(BarrierId.ROW_SUM), num_threads=256),
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

    @cute.jit
    def epilogue(self, v, rows, bars, sSum, outs, work, scale_log2, req, tile, splits, max2=None, staged=None):
        """Normalise and write this request's rows of ``tile``: final output, or an fp32 partial.

        ``max2``: the rows' final max in log2 units, where the kernel keeps it (the seesaw
        kernel's shared row max); None: ``rows.row_max`` times ``scale_log2``.
        ``splits``: ``num_splits[req]`` and ``num_splits[req + 1]``, loaded when the request began
        (``load_splits``).
        ``staged``: a ``StagedRows``: final rows, and 16-bit partials, go through shared memory and bulk
        copies (thread 0 of warpgroup ``staged.issuer`` has issued them, and waited until they read shared
        memory, on return); None: stored from registers.  fp32 partials (the workspace's dtype decides,
        ``partials_16bit`` of the schedule) leave from registers."""
        wg, tid, row0 = v.wg, v.tid, rows.row0
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
                if cutlass.const_expr(max2 is None):
                    lse2[i] = rows.row_max[i] * scale_log2 + cute.math.log2(total, fastmath=False)
                else:
                    lse2[i] = max2[i] + cute.math.log2(total, fastmath=False)
        # Both warpgroups read sSum above; the next request's writes come after later barriers.

        n_splits = splits[1] - splits[0]
        col_base = wg * HALF_V
        if n_splits == 1:
            if cutlass.const_expr(outs.sink is not None):
                # The sink joins the softmax denominator only: out *= 2^lse2 / (2^lse2 + 2^sink2).
                for i in cutlass.range_constexpr(2):
                    if row0 + 8 * i < tile.row_count:
                        sink2 = outs.sink[tile.head_base + row0 + 8 * i] * LOG2_E
                        inv[i] = inv[i] * sink_factor(sink2, lse2[i])
            if cutlass.const_expr(staged is None):
                self.store_pairs(v, inv, outs.out, req, tile, col_base, self.dtype)
            else:
                self.store_staged(v, inv, staged, outs.out, req, tile, col_base)
            if wg == 0 and tid % 4 == 0:
                for i in cutlass.range_constexpr(2):
                    r = row0 + 8 * i
                    if r < tile.row_count:
                        lse = cutlass.Float32.inf
                        if lse2[i] != -cutlass.Float32.inf:
                            lse = lse2[i] * LN_2
                        outs.lse[req, tile.kv_head, tile.row_base + r] = lse
        else:
            split = splits[0]
            if req == work.begin_req:
                split = split + work.begin_split
            if cutlass.const_expr(outs.o_accum.element_type == cutlass.Float32):
                self.store_pairs(v, inv, outs.o_accum, split, tile, col_base, cutlass.Float32)
            else:
                # 16-bit partials leave as final rows do: a 32-bit store per column pair would fill half of
                # each 32-byte sector it touches.
                assert staged is not None, "16-bit partials need the staged epilogue"
                self.store_staged(v, inv, staged, outs.o_accum, split, tile, col_base)
            if wg == 0 and tid % 4 == 0:
                for i in cutlass.range_constexpr(2):
                    r = row0 + 8 * i
                    if r < tile.row_count:
                        outs.lse_accum[split, tile.kv_head, tile.row_base + r] = lse2[i]

    @cute.jit
    def store_staged(self, v, inv, staged, out, first_mode, tile, col_base):
        """O * inv into the staging rows, then to ``out[first_mode, kv_head, row]`` (a request's output, or
        a split's 16-bit partial): by warpgroup ``staged.issuer``'s threads (``copy_staged_rows``) where
        ``staged.copied`` is set, else by one bulk copy per row from its thread 0, waited for until
        shared memory is read."""
        for e in cutlass.range_constexpr(0, cute.size(v.acc_o), 2):
            r, c = v.tOcO[e]
            i = (e // 2) % 2
            pair = cute.make_rmem_tensor((2,), self.dtype)
            pair[0] = (v.acc_o[e] * inv[i]).to(self.dtype)
            pair[1] = (v.acc_o[e + 1] * inv[i]).to(self.dtype)
            cute.autovec_copy(pair, cute.local_tile(staged.rows[r, None], (2,), ((col_base + c) // 2,)))
        if cutlass.const_expr(staged.copied is not None):
            staged.written.arrive_and_wait()
            if v.wg == staged.issuer:
                self.copy_staged_rows(v, staged, out, first_mode, tile)
        else:
            cute.arch.fence_view_async_shared()  # the bulk copies read through the async proxy
            staged.written.arrive_and_wait()
            if v.wg == staged.issuer and v.tid == 0:
                for k in cutlass.range(cutlass.min(tile.row_count, BLOCK_M), unroll=1):
                    bulk_copy_to_global(out[first_mode, tile.kv_head, tile.row_base + k, None].iterator,
                                        staged.rows[k, None].iterator, D_V * 2)
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def copy_staged_rows(self, v, staged, out, first_mode, tile):
        """The staging rows to ``out`` by one warpgroup's 128 threads, a 16-byte piece each per step: a
        warp moves 512 contiguous bytes of a row per load and per store.  On return the warpgroup has
        met at ``staged.copied``, so the staging bytes may take the next Q (a TMA write, hence the
        fence).  A method of its own: a loop inside the caller's branch rebinds its names."""
        n_rows = cutlass.min(tile.row_count, BLOCK_M)
        piece = v.tid % COPY_VECS_PER_ROW
        for step in cutlass.range(BLOCK_M * COPY_VECS_PER_ROW // WARPGROUP_THREADS, unroll=1):
            row = step * (WARPGROUP_THREADS // COPY_VECS_PER_ROW) + v.tid // COPY_VECS_PER_ROW
            if row < n_rows:
                vec = cute.make_rmem_tensor((COPY_VEC,), self.dtype)
                cute.autovec_copy(cute.local_tile(staged.rows[row, None], (COPY_VEC,), (piece,)), vec)
                dst = out[first_mode, tile.kv_head, tile.row_base + row, None]
                cute.autovec_copy(vec, cute.local_tile(dst, (COPY_VEC,), (piece,)))
        cute.arch.fence_view_async_shared()
        staged.copied.arrive_and_wait()

    @cute.jit
    def store_pairs(self, v, inv, dst, first_mode, tile, col_base, dtype: cutlass.Constexpr):
        """O * inv into ``dst[first_mode, kv_head, row, col]``: accumulator values e and e + 1 (e even)
        are columns c and c + 1 of one row, so each pair leaves as one vector store (per-element
        stores throttled the load/store unit when many CTAs write partials)."""
        for e in cutlass.range_constexpr(0, cute.size(v.acc_o), 2):
            r, c = v.tOcO[e]
            i = (e // 2) % 2
            if r < tile.row_count:
                pair = cute.make_rmem_tensor((2,), dtype)
                pair[0] = (v.acc_o[e] * inv[i]).to(dtype)
                pair[1] = (v.acc_o[e + 1] * inv[i]).to(dtype)
                row = dst[first_mode, tile.kv_head, tile.row_base + r, None]
                cute.autovec_copy(pair, cute.local_tile(row, (2,), ((col_base + c) // 2,)))


# A running max moves only when a tile's row max exceeds it by more than this (log2 units), so P stays
# below 2^8 and the factor of most tiles is exactly 1: the warpgroups skip rescaling O (the leader-
# follower and seesaw softmaxes; FlashAttention 4's conditional rescaling).
MAX_SLACK = 8.0


# Staging rows for final outputs: 16 bytes of padding per row, so the accumulator's stores, 8 rows
# per instruction, fall in distinct banks.
STAGED_PITCH = D_V + 8
COPY_VEC = 8  # 16-bit elements in 16 bytes: ``copy_staged_rows``' vectors
COPY_VECS_PER_ROW = D_V // COPY_VEC
WARPGROUP_THREADS = 128


def staged_rows_layout():
    """64 rows x 512 columns of 16-bit output at ``STAGED_PITCH`` elements per row (66 560 bytes)."""
    return cute.make_layout((BLOCK_M, D_V), stride=(STAGED_PITCH, 1))


@cutlass.dsl_user_op
def bulk_copy_to_global(dst, src, nbytes: int, *, loc=None, ip=None):
    """cp.async.bulk of ``nbytes`` from shared memory at ``src`` to global memory at ``dst`` (bulk
    async-group completion: the caller commits and waits)."""
    nvvm.cp_async_bulk_global_shared_cta(
        dst.to_llvm_ptr(loc=loc, ip=ip), src.to_llvm_ptr(loc=loc, ip=ip),
        cutlass.Int32(nbytes).ir_value(loc=loc, ip=ip), loc=loc, ip=ip,
    )


@cute.jit
def load_splits(outs, req):
    """``num_splits[req]`` and ``num_splits[req + 1]`` into registers.  Loaded when a request begins, their
    round trip to memory hides under its tiles instead of delaying its epilogue."""
    splits = cute.make_rmem_tensor((2,), cutlass.Int32)
    splits[0] = outs.num_splits[req]
    splits[1] = outs.num_splits[req + 1]
    return splits


@cute.jit
def rescale_o(acc_o, factor):
    """A WGMMA accumulator's rows (O, or S / P) *= factor (value e is in the thread's row (e // 2) % 2);
    skipped when both factors are 1, as they are once the row maxima have settled."""
    if cutlass.min(factor[0], factor[1]) != 1.0:
        for e in cutlass.range_constexpr(cute.size(acc_o)):
            acc_o[e] = acc_o[e] * factor[(e // 2) % 2]


@cute.jit
def sink_factor(sink2, lse2):
    """exp2(lse2) / (exp2(lse2) + exp2(sink2)); 0 when nothing was attended (lse2 infinite)."""
    f = cutlass.Float32(0.0)
    if lse2 > -cutlass.Float32.inf and lse2 < cutlass.Float32.inf:
        f = 1.0 / (1.0 + cute.math.exp2(sink2 - lse2, fastmath=False))
    return f


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
    max_len: Any = None  # dense: the tokens a request's block-table row covers (``length``)

    @staticmethod
    def of(mSched, part, max_len=None) -> "WorkSlice":
        """The record of ``part`` in the scheduler's ``[num_parts, 8]`` table."""
        return WorkSlice(mSched[part, 0], mSched[part, 1], mSched[part, 2], mSched[part, 3], mSched[part, 4],
                         max_len)

    @cute.jit
    def length(self, raw):
        """A request's length as this CTA serves it: within [0, ``max_len``], whatever the lengths tensor
        holds (values the checks never saw read nothing past the request's block-table row)."""
        return cutlass.min(cutlass.max(raw, 0), self.max_len)

    @cute.jit
    def clamp(self, req):
        """``req`` clamped to the part's requests: loads ahead of the last one (or of an idle part) stay in
        bounds without a branch."""
        return cutlass.max(cutlass.min(req, self.end_req), 0)

    @cute.jit
    def blocks(self, req, seqlen):
        """KV tiles [first, last) of request ``req`` that this CTA serves, never past ``seqlen`` (a record
        made for other lengths included)."""
        first = cutlass.Int32(0)
        if req == self.begin_req:
            first = self.begin_block
        last = (seqlen + BLOCK_N - 1) // BLOCK_N
        if req == self.end_req:
            last = cutlass.min(last, self.end_block)
        return first, last


@cute.jit
def lengths_ahead(mLens, work):
    """Registers for ``advance_lengths``: [0] the current request's length, [1] the next one's, loaded a
    request ahead so that a request boundary does not wait for a round trip to memory."""
    lens = cute.make_rmem_tensor((2,), cutlass.Int32)
    lens[1] = mLens[work.clamp(work.begin_req)]
    return lens


@cute.jit
def advance_lengths(lens, mLens, work, req):
    """Request ``req``'s length (loaded a request ago); starts loading request ``req + 1``'s."""
    lens[0] = lens[1]
    lens[1] = mLens[work.clamp(req + 1)]
    return lens[0]


@dataclasses.dataclass
class SplitOutputs:
    """Where results go: final out/lse (FlashMLA layouts seen per KV head) or fp32 partials.

    ``sink``: the attention sink per head (fp32), or None.
    """

    num_splits: Any
    out: Any
    lse: Any
    o_accum: Any
    lse_accum: Any
    sink: Any = None


@dataclasses.dataclass
class OutputTile:
    """The CTA's rows in the output views: ``row_base + r`` for ``r < row_count``; head of r for
    the sink: ``head_base + r``."""

    kv_head: Any
    row_base: Any
    row_count: Any
    head_base: Any = 0


@dataclasses.dataclass
class LengthMask:
    """Keys at or past ``limit[i]`` (relative to the warpgroup's first token) are masked in row i."""

    limit: Any

    @cute.jit
    def apply(self, s, c, i):
        if c >= self.limit[i]:
            s = -cutlass.Float32.inf
        return s


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
class RowState:
    """The thread's two query rows (row0, row0 + 8): running max and sum, causal shift."""

    row0: Any
    row_max: Any
    row_sum: Any
    shift: Any


@dataclasses.dataclass
class StagedRows:
    """Final output rows staged in shared memory (``staged_rows_layout``); ``written``: the named barrier
    of the two consumer warpgroups after both wrote their halves; ``issuer``: the warpgroup (0 or 1)
    that copies them out; ``copied``: None (its thread 0 issues one bulk copy per row), or a named
    barrier of its 128 threads, which copy the rows with vector loads and stores and meet there."""

    rows: Any
    written: Any
    issuer: int
    copied: Any = None


@dataclasses.dataclass
class ConsumerBarriers:
    row_max: Any
    p_ready: Any
    row_sum: Any
