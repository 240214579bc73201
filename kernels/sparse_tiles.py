"""The sparse decode kernel's view of a request's tokens: how many it attends to (``RequestLengths``) and the
producer's walk over a part's tiles (``TileCursor``).

A request attends to ``topk_length`` of its ``topk`` indices (all of them without ``topk_length``).  With an
extra cache (``extra_k_cache``) it attends to its main tokens, then to ``extra_topk_length`` of its
``extra_topk`` extra indices: its tiles are the main tokens' ``ceil(m / 64)`` tiles, then the extra tokens'
(length ``64 ceil(m / 64) + e``, which the scheduler plans over too), so no tile mixes the two caches.  Every
role reads the lengths a request ahead, so a request boundary does not wait for a round trip to memory.

The jit functions take the lengths' fields one by one: a dataclass handed to a jit call inside staged control
flow has its fields rebound there, which later uses outside that region cannot see.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import cutlass
import cutlass.cute as cute

from .constants import BLOCK_N
from .work import advance_lengths


@dataclasses.dataclass
class RequestLengths:
    """``main``: topk_length [b] int32 (None: topk each), cut at ``topk``; with an extra cache ``extra``: its
    lengths [b] int32 (``main`` then given too), cut at ``extra_topk``."""

    main: Any
    topk: Any
    extra: Any = None
    extra_topk: Any = None

    def ahead(self, work):
        """Registers for ``next``: [0] the current request's length, then the next one's, loaded ahead (with an
        extra cache: [1] its main length and [2] its extra length, raw, and [3] the current main length).
        Without ``topk_length`` every length is topk, known without a load."""
        return _ahead(self.main, self.extra, work)

    def next(self, lens, work, req):
        """Tiles [first, last) of request ``req`` (at least one, so a request with nothing to attend still writes
        its rows), from the lengths ``lens`` loaded a request ago; starts loading request ``req + 1``'s.  Leaves
        the length in ``lens[0]`` (with an extra cache the main length in ``lens[3]``)."""
        return _next(lens, self.main, self.topk, self.extra, self.extra_topk, work, req)


@cute.jit
def _ahead(main, extra, work):
    lens = cute.make_rmem_tensor((2 if cutlass.const_expr(extra is None) else 4,), cutlass.Int32)
    if cutlass.const_expr(extra is not None):
        first = work.clamp(work.begin_req)
        lens[1] = main[first]
        lens[2] = extra[first]
    elif cutlass.const_expr(main is not None):
        lens[1] = main[work.clamp(work.begin_req)]
    return lens


@cute.jit
def _next(lens, main, topk, extra, extra_topk, work, req):
    length = topk
    if cutlass.const_expr(extra is not None):
        m = cutlass.min(cutlass.max(lens[1], 0), topk)
        e = cutlass.min(cutlass.max(lens[2], 0), extra_topk)
        lens[3] = m
        lens[0] = (m + BLOCK_N - 1) // BLOCK_N * BLOCK_N + e
        nxt = work.clamp(req + 1)
        lens[1] = main[nxt]
        lens[2] = extra[nxt]
        length = cutlass.max(lens[0], 1)
    else:
        if cutlass.const_expr(main is None):
            lens[0] = topk
        else:
            length = advance_lengths(lens, main, work, req)
        length = cutlass.max(cutlass.min(length, topk), 1)
    return work.blocks(req, length)


@dataclasses.dataclass
class TileCursor:
    """A position in the part's tiles taken in order across its requests: ``pos`` = (request, tile, the
    request's end tile, its length (cut at topk); 0 past the part's last tile; with an extra cache also its
    main length)."""

    pos: Any
    lens: Any  # the lengths a request ahead (``RequestLengths.ahead``), the cursor's own

    @staticmethod
    def start(work, lengths: RequestLengths) -> "TileCursor":
        """At the part's first tile (for an idle part: past its last, length 0)."""
        pos = cute.make_rmem_tensor((4 if lengths.extra is None else 5,), cutlass.Int32)
        lens = lengths.ahead(work)
        _start(pos, lens, lengths.main, lengths.topk, lengths.extra, lengths.extra_topk, work)
        return TileCursor(pos, lens)

    def advance(self, work, lengths: RequestLengths):
        """To the next tile: the next of this request, or the first of the next request."""
        _advance(self.pos, self.lens, lengths.main, lengths.topk, lengths.extra, lengths.extra_topk, work)


@cute.jit
def _start(pos, lens, main, topk, extra, extra_topk, work):
    first, last = _next(lens, main, topk, extra, extra_topk, work, work.begin_req)
    pos[0] = work.begin_req
    pos[1] = first
    pos[2] = last
    _set_length(pos, lens, topk, extra)
    if work.begin_req > work.end_req:
        pos[3] = 0


@cute.jit
def _advance(pos, lens, main, topk, extra, extra_topk, work):
    pos[1] = pos[1] + 1
    if pos[1] >= pos[2]:
        pos[0] = pos[0] + 1
        first, last = _next(lens, main, topk, extra, extra_topk, work, pos[0])
        pos[1] = first
        pos[2] = last
        _set_length(pos, lens, topk, extra)
        if pos[0] > work.end_req:
            pos[3] = 0


@cute.jit
def _set_length(pos, lens, topk, extra):
    if cutlass.const_expr(extra is None):
        pos[3] = cutlass.min(lens[0], topk)
    else:
        pos[3] = lens[0]
        pos[4] = lens[3]
