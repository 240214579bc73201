"""What a user may tune of sparse FP8 decode, as plain data (``resolve.resolve_sparse`` turns it into kernel
configs for a call)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from .checks import check_combine, check_counts, check_invariant, check_split_policy
from .planner import split_policy


@dataclasses.dataclass(frozen=True)
class SparseDecodeSchedule:
    """The sparse FP8 decode schedule: how a batch is planned over the SMs, and which plans count as small.
    The kernel itself (the crossover where head tiles pair, the leader-follower consumers, fp16 MMA
    operands) is fixed; ``docs/sparse_decode.md`` explains each rule.

    num_sm_parts: parts (CTAs per query token and 64-head tile) a plan spreads over; None: FlashMLA's rule.
    split_fixed_cost: the planner's cost of each request piece, in 64-token blocks, beside its blocks.
    unsplit_slack, even_split_slack: as for dense decode (whole requests, even pieces); 0: FlashMLA's plan.
    small_plan_tiles: a call whose parts get from 2 to this many 64-token tiles each
        (``ceil(b * (topk tiles + split_fixed_cost) / parts)``, a shape fact) is a small plan: its time goes
        to each part's start and end and to the combine, so it is planned with ``small_plan_fixed_cost``,
        writes 16-bit partials and keeps every producer warp on every tile.  0: never.
    small_plan_fixed_cost: the planner's fixed cost per request piece for small plans.
    combine_chunked_batch, combine_spread_partials: as for dense decode.
    invariant_piece_blocks, invariant_max_pieces: as for dense decode, over a request's tiles (topk's, or both
        caches'); the workspace holds ``min(invariant_max_pieces, ceil(topk's tiles / invariant_piece_blocks))``
        partials a request.
    """

    num_sm_parts: Optional[int] = None
    split_fixed_cost: int = 5
    unsplit_slack: int = 0
    even_split_slack: int = 0
    small_plan_tiles: int = 4
    small_plan_fixed_cost: int = 1
    combine_chunked_batch: int = 4
    combine_spread_partials: int = 48
    invariant_piece_blocks: int = 8
    invariant_max_pieces: int = 4

    def small_plan(self, b: int, topk: int, parts: int) -> bool:
        """Whether ``b`` requests of ``topk`` tokens over ``parts`` parts make a small plan (``small_plan_tiles``):
        a shape fact, so every call with the same shapes takes the same kernel and plan policy.  Parts of one
        tile gain nothing from it (the smaller fixed cost leaves such a plan as it is)."""
        tiles = -(-(b * (-(-topk // 64) + self.split_fixed_cost)) // parts)
        return 2 <= tiles <= self.small_plan_tiles

    def plan_policy(self, rows: int, small: bool = False) -> tuple[int, int, int]:
        """The planner's (``fixed_cost``, ``unsplit_slack``, ``even_split_slack``) in blocks for requests of
        ``rows`` query rows (s_q x h_q), of a small plan or not."""
        fixed, unsplit, even = split_policy(self, rows)
        return (self.small_plan_fixed_cost if small else fixed), unsplit, even

    def validate(self) -> None:
        """Reject impossible schedules, naming the field."""
        check_split_policy(self)
        check_counts(self, "small_plan_tiles", "small_plan_fixed_cost")
        check_combine(self)
        check_invariant(self)


DEFAULT_SPARSE_SCHEDULE = SparseDecodeSchedule()
