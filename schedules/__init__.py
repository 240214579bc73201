"""Schedules as plain Python data, and the split-KV planner (imported as ``mla_cute.schedules``)."""

from .checks import SMEM_CAPACITY
from .dense import (
    DEFAULT_DENSE_SCHEDULE,
    PREFETCH_DENSE_SCHEDULE,
    SEESAW_DENSE_SCHEDULE,
    SERIAL_DENSE_SCHEDULE,
    DenseDecodeSchedule,
)
from .sparse import (
    CROSSOVER_SPARSE_SCHEDULE,
    DEFAULT_SPARSE_SCHEDULE,
    NO_CROSSOVER_SPARSE_SCHEDULE,
    SERIAL_SPARSE_SCHEDULE,
    SparseDecodeSchedule,
)
from .planner import (RECORD_FIELDS, RECORD_SIZE, m_tiles_for, num_sm_parts_for, plan_facts, plan_has_split, plan_splits,
                      sparse_lengths, sparse_num_sm_parts_for)

__all__ = [
    "DEFAULT_DENSE_SCHEDULE",
    "SERIAL_DENSE_SCHEDULE",
    "PREFETCH_DENSE_SCHEDULE",
    "SEESAW_DENSE_SCHEDULE",
    "SMEM_CAPACITY",
    "DenseDecodeSchedule",
    "DEFAULT_SPARSE_SCHEDULE",
    "NO_CROSSOVER_SPARSE_SCHEDULE",
    "CROSSOVER_SPARSE_SCHEDULE",
    "SERIAL_SPARSE_SCHEDULE",
    "SparseDecodeSchedule",
    "RECORD_FIELDS",
    "RECORD_SIZE",
    "m_tiles_for",
    "num_sm_parts_for",
    "plan_facts",
    "plan_has_split",
    "plan_splits",
    "sparse_lengths",
    "sparse_num_sm_parts_for",
]
