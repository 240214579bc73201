"""What a user may tune of dense decode, as plain data (``resolve.resolve_dense`` turns it into kernel
configs for a call)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from .checks import check_combine, check_counts, check_invariant, check_split_policy
from .planner import FILL_SHARE_ONE, split_policy


@dataclasses.dataclass(frozen=True)
class DenseDecodeSchedule:
    """The dense decode schedule: how a batch is planned over the SMs and when the per-plan kernel
    choices switch.  The kernel itself (the seesaw on tile pairs, a load warpgroup, fp32 split partials)
    is fixed; ``docs/dense_decode.md`` explains each rule.

    num_sm_parts: parts (CTAs, or clusters, per KV head and M tile) a plan spreads over; None: FlashMLA's
        rule from the SM count.  Setting it also turns off the idle-SM fill.
    split_fixed_cost: the planner's cost of each request piece, in 64-token blocks, beside its blocks: higher
        splits fewer requests.
    unsplit_slack: keep every request whole when that costs the busiest part at most this many blocks more
        (per 64-row M tile) than FlashMLA's plan: a split also costs the partials and the combine.  0: FlashMLA's.
    even_split_slack: otherwise, cut each request too long for a part into equal pieces, one part each, when
        that costs at most this many blocks more (per M tile).  0: never.
    evict_first_tiles: KV loads are marked evict-first in L2 when the host knows the plan and its busiest
        part reads at most this many 64-token tiles (short plans, where a long read-once stream would push
        out the next request's tiles); longer plans load normally.
    quad_multicast_tiles: with 128 query heads a KV head and four M tiles to share them (s_q >= 2), take
        4-CTA clusters, each KV tile loaded once for four M tiles, when the host knows the plan and its
        busiest part reads at least this many tiles; else pairs.  An H200 holds 30 4-CTA clusters (120
        SMs): shorter plans lose more to the idle SMs than they gain.
    idle_sm_fill_share: a plan of 4-CTA clusters also runs pairs on the SMs the clusters leave idle; each
        such part reads this many sixteenths of another part's blocks (a pair beside the clusters runs
        slower).
    combine_chunked_batch: batches of at most this many requests combine each output row in 4 column chunks,
        one CTA each (few rows, many partials a row); 0: never.
    combine_spread_partials: in those batches, requests spanning at least this many parts (parts / b) merge a
        chunk on 8 warps instead of one; 0: never.
    invariant_piece_blocks, invariant_max_pieces: with ``enable_batch_invariant=True`` a request of ``t``
        64-token tiles is split into ``clamp(ceil(t / invariant_piece_blocks), 1, invariant_max_pieces)`` equal
        pieces, one part each, whatever the batch (``planner.invariant_plan``); the workspace holds
        ``invariant_max_pieces`` partials a request (fewer where the block table covers fewer tiles).
    """

    num_sm_parts: Optional[int] = None
    split_fixed_cost: int = 5
    unsplit_slack: int = 4
    even_split_slack: int = 4
    evict_first_tiles: int = 64
    quad_multicast_tiles: int = 290
    idle_sm_fill_share: int = 11
    combine_chunked_batch: int = 4
    combine_spread_partials: int = 48
    invariant_piece_blocks: int = 32
    invariant_max_pieces: int = 8

    def plan_policy(self, rows_per_kv_head: int) -> tuple[int, int, int]:
        """The planner's (``fixed_cost``, ``unsplit_slack``, ``even_split_slack``) in blocks for a KV head with
        ``rows_per_kv_head`` query rows (``planner.split_policy``)."""
        return split_policy(self, rows_per_kv_head)

    def validate(self) -> None:
        """Reject impossible schedules, naming the field."""
        check_split_policy(self)
        check_counts(self, "evict_first_tiles", "quad_multicast_tiles")
        if type(self.idle_sm_fill_share) is not int or not 1 <= self.idle_sm_fill_share <= FILL_SHARE_ONE:
            raise ValueError(f"idle_sm_fill_share must be an int from 1 to {FILL_SHARE_ONE} (sixteenths of a "
                             f"part's blocks), got {self.idle_sm_fill_share!r}")
        check_combine(self)
        check_invariant(self)


DEFAULT_DENSE_SCHEDULE = DenseDecodeSchedule()
