"""One host entry for a sparse FP8 decode step: the split kernel, then the combine kernel."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from .combine import CombineKernel
from .sparse_decode_fp8 import SparseDecodeFp8Kernel


class SparseDecodeStep:
    def __init__(self, split: SparseDecodeFp8Kernel, combine: CombineKernel):
        self.split = split
        self.combine = combine

    @cute.jit
    def __call__(
        self, mQ, mCache, mIndices, mTopkLen, mExtraCache, mExtraIndices, mExtraLen, mSched, mNumSplits, mOut, mLse,
        mOAccum, mLseAccum, mSink, mMaxLogits, scale_log2: cutlass.Float32, stream,
    ):
        self.split(mQ, mCache, mIndices, mTopkLen, mExtraCache, mExtraIndices, mExtraLen, mSched, mNumSplits, mOut,
                   mLse, mOAccum, mLseAccum, mSink, mMaxLogits, scale_log2, stream)
        self.combine(mNumSplits, mOAccum, mLseAccum, mOut, mLse, mSink, stream)
