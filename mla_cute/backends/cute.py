"""The ``cute`` backend: launches the CuTe DSL kernels on SM90.

The first call with a metadata object runs the scheduler kernel (on the GPU, no host
synchronisation, so a CUDA graph can capture it) and sizes the split workspace; later
calls reuse both and cross into compiled code once (split + combine behind one entry, or the
split kernel alone when the host planner, run over lengths the host already has, splits no
request).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from ..backend import dense_plan_schedule, num_sms
from ..fp8 import FP8_BYTES_PER_TOKEN
from ..schedules import plan_has_split, sparse_num_sm_parts_for
from ..schedules.dense import DenseDecodeSchedule
from ..schedules.sparse import SparseDecodeSchedule

_LOG2_E = math.log2(math.e)


def _aligned(t: torch.Tensor) -> bool:
    """What TMA and the 16-byte loads need: unit last stride, 16-byte base and strides (16-bit elements)."""
    s = t.stride()
    if s[-1] != 1 or t.data_ptr() % 16:
        return False
    for x in s[:-1]:
        if x % 8:
            return False
    return True


def _packed_copy(t: torch.Tensor) -> torch.Tensor:
    """A fresh contiguous copy: new storage is 16-byte aligned (``contiguous()`` would return a
    contiguous tensor with a misaligned base unchanged)."""
    return t.clone(memory_format=torch.contiguous_format)


def query_rows(q: torch.Tensor, h_kv: int) -> torch.Tensor:
    """[b, s_q, h_q, d] -> [b, s_q * group, h_kv, d], row = s * group + head in group (a view when possible)."""
    b, s_q, h_q, d = q.shape
    if h_kv == 1 and q.is_contiguous():
        # Contiguous with d = 576: the strides are 16-byte multiples, only the base can be off.
        rows = q.view(b, s_q * h_q, 1, d)
        return rows if q.data_ptr() % 16 == 0 else _packed_copy(rows)
    if h_kv == 1:
        rows = q.reshape(b, s_q * h_q, 1, d)
    else:
        group = h_q // h_kv
        rows = q.view(b, s_q, h_kv, group, d).transpose(2, 3).reshape(b, s_q * group, h_kv, d)
    return rows if _aligned(rows) else _packed_copy(rows)


def check_supported(k_cache: torch.Tensor, is_fp8_kvcache: bool) -> None:
    if is_fp8_kvcache:
        raise NotImplementedError("dense decode over the FP8 cache (is_fp8_kvcache=True) has no 'cute' kernel yet")
    page = k_cache.shape[1]
    if page % 64 != 0:
        raise NotImplementedError(f"page_block_size {page}: the 'cute' dense kernel needs a multiple of 64")
    if not _aligned(k_cache):
        raise NotImplementedError("k_cache needs a contiguous last dimension, 16-byte aligned base and strides")


def _split_workspace(meta, lengths, max_len: int, parts: int, policy: tuple, b: int, h_kv: int, rows: int, device,
                     partial_dtype=torch.float32):
    """Run the GPU scheduler (``policy``: the planner's fixed cost and slacks, in blocks) over ``lengths``, each
    taken within [0, ``max_len``], into the metadata, and allocate the partials (O in ``partial_dtype``, lse in
    fp32).

    At most one partial per request plus one extra per part (a part splits at most one request).
    """
    from ..kernels.build import compile_scheduler

    sched = torch.empty(parts, 8, dtype=torch.int32, device=device)
    splits = torch.empty(b + 1, dtype=torch.int32, device=device)
    compile_scheduler(*policy)(lengths, sched, splits, max_len)
    meta.tile_scheduler_metadata, meta.num_splits = sched, splits
    o_accum = torch.empty(b + parts, h_kv, rows, 512, dtype=partial_dtype, device=device)
    lse_accum = torch.empty(b + parts, h_kv, rows, dtype=torch.float32, device=device)
    return o_accum, lse_accum


def _partial_dtype(schedule, out_dtype: torch.dtype) -> torch.dtype:
    """The dtype of split partials' O: the output's 16-bit dtype with ``partials_16bit``, else fp32 (FlashMLA's)."""
    return out_dtype if schedule.partials_16bit else torch.float32


def _reused_plan(meta, kind: str, first: bool, schedule):
    """The plan a metadata object already holds for ``kind``, or None when one must be built."""
    plan = meta._state.get(kind)
    if first or plan is None:
        return None
    if plan.schedule != schedule:
        raise ValueError(
            f"tile_scheduler_metadata was computed with schedule {plan.schedule}, this call asks for {schedule}; "
            "call get_mla_metadata() again to change the schedule"
        )
    return plan


def _outputs(plan, device):
    """FlashMLA's out ``[b, s_q, h_q, 512]`` (q dtype) and lse ``[b, h_q, s_q]``: the kernels write them in place."""
    out = torch.empty(plan.b, plan.s_q, plan.h_q, 512, dtype=plan.dtype, device=device)
    lse = torch.empty(plan.b, plan.h_q, plan.s_q, dtype=torch.float32, device=device)
    return out, lse


class DensePlan:
    """What a metadata object holds for the cute backend: compiled step, workspace, launch constants,
    and the facts (``replay_plan``) and q row shape of the last call that passed every check."""

    __slots__ = ("schedule", "kernel_schedule", "step", "o_accum", "lse_accum", "b", "s_q", "h_q", "h_kv", "dtype",
                 "facts", "q_rows", "records")

    def __init__(self, q, k_cache, block_table, causal, schedule: DenseDecodeSchedule, meta, cache_seqlens,
                 host_lengths):
        from ..kernels.build import compile_dense_decode

        schedule.validate()
        b, s_q, h_q, _ = q.shape
        page, h_kv = k_cache.shape[1], k_cache.shape[2]
        self.schedule, self.b, self.s_q, self.h_q, self.h_kv, self.dtype = schedule, b, s_q, h_q, h_kv, q.dtype
        self.facts = self.q_rows = None
        # ``multicast_ctas=None`` is decided on the lengths (4-CTA clusters for long plans), and with it the
        # part count (4-CTA clusters leave SMs idle).
        plan = dense_plan_schedule(q.device, schedule, s_q, h_q, h_kv, causal, host_lengths)
        # The step with the combine, for a plan the host does not know, is loaded in any case: a CUDA
        # graph captured later plans on the device and needs it, and nothing should be loaded during a
        # capture.  With the lengths on the host (``host_lengths``, read by the first call's value
        # checks; None inside a capture) the host planner tells whether any request is split (if none
        # is, the combine is left out) and how many tiles its busiest part reads (``kv_evict_first=None``
        # decides the loads' cache policy on it).  A plan of 4-CTA clusters with fill parts runs the
        # idle-SM fill's step (``kernels/fill.py``), a plan the host does not know too.
        unknown = plan if host_lengths is None else dense_plan_schedule(q.device, schedule, s_q, h_q, h_kv, causal)
        self.kernel_schedule = unknown.schedule.for_plan(None)
        self.step = compile_dense_decode(q.dtype, s_q, h_q, h_kv, causal, page, self.kernel_schedule,
                                         with_combine=True, fill=unknown.fill_parts > 0)
        rows = s_q * (h_q // h_kv)
        if plan.facts is not None:
            split, busiest = plan.facts
            chosen = plan.schedule.for_plan(busiest)
            # (Equal schedules give equal fill parts: they follow from the schedule and the shape.)
            if not split or chosen != self.kernel_schedule:
                self.kernel_schedule = chosen
                self.step = compile_dense_decode(q.dtype, s_q, h_q, h_kv, causal, page, chosen, with_combine=split,
                                                 fill=plan.fill_parts > 0)
        self.o_accum, self.lse_accum = _split_workspace(
            meta, cache_seqlens, block_table.shape[1] * page, plan.parts, plan.policy, b, h_kv, rows, q.device,
            _partial_dtype(self.kernel_schedule, q.dtype)
        )
        # The step's records: the clusters' and the fill's tables (views of the metadata's), or the whole table.
        sched = meta.tile_scheduler_metadata
        clusters = plan.parts - plan.fill_parts
        self.records = (sched[:clusters], sched[clusters:]) if plan.fill_parts else (sched,)


def dense_decode(q, k_cache, block_table, cache_seqlens, softmax_scale, causal, meta, first,
                 schedule: DenseDecodeSchedule, host_lengths=None):
    """``host_lengths``: ``cache_seqlens`` on the host when the caller has read them (a new plan then
    leaves out the combine if it splits no request), else None."""
    plan = _reused_plan(meta, "dense", first, schedule)
    if plan is None:
        plan = meta._state["dense"] = DensePlan(q, k_cache, block_table, causal, schedule, meta, cache_seqlens,
                                                host_lengths)
    rows = query_rows(q, plan.h_kv)
    # With one KV head the rows are a plain view of q when the strides allow (same storage): a
    # replay of this call (``replay_plan``) then only re-views.  Grouped heads reorder, so they
    # always go through query_rows.
    plan.q_rows = tuple(rows.shape) if plan.h_kv == 1 and rows.data_ptr() == q.data_ptr() else None
    return _launch(plan, rows, k_cache, block_table, cache_seqlens, meta, softmax_scale, q.device)


def _launch(plan: DensePlan, rows, k_cache, block_table, cache_seqlens, meta, softmax_scale, device):
    """Allocate the outputs and run the compiled step (split + combine) once."""
    out, lse = _outputs(plan, device)
    plan.step(
        rows, k_cache, block_table, cache_seqlens, *plan.records, meta.num_splits, out, lse,
        plan.o_accum, plan.lse_accum, softmax_scale * _LOG2_E,
    )
    return out, lse


def dense_call_facts(q, k_cache, block_table, head_dim_v, causal, is_fp8_kvcache) -> tuple:
    """Everything the checks of a dense call read, except the lengths (the metadata tracks those)."""
    return (
        q.shape, q.stride(), q.dtype, q.device, q.data_ptr() % 16,
        k_cache.shape, k_cache.stride(), k_cache.dtype, k_cache.device, k_cache.data_ptr() % 16,
        block_table.shape, block_table.stride(), block_table.dtype, block_table.device,
        head_dim_v, causal, is_fp8_kvcache,
    )


def replay_plan(meta, q, k_cache, block_table, head_dim_v, causal, is_fp8_kvcache) -> DensePlan:
    """Mark the metadata's dense plan replayable for calls with the facts of this one, which just
    passed every check in ``dense_decode``."""
    plan = meta._state["dense"]
    plan.facts = dense_call_facts(q, k_cache, block_table, head_dim_v, causal, is_fp8_kvcache)
    return plan


def replay_dense(plan: DensePlan, q, k_cache, block_table, cache_seqlens, meta, softmax_scale):
    """The launch of ``dense_decode`` for a call ``replay_plan`` vouched for: equal facts make the
    rows the same view of q, or the same reordered copy."""
    rows = q.view(plan.q_rows) if plan.q_rows is not None else query_rows(q, plan.h_kv)
    return _launch(plan, rows, k_cache, block_table, cache_seqlens, meta, softmax_scale, q.device)


def precompile_dense(dtype, s_q, h_q, h_kv, causal, page, schedule: DenseDecodeSchedule) -> None:
    from ..kernels.build import compile_dense_decode, compile_scheduler

    schedule.validate()
    # Every kernel a plan can choose (``for_plan``: the loads' cache policy and the partials' dtype), from the
    # busiest part's tile counts where a choice changes.
    edges = (schedule.evict_first_tiles, schedule.partials_16bit_tiles)
    counts = [None] + [n + d for n in edges for d in (0, 1)]
    kernels = [schedule.multicast_for_plan(None).for_plan(n) for n in counts]
    # And, where the kernel has four M tiles to a cluster, those of plans long enough for 4-CTA clusters
    # (``multicast_for_plan``; their busiest part reads at least ``quad_multicast_tiles`` tiles).
    # With the idle-SM fill (as this process's GPU, or an H200, allows it) they run as its steps, planned by a
    # scheduler with fill parts.
    quad_tiles = schedule.quad_multicast_tiles
    quad = schedule.multicast_for_plan(quad_tiles)
    causal = causal and s_q > 1
    quad_plan = None
    if quad.cluster_ctas_of_call(s_q, h_q, h_kv, causal) == 4:
        kernels += [quad.for_plan(n) for n in counts[1:] + [quad_tiles] if n >= quad_tiles]
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        quad_plan = dense_plan_schedule(device, quad, s_q, h_q, h_kv, causal)
    for kernel_schedule in dict.fromkeys(kernels):
        with_fill = bool(quad_plan and quad_plan.fill_parts) and kernel_schedule.multicast_ctas == 4
        for with_combine in (True, False):  # a plan that splits no request leaves the combine out
            compile_dense_decode(dtype, s_q, h_q, h_kv, causal, page, kernel_schedule, with_combine=with_combine,
                                 fill=with_fill)
    compile_scheduler(*schedule.plan_policy(s_q * (h_q // h_kv)))
    if quad_plan and quad_plan.fill_parts:
        compile_scheduler(*quad_plan.policy)


# ---------------------------------------------------------------- sparse FP8 decode
def check_sparse_supported(k_cache: torch.Tensor) -> None:
    """The sparse kernel reads 656-byte rows with 16-byte loads: rows packed within a page, 16-byte aligned."""
    if k_cache.stride(3) != 1 or k_cache.stride(1) != FP8_BYTES_PER_TOKEN:
        raise NotImplementedError(
            f"k_cache: the 'cute' sparse kernel needs the {FP8_BYTES_PER_TOKEN}-byte rows of a page packed "
            f"(strides [*, {FP8_BYTES_PER_TOKEN}, *, 1]), got strides {list(k_cache.stride())}"
        )
    if k_cache.data_ptr() % 16 != 0 or k_cache.stride(0) % 16 != 0:
        raise NotImplementedError("k_cache: the 'cute' sparse kernel needs a 16-byte aligned base and block stride")


class SparsePlan:
    """What a metadata object holds for the sparse cute kernel: the compiled step and the workspace.
    ``schedule`` is the call's, ``kernel_schedule`` the one resolved for the plan (``for_plan``)."""

    __slots__ = ("schedule", "kernel_schedule", "step", "o_accum", "lse_accum", "b", "s_q", "h_q", "has_sink",
                 "dtype", "facts")

    def __init__(self, q, topk: int, topk_length, has_sink: bool, schedule: SparseDecodeSchedule, meta):
        from ..kernels.build import compile_sparse_decode

        schedule.validate()
        b, s_q, h_q, _ = q.shape
        self.schedule, self.b, self.s_q, self.h_q, self.has_sink, self.dtype = schedule, b, s_q, h_q, has_sink, q.dtype
        self.facts = None
        parts = schedule.num_sm_parts or sparse_num_sm_parts_for(num_sms(q.device), s_q, h_q)
        # A small plan (few tiles a part, from the shapes alone) takes its own fixed cost and partials.
        chosen = self.kernel_schedule = schedule.for_plan(schedule.small_plan(b, topk, parts))
        # Without topk_length every request has topk tokens: the kernel is built for that and loads no
        # length (the first call's choice holds for the metadata's later calls, as for attn_sink), and
        # the host knows the plan: when it splits no request, the split kernel writes every output
        # itself and the combine is left out.  The step with the combine is loaded in any case, for a
        # CUDA graph captured later, and a capture keeps it (nothing can be loaded during one).
        given = topk_length is not None
        self.step = compile_sparse_decode(s_q, h_q, has_sink, chosen, with_combine=True, has_topk_length=given)
        capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
        policy = chosen.plan_policy(s_q * h_q)
        if not given and not capturing and not _topk_plan_has_split(b, topk, parts, policy):
            self.step = compile_sparse_decode(s_q, h_q, has_sink, chosen, with_combine=False, has_topk_length=False)
        lengths = (topk_length if given else torch.full((b,), topk, dtype=torch.int32, device=q.device)).clamp(1, topk)
        self.o_accum, self.lse_accum = _split_workspace(
            meta, lengths, topk, parts, policy, b, 1, s_q * h_q, q.device, _partial_dtype(chosen, q.dtype)
        )


@functools.lru_cache(maxsize=64)
def _topk_plan_has_split(b: int, topk: int, parts: int, policy: tuple) -> bool:
    """Whether the plan of ``b`` requests of ``topk`` tokens each splits one (``policy``: the planner's fixed
    cost and slacks): the same on every decode step, so the host walk runs once."""
    return plan_has_split(torch.full((b,), topk, dtype=torch.int64), parts, 64, *policy)


def sparse_decode(q, k_cache, indices, topk_length, attn_sink, softmax_scale, meta, first,
                  schedule: SparseDecodeSchedule):
    has_sink = attn_sink is not None
    plan = _reused_plan(meta, "sparse", first, schedule)
    if plan is None:
        plan = meta._state["sparse"] = SparsePlan(q, indices.shape[-1], topk_length, has_sink, schedule, meta)
    elif plan.has_sink != has_sink:
        raise ValueError(
            "attn_sink must be given on every call with this tile_scheduler_metadata or on none "
            f"(first call: {'given' if plan.has_sink else 'None'})"
        )
    return launch_sparse(plan, q, k_cache, indices, topk_length, attn_sink, softmax_scale, meta)


def launch_sparse(plan: SparsePlan, q, k_cache, indices, topk_length, attn_sink, softmax_scale, meta):
    """Allocate the outputs and run the compiled sparse step once (``sparse_decode``, and the replay of a
    call ``replay_sparse_plan`` vouched for)."""
    out, lse = _outputs(plan, q.device)
    plan.step(
        q if _aligned(q) else _packed_copy(q),
        k_cache.view(torch.int32).select(2, 0),  # the 656-byte rows as 164 int32 words (a view)
        indices if indices.stride(-1) == 1 else indices.contiguous(),
        topk_length,
        meta.tile_scheduler_metadata, meta.num_splits, out, lse, plan.o_accum, plan.lse_accum,
        attn_sink.contiguous() if attn_sink is not None else None,
        softmax_scale * _LOG2_E,
    )
    return out, lse


def _tensor_facts(t) -> Optional[tuple]:
    """What the checks read of an optional tensor argument (raises AttributeError for a non-tensor)."""
    if t is None:
        return None
    return (type(t), t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16)


def sparse_call_facts(q, k_cache, indices, topk_length, attn_sink, block_table, cache_seqlens, head_dim_v,
                      causal, is_fp8_kvcache) -> tuple:
    """Everything the checks of a sparse call read, except topk_length's identity and values (the
    metadata tracks those)."""
    return (
        _tensor_facts(q), _tensor_facts(k_cache), _tensor_facts(indices), _tensor_facts(topk_length),
        _tensor_facts(attn_sink), _tensor_facts(block_table), _tensor_facts(cache_seqlens),
        head_dim_v, causal, is_fp8_kvcache,
    )


def replay_sparse_plan(meta, q, k_cache, indices, topk_length, attn_sink, block_table, cache_seqlens, head_dim_v,
                       causal, is_fp8_kvcache) -> SparsePlan:
    """Mark the metadata's sparse plan replayable for calls with the facts of this one, which just
    passed every check in ``sparse_decode``."""
    plan = meta._state["sparse"]
    plan.facts = sparse_call_facts(q, k_cache, indices, topk_length, attn_sink, block_table, cache_seqlens,
                                   head_dim_v, causal, is_fp8_kvcache)
    return plan


def precompile_sparse(s_q, h_q, has_sink, schedule: SparseDecodeSchedule, has_topk_length: bool = False) -> None:
    from ..kernels.build import compile_scheduler, compile_sparse_decode

    schedule.validate()
    # Both plan kinds (``small_plan``: a shape fact of each call), where they differ.
    kinds = (False, True) if schedule.small_plan_tiles else (False,)
    for chosen in dict.fromkeys(schedule.for_plan(small) for small in kinds):
        compile_sparse_decode(s_q, h_q, has_sink, chosen, with_combine=True, has_topk_length=has_topk_length)
        if not has_topk_length:  # a plan that splits no request leaves the combine out (known only without lengths)
            compile_sparse_decode(s_q, h_q, has_sink, chosen, with_combine=False)
        compile_scheduler(*chosen.plan_policy(s_q * h_q))
