"""The idle-SM fill: a plan of 4-CTA clusters, and pairs on the SMs those clusters leave idle.

A GPC holds whole clusters only, so the seesaw kernel's 4-CTA clusters (``cluster_ctas=4``) hold 120 of an
H200's 132 SMs at once; a plan of them has 30 parts, against the pairs' 33, and 12 SMs idle.  The fill runs
the plan's last parts there, as pair clusters of the same seesaw kernel, in one host entry on one stream:

  1. the 4-CTA clusters' split kernel over parts [0, P - F) (``fill_role="clusters"``): each CTA executes
     ``griddepcontrol.launch_dependents`` as it starts, so the next kernel may launch once every cluster is
     resident, not once they finish;
  2. the pairs' split kernel over the last F parts (``fill_role="fill"``), a programmatic dependent launch:
     its pairs can only take SMs the clusters left (an SM holds one CTA of either), and each of its CTAs
     waits for the clusters' grid (``griddepcontrol.wait``) before it exits, so the fill grid completes
     only after both;
  3. the combine, as in ``dense_step.py``, after the fill grid (its programmatic launch waits for that grid).

The pairs fit where the clusters leave whole pairs: every GPC of an even SM count (the driver's pair
count is half the SMs), checked by the resolver (``schedules/resolve.py``).  A pair is slower than a 4-CTA
cluster while both run (each tile crosses from L2 twice for its four M tiles, not once): the planner gives
each fill part ``idle_sm_fill_share`` sixteenths of another part's blocks (``schedules/planner.py``, fill
parts).  Both split kernels write partials through the same records and split counts, so the combine is
the usual one.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from .combine import CombineKernel
from .dense_seesaw import DenseSeesawKernel


class DenseDecodeFillStep:
    """The split kernels of a 4-CTA plan with fill parts, and the combine (None: the plan splits nothing)."""

    def __init__(self, clusters: DenseSeesawKernel, fill: DenseSeesawKernel, combine: CombineKernel = None):
        if clusters.fill_role != "clusters" or fill.fill_role != "fill":
            raise ValueError("DenseDecodeFillStep needs kernels built with fill_role 'clusters' and 'fill'")
        self.clusters = clusters
        self.fill = fill
        self.combine = combine

    @cute.jit
    def __call__(
        self, mQ, mKCache, mBlockTable, mSeqlens, mSched, mFillSched, mNumSplits, mOut, mLse, mOAccum, mLseAccum,
        scale_log2: cutlass.Float32, stream,
    ):
        """``mSched``: the 4-CTA clusters' records (the plan's first parts); ``mFillSched``: the fill parts'."""
        self.clusters(mQ, mKCache, mBlockTable, mSeqlens, mSched, mNumSplits, mOut, mLse, mOAccum, mLseAccum,
                      scale_log2, stream)
        self.fill(mQ, mKCache, mBlockTable, mSeqlens, mFillSched, mNumSplits, mOut, mLse, mOAccum, mLseAccum,
                  scale_log2, stream)
        if cutlass.const_expr(self.combine is not None):
            self.combine(mNumSplits, mOAccum, mLseAccum, mOut, mLse, None, stream)
