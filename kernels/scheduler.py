"""Split-KV scheduler on the GPU: the planner (``mla_cute.schedules.planner``) as a kernel.

It runs on the stream before the split kernel, so the metadata never crosses to the
host (no synchronisation; capturable in a CUDA graph).  The greedy walk is sequential
and tiny (b + num_parts steps): one thread does it.  With ``unsplit_slack`` > 0 the
search for a capacity that keeps every request whole adds a pass over the lengths and
at most a few more (a bisection over ``fixed_cost + unsplit_slack + 1`` capacities), and
``even_split_slack`` > 0 a bisection over ``even_split_slack + 1`` capacities for the plan of
even pieces.  ``fill_parts`` > 0: the last parts take a share of the others' blocks (the planner's
fill parts).

It plans the lengths as the split kernels serve them: each within ``[0, max_len]`` (the tokens a
block-table row covers; sparse: topk, at least 1, or over two caches the main tokens' whole tiles and the
extra tokens: ``ClampedLengths``), read at an index within ``[0, b)``, so whatever a lengths tensor holds, the
records and split counts stay within the workspace, and no torch operation runs before the scheduler.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import cutlass
import cutlass.cute as cute

from ..schedules.configs import SchedulerConfig
from ..schedules.planner import FILL_SHARE_ONE
from .constants import BLOCK_N



@dataclasses.dataclass
class ClampedLengths:
    """The lengths as the planner reads them (``SchedulerConfig.lengths``), request ``i`` at least 0.  "dense":
    ``lens[i]`` within [0, max_len]; "topk": within [1, max_len]; "two_caches": the main tokens within [0,
    max_len] rounded up to whole tiles, plus ``extra[i]`` within [0, extra_max], at least 1 (the sparse kernel's
    tiles of a request over two caches, ``sparse_tiles.py``)."""

    lens: Any
    max_len: Any
    kind: str = "dense"
    extra: Any = None
    extra_max: Any = None

    @property
    def shape(self):
        return self.lens.shape

    def __getitem__(self, i):
        j = cutlass.max(i, 0)
        if cutlass.const_expr(self.kind == "dense"):
            return cutlass.min(cutlass.max(self.lens[j], 0), self.max_len)
        if cutlass.const_expr(self.kind == "topk"):
            return cutlass.min(cutlass.max(self.lens[j], 1), self.max_len)
        main = cutlass.min(cutlass.max(self.lens[j], 0), self.max_len)
        extra = cutlass.min(cutlass.max(self.extra[j], 0), self.extra_max)
        return cutlass.max((main + BLOCK_N - 1) // BLOCK_N * BLOCK_N + extra, 1)


class SchedulerKernel:
    def __init__(self, config: SchedulerConfig):
        self.fixed_cost = config.fixed_cost
        # With fill parts the plan is FlashMLA's walk at weighted payloads (the planner ignores both slacks).
        self.unsplit_slack = 0 if config.fill_parts else config.unsplit_slack
        self.even_split_slack = 0 if config.fill_parts else config.even_split_slack
        self.fill_parts = config.fill_parts
        self.fill_share = config.fill_share
        self.lengths = config.lengths

    @cute.jit
    def __call__(self, mSeqlens: cute.Tensor, mExtraLens: cute.Tensor, mSched: cute.Tensor, mNumSplits: cute.Tensor,
                 max_len: cutlass.Int32, extra_max: cutlass.Int32, stream):
        """``mExtraLens`` and ``extra_max``: the extra cache's lengths and topk with ``lengths`` "two_caches", else
        None and 0."""
        if cutlass.const_expr((mExtraLens is not None) != (self.lengths == "two_caches")):
            raise ValueError(f"mExtraLens: the scheduler is built for lengths={self.lengths!r}")
        self.kernel(mSeqlens, mExtraLens, mSched, mNumSplits, max_len, extra_max).launch(
            grid=[1, 1, 1], block=[32, 1, 1], stream=stream)

    @cute.jit
    def last_block(self, mSeqlens, req):
        return (cutlass.max(mSeqlens[req] - 1, 0)) // BLOCK_N

    @cute.jit
    def request_cost(self, mSeqlens, req):
        """The planner's cost of a request: its blocks and the fixed cost."""
        return self.last_block(mSeqlens, req) + 1 + self.fixed_cost

    @cute.jit
    def parts_whole(self, mSeqlens, capacity):
        """The planner's ``_parts_whole``: parts taken by whole requests packed in order."""
        parts = cutlass.Int32(1)
        fill = cutlass.Int32(0)
        for i in cutlass.range(mSeqlens.shape[0], unroll=4):
            c = self.request_cost(mSeqlens, i)
            if fill + c > capacity:
                parts += 1
                fill = c
            else:
                fill += c
        return parts

    @cute.jit
    def even_pieces(self, num_blocks, capacity):
        """How many even pieces a request of ``num_blocks`` takes at ``capacity`` (1: it fits whole)."""
        pieces = cutlass.Int32(1)
        if num_blocks + self.fixed_cost > capacity:
            pieces = (num_blocks + capacity - self.fixed_cost - 1) // (capacity - self.fixed_cost)
        return pieces

    @cute.jit
    def parts_even(self, mSeqlens, capacity):
        """The planner's ``_parts_even``: parts taken by the even plan at ``capacity``.  At a capacity no
        request exceeds it counts what ``parts_whole`` does; the whole-plan search keeps its own, shorter
        loop (its passes were timed as they are)."""
        parts = cutlass.Int32(0)
        fill = cutlass.Int32(0)
        for i in cutlass.range(mSeqlens.shape[0], unroll=4):
            c = self.request_cost(mSeqlens, i)
            if c <= capacity:
                if fill + c > capacity:
                    parts += 1
                    fill = c
                else:
                    fill += c
            else:
                if fill > 0:
                    parts += 1
                parts += self.even_pieces(c - self.fixed_cost, capacity)
                fill = 0
        if fill > 0:
            parts += 1
        return parts

    @cute.jit
    def smallest_capacity(self, mSeqlens, lo, hi, num_parts, even: cutlass.Constexpr):
        """Bisection over [lo, hi] (``hi`` fits) for the smallest capacity at which whole requests (``even``
        False: ``parts_whole``) or the even plan (``parts_even``) fit ``num_parts`` parts."""
        while lo < hi:
            mid = (lo + hi) // 2
            parts = cutlass.Int32(0)
            if cutlass.const_expr(even):
                parts = self.parts_even(mSeqlens, mid)
            else:
                parts = self.parts_whole(mSeqlens, mid)
            if parts <= num_parts:
                hi = mid
            else:
                lo = mid + 1
        return lo

    @cute.kernel
    def kernel(self, mLens, mExtraLens, mSched, mNumSplits, max_len, extra_max):
        tidx, _, _ = cute.arch.thread_idx()
        mSeqlens = ClampedLengths(mLens, max_len, self.lengths, mExtraLens, extra_max)
        fixed = self.fixed_cost
        if tidx == 0:
            b = mSeqlens.shape[0]
            num_parts = mSched.shape[0]
            total = cutlass.Int32(0)
            largest = cutlass.Int32(0)
            # Unrolled by 4 here and in ``parts_whole``: four loads of lengths in flight, not one.
            for i in cutlass.range(b, unroll=4):
                c = self.request_cost(mSeqlens, i)
                total += c
                largest = cutlass.max(largest, c)
            payload = (total + num_parts - 1) // num_parts + fixed
            fill_payload = payload
            if cutlass.const_expr(self.fill_parts > 0):
                # The planner's weighted payloads, in 64 bits (16 x the total may pass 2^31).
                weight = FILL_SHARE_ONE * (num_parts - self.fill_parts) + self.fill_share * self.fill_parts
                share = (cutlass.Int64(total) * FILL_SHARE_ONE + weight - 1) // weight
                payload = cutlass.Int32(share) + fixed
                fill_payload = cutlass.Int32((share * self.fill_share + FILL_SHARE_ONE - 1) // FILL_SHARE_ONE) + fixed
            # 1: every request is packed whole at capacity ``payload`` (the planner's ``_whole_capacity``).
            whole = cutlass.Int32(0)
            if cutlass.const_expr(self.unsplit_slack > 0):
                lo = cutlass.max(largest, (total + num_parts - 1) // num_parts)
                hi = payload + self.unsplit_slack
                if lo <= hi:
                    if self.parts_whole(mSeqlens, hi) <= num_parts:
                        whole = 1
                        payload = self.smallest_capacity(mSeqlens, lo, hi, num_parts, False)
            # 2: else the plan of even pieces, at the smallest capacity from the payload up that fits
            # (the planner's ``_even_capacity``).
            even = cutlass.Int32(0)
            if cutlass.const_expr(self.even_split_slack > 0):
                hi = payload + self.even_split_slack
                if whole == 0:
                    if self.parts_even(mSeqlens, hi) <= num_parts:
                        even = 1
                        payload = self.smallest_capacity(mSeqlens, payload, hi, num_parts, True)
            req = cutlass.Int32(0)
            block = cutlass.Int32(0)
            split = cutlass.Int32(0)
            cum = cutlass.Int32(0)
            mNumSplits[0] = 0
            for part in cutlass.range(num_parts, unroll=1):
                begin_req = req
                begin_block = block
                begin_split = split
                first_split = cutlass.Int32(0)
                if block != 0:
                    first_split = 1
                remain = payload
                if cutlass.const_expr(self.fill_parts > 0):
                    if part >= num_parts - self.fill_parts:
                        remain = fill_payload
                go = req < b
                while go:
                    blocks = self.last_block(mSeqlens, req) + 1
                    left = blocks - block
                    pieces = cutlass.Int32(1)
                    if even != 0:
                        pieces = self.even_pieces(blocks, payload)
                    if pieces > 1:  # an even piece: alone on a part
                        if remain == payload:
                            end = (split + 1) * blocks // pieces
                            remain = 0
                            if end == blocks:
                                cum += split + 1
                                mNumSplits[req + 1] = cum
                                req += 1
                                block = 0
                                split = 0
                            else:
                                block = end
                                split += 1
                        go = False
                    else:
                        if remain >= left + fixed:
                            cum += split + 1
                            mNumSplits[req + 1] = cum
                            remain -= left + fixed
                            req += 1
                            block = 0
                            split = 0
                            go = req < b
                        else:
                            if whole == 0:
                                if even == 0:
                                    if remain - fixed > 0:
                                        block += remain - fixed
                                        split += 1
                            go = False
                end_req = req
                end_block = block
                if block == 0:
                    end_req = req - 1
                    end_block = 0
                    if mSeqlens[end_req] != 0:
                        end_block = self.last_block(mSeqlens, end_req) + 1
                last_split = cutlass.Int32(0)
                if end_block != self.last_block(mSeqlens, end_req) + 1:
                    if mSeqlens[end_req] != 0:
                        last_split = 1
                if begin_req == end_req:
                    either = cutlass.max(first_split, last_split)
                    first_split = either
                    last_split = either
                mSched[part, 0] = begin_req
                mSched[part, 1] = end_req
                mSched[part, 2] = begin_block
                mSched[part, 3] = end_block
                mSched[part, 4] = begin_split
                mSched[part, 5] = first_split
                mSched[part, 6] = last_split
                mSched[part, 7] = 0
