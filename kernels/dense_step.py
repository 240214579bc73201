"""One host entry for a dense decode step: the split kernel, then the combine kernel.

A single compiled host function launches both, so a decode step crosses the Python /
TVM-FFI boundary once.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from .combine import CombineKernel


class DenseDecodeStep:
    def __init__(self, split, combine: CombineKernel):
        self.split = split
        self.combine = combine

    @cute.jit
    def __call__(
        self, mQ, mKCache, mBlockTable, mSeqlens, mSched, mNumSplits, mOut, mLse, mOAccum, mLseAccum,
        scale_log2: cutlass.Float32, stream,
    ):
        self.split(mQ, mKCache, mBlockTable, mSeqlens, mSched, mNumSplits, mOut, mLse, mOAccum, mLseAccum,
                   scale_log2, stream)
        self.combine(mNumSplits, mOAccum, mLseAccum, mOut, mLse, None, stream)
