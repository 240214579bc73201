"""Schedules as plain Python data, the split-KV planner, and the resolvers from a schedule and a call to
frozen kernel configs (imported as ``mla_cute.schedules``)."""

from .configs import (CombineConfig, DenseSplitConfig, DenseStepConfig, SchedulerConfig, SparsePrefillConfig,
                      SparseSplitConfig, SparseStepConfig)
from .dense import DEFAULT_DENSE_SCHEDULE, DenseDecodeSchedule
from .planner import (RECORD_FIELDS, RECORD_SIZE, call_invariant_plan, invariant_plan, m_tiles_for,
                      num_sm_parts_for, plan_facts, plan_has_split, plan_splits, sparse_lengths,
                      sparse_num_sm_parts_for, whole_token_plan)
from .resolve import (HOPPER, DenseCall, DeviceFacts, SparseCall, SparsePrefillCall, SparsePrefillFp8Call,
                      dense_precompile_steps, dense_tensor_plan, experiment, resolve_dense, resolve_dense_invariant,
                      resolve_sparse, resolve_sparse_invariant, resolve_sparse_prefill,
                      resolve_sparse_prefill_fp8, sparse_precompile_steps, sparse_tensor_plan,
                      sparse_prefill_precompile_configs)
from .sparse import DEFAULT_SPARSE_SCHEDULE, SparseDecodeSchedule

__all__ = [
    "DEFAULT_DENSE_SCHEDULE",
    "DenseDecodeSchedule",
    "DEFAULT_SPARSE_SCHEDULE",
    "SparseDecodeSchedule",
    "CombineConfig",
    "DenseSplitConfig",
    "DenseStepConfig",
    "SchedulerConfig",
    "SparseSplitConfig",
    "SparseStepConfig",
    "SparsePrefillConfig",
    "SparsePrefillCall",
    "SparsePrefillFp8Call",
    "DeviceFacts",
    "HOPPER",
    "DenseCall",
    "SparseCall",
    "resolve_dense",
    "resolve_dense_invariant",
    "resolve_sparse_invariant",
    "dense_tensor_plan",
    "sparse_tensor_plan",
    "resolve_sparse",
    "resolve_sparse_prefill",
    "resolve_sparse_prefill_fp8",
    "sparse_prefill_precompile_configs",
    "dense_precompile_steps",
    "sparse_precompile_steps",
    "experiment",
    "RECORD_FIELDS",
    "RECORD_SIZE",
    "m_tiles_for",
    "num_sm_parts_for",
    "plan_facts",
    "plan_has_split",
    "plan_splits",
    "invariant_plan",
    "call_invariant_plan",
    "sparse_lengths",
    "sparse_num_sm_parts_for",
    "whole_token_plan",
]
