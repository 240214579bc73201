"""This CTA's share of a decode batch: its scheduler record (``WorkSlice``), the requests' lengths read
ahead, the split counts, and the records of the outputs it writes."""

from __future__ import annotations

import dataclasses
from typing import Any

import cutlass
import cutlass.cute as cute

from .constants import BLOCK_N


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


@cute.jit
def load_splits(outs, req):
    """``num_splits[req]`` and ``num_splits[req + 1]`` into registers.  Loaded when a request begins, their
    round trip to memory hides under its tiles instead of delaying its epilogue."""
    splits = cute.make_rmem_tensor((2,), cutlass.Int32)
    splits[0] = outs.num_splits[req]
    splits[1] = outs.num_splits[req + 1]
    return splits


@dataclasses.dataclass
class SplitOutputs:
    """Where results go: final out/lse (FlashMLA layouts seen per KV head) or fp32 partials.

    ``sink``: the attention sink per head (fp32), or None.  ``max_logits``: each row's max scaled logit,
    natural units, in lse's layout (written with the final rows from ``RowState.exact_max``), or None.
    """

    num_splits: Any
    out: Any
    lse: Any
    o_accum: Any
    lse_accum: Any
    sink: Any = None
    max_logits: Any = None


@dataclasses.dataclass
class OutputTile:
    """The CTA's rows in the output views: ``row_base + r`` for ``r < row_count``; head of r for
    the sink: ``head_base + r``."""

    kv_head: Any
    row_base: Any
    row_count: Any
    head_base: Any = 0
