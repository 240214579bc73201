"""The split-KV epilogue the consumers share: final rows in FlashMLA's layouts (through ``layouts.py``),
or a split's partial with a base-2 lse for the combine kernel, optionally scaled by an attention sink.
Final rows leave from registers, or (``StagedRows``: the sparse leader-follower and the dense seesaw
kernels) through shared memory: under a busy memory system 64 stores per thread took 4-8 us and held up
the loads of the next request's tiles.  From the staging rows the dense kernel issues one bulk copy per
row; the sparse kernel's follower copies them with 16-byte loads and stores, because its TMA unit also
carries the producer's hand-over copies."""

from __future__ import annotations

import dataclasses
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import nvvm

from .constants import BLOCK_M, D_V, HALF_V, LN_2, LOG2_E
from .softmax import sink_factor


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


@cutlass.dsl_user_op
def bulk_copy_to_global(dst, src, nbytes: int, *, loc=None, ip=None):
    """cp.async.bulk of ``nbytes`` from shared memory at ``src`` to global memory at ``dst`` (bulk
    async-group completion: the caller commits and waits)."""
    nvvm.cp_async_bulk_global_shared_cta(
        dst.to_llvm_ptr(loc=loc, ip=ip), src.to_llvm_ptr(loc=loc, ip=ip),
        cutlass.Int32(nbytes).ir_value(loc=loc, ip=ip), loc=loc, ip=ip,
    )


COPY_VEC = 8  # 16-bit elements in 16 bytes: ``copy_staged_rows``' vectors


COPY_VECS_PER_ROW = D_V // COPY_VEC


WARPGROUP_THREADS = 128


class EpilogueMethods:
    """The epilogue as methods of a consumer class (which sets ``dtype``, ``group``, ``s_q``)."""

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
        sparse decode's small plans have 16-bit ones) leave from registers.  ``outs.max_logits`` (where set) is
        written with the final rows, by warpgroup 0, from its ``rows.exact_max``; a split's partial has none."""
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
                        if cutlass.const_expr(outs.max_logits is not None):
                            top = -cutlass.Float32.inf  # nothing attended
                            if rows.exact_max[i] != -cutlass.Float32.inf:
                                top = rows.exact_max[i] * scale_log2 * LN_2
                            outs.max_logits[req, tile.kv_head, tile.row_base + r] = top
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
