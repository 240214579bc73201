"""Checks every schedule shares: its fields' types and ranges, and the shared-memory budget."""

from __future__ import annotations

# Per-SM shared memory a CTA may use on Hopper (227 KiB).
SMEM_CAPACITY = 232448


def check_kv_stages(schedule) -> None:
    if not isinstance(schedule.kv_stages, int) or schedule.kv_stages < 1:
        raise ValueError(f"kv_stages must be an int >= 1, got {schedule.kv_stages!r}")


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


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
    check_bool("combine_pdl", schedule.combine_pdl)


def check_smem(schedule) -> None:
    need = schedule.smem_bytes()
    if need > SMEM_CAPACITY:
        raise ValueError(
            f"schedule needs {need} bytes of shared memory (kv_stages={schedule.kv_stages}), "
            f"more than the {SMEM_CAPACITY} a Hopper CTA can have"
        )
