"""Split-KV scheduler on the GPU: the planner (``mla_cute.schedules.planner``) as a kernel.

It runs on the stream before the split kernel, so the metadata never crosses to the
host (no synchronisation; capturable in a CUDA graph).  The greedy walk is sequential
and tiny (b + num_parts steps): one thread does it.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

BLOCK_N = 64


class SchedulerKernel:
    def __init__(self, fixed_cost: int):
        self.fixed_cost = fixed_cost

    @cute.jit
    def __call__(self, mSeqlens: cute.Tensor, mSched: cute.Tensor, mNumSplits: cute.Tensor, stream):
        self.kernel(mSeqlens, mSched, mNumSplits).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)

    @cute.jit
    def last_block(self, mSeqlens, req):
        return (cutlass.max(mSeqlens[req] - 1, 0)) // BLOCK_N

    @cute.kernel
    def kernel(self, mSeqlens, mSched, mNumSplits):
        tidx, _, _ = cute.arch.thread_idx()
        fixed = self.fixed_cost
        if tidx == 0:
            b = mSeqlens.shape[0]
            num_parts = mSched.shape[0]
            total = cutlass.Int32(0)
            for i in cutlass.range(b, unroll=1):
                total += self.last_block(mSeqlens, i) + 1 + fixed
            payload = (total + num_parts - 1) // num_parts + fixed
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
                go = req < b
                while go:
                    left = self.last_block(mSeqlens, req) + 1 - block
                    if remain >= left + fixed:
                        cum += split + 1
                        mNumSplits[req + 1] = cum
                        remain -= left + fixed
                        req += 1
                        block = 0
                        split = 0
                        go = req < b
                    else:
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
