"""Checks every schedule shares: its fields' types and ranges."""

from __future__ import annotations


def check_counts(schedule, *names: str) -> None:
    """Each of the fields ``names`` is an int >= 0 (a bool is not)."""
    for name in names:
        value = getattr(schedule, name)
        if type(value) is not int or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")


def check_split_policy(schedule) -> None:
    """``split_fixed_cost``, ``unsplit_slack``, ``even_split_slack`` and ``num_sm_parts``: the planner's cost
    per request piece, its slacks for whole requests and even pieces, and the part count."""
    check_counts(schedule, "split_fixed_cost", "unsplit_slack", "even_split_slack")
    parts = schedule.num_sm_parts
    if parts is not None and (type(parts) is not int or parts < 1):
        raise ValueError(f"num_sm_parts must be None or an int >= 1, got {parts!r}")


def check_combine(schedule) -> None:
    check_counts(schedule, "combine_chunked_batch", "combine_spread_partials")


def check_invariant(schedule) -> None:
    """``invariant_piece_blocks`` and ``invariant_max_pieces``: the batch-invariant plan's piece size and count,
    ints >= 1."""
    for name in ("invariant_piece_blocks", "invariant_max_pieces"):
        value = getattr(schedule, name)
        if type(value) is not int or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
