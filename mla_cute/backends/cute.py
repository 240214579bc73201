"""The ``cute`` backend: launches the CuTe DSL kernels on SM90.

Per decode step and metadata object, the first call runs the scheduler kernel (GPU,
no host synchronisation) and allocates the split workspace; later calls reuse both.
"""

from __future__ import annotations

import math

import torch

from ..schedules import DEFAULT_DENSE_SCHEDULE, num_sm_parts_for
from ..schedules.dense import DenseDecodeSchedule

_LOG2_E = math.log2(math.e)
_num_sms: dict = {}


def num_sms(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _num_sms:
        _num_sms[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _num_sms[idx]


def _aligned(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in t.stride()[:-1])


def query_rows(q: torch.Tensor, h_kv: int) -> torch.Tensor:
    """[b, s_q, h_q, d] -> [b, s_q * group, h_kv, d], row = s * group + head in group (a view when possible)."""
    b, s_q, h_q, d = q.shape
    group = h_q // h_kv
    rows = q.view(b, s_q, h_kv, group, d).transpose(2, 3).reshape(b, s_q * group, h_kv, d)
    return rows if _aligned(rows) else rows.contiguous()


def dense_decode(
    q, k_cache, block_table, cache_seqlens, softmax_scale, causal, is_fp8_kvcache, meta, first,
    schedule: DenseDecodeSchedule = DEFAULT_DENSE_SCHEDULE,
):
    if is_fp8_kvcache:
        raise NotImplementedError("dense decode over the FP8 cache (is_fp8_kvcache=True) has no 'cute' kernel yet")
    from ..kernels.build import compile_combine, compile_dense_decode, compile_scheduler

    b, s_q, h_q, _ = q.shape
    page, h_kv = k_cache.shape[1], k_cache.shape[2]
    if page % 64 != 0:
        raise NotImplementedError(f"page_block_size {page}: the 'cute' dense kernel needs a multiple of 64")
    if not _aligned(k_cache):
        raise NotImplementedError("k_cache needs a contiguous last dimension, 16-byte aligned base and strides")
    group = h_q // h_kv
    rows = s_q * group
    state = meta._state.get("dense")
    if first or state is None:
        parts = schedule.num_sm_parts or num_sm_parts_for(num_sms(q.device), s_q, h_q, h_kv)
        sched = torch.empty(parts, 8, dtype=torch.int32, device=q.device)
        splits = torch.empty(b + 1, dtype=torch.int32, device=q.device)
        compile_scheduler(schedule.split_fixed_cost)(cache_seqlens, sched, splits)
        meta.tile_scheduler_metadata, meta.num_splits = sched, splits
        state = {
            "o_accum": torch.empty(b + parts, h_kv, rows, 512, dtype=torch.float32, device=q.device),
            "lse_accum": torch.empty(b + parts, h_kv, rows, dtype=torch.float32, device=q.device),
            "split": compile_dense_decode(q.dtype, s_q, h_q, h_kv, causal, page, schedule),
            "combine": compile_combine(q.dtype, rows, h_kv),
        }
        meta._state["dense"] = state
    q_rows = query_rows(q, h_kv)
    out = torch.empty(b, h_kv, rows, 512, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, h_kv, rows, dtype=torch.float32, device=q.device)
    state["split"](
        q_rows, k_cache, block_table, cache_seqlens, meta.tile_scheduler_metadata, meta.num_splits,
        out, lse, state["o_accum"], state["lse_accum"], softmax_scale * _LOG2_E,
    )
    state["combine"](meta.num_splits, state["o_accum"], state["lse_accum"], out, lse)
    out = out.view(b, h_kv, s_q, group, 512).transpose(1, 2).reshape(b, s_q, h_q, 512)
    lse = lse.view(b, h_kv, s_q, group).transpose(2, 3).reshape(b, h_q, s_q)
    return out, lse
