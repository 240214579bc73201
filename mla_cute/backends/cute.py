"""The ``cute`` backend: launches the CuTe DSL kernels on SM90.

The first call with a metadata object runs the scheduler kernel (on the GPU, no host
synchronisation, so a CUDA graph can capture it) and sizes the split workspace; later
calls reuse both and cross into compiled code once (split + combine behind one entry, or the
split kernel alone when the host planner, run over lengths the host already has, splits no
request).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..device import device_facts, num_sms
from ..fp8 import D_QK
from ..kv_formats import BYTES_PER_TOKEN, PAGE_BLOCKED, page_rows
from ..validation import sink_presence_error
from ..schedules.configs import WriteCacheConfig
from ..schedules.dense import DenseDecodeSchedule
from ..schedules.planner import call_invariant_plan, whole_token_plan
from ..schedules.resolve import (DeviceFacts, dense_precompile_steps, dense_tensor_plan, resolve_dense,
                                resolve_dense_invariant, resolve_sparse, resolve_sparse_invariant,
                                resolve_sparse_prefill, resolve_sparse_prefill_fp8, sparse_precompile_steps,
                                sparse_prefill_precompile_configs, sparse_tensor_plan)
from ..schedules.sparse import SparseDecodeSchedule

_LOG2_E = math.log2(math.e)


def _aligned(t: torch.Tensor) -> bool:
    """What TMA and the 16-byte loads need: unit last stride, 16-byte base and strides."""
    s = t.stride()
    if s[-1] != 1 or t.data_ptr() % 16:
        return False
    size = t.element_size()
    for x in s[:-1]:
        if x * size % 16:
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


def check_supported(k_cache: torch.Tensor, is_fp8_kvcache: bool, planned: bool = True) -> None:
    """What the dense kernels read; the 656-byte FP8 cache through the sparse kernel (``dense_positions``), on a
    plan of its own (``planned``: with a metadata object, not a plan given as tensors)."""
    if k_cache.shape[-1] != D_QK and not is_fp8_kvcache:
        raise NotImplementedError(f"q and k_cache: the 'cute' dense kernel reads rows of {D_QK} features, got head_dim "
                                  f"{k_cache.shape[-1]} (backend='reference' runs it)")
    if is_fp8_kvcache and k_cache.shape[-1] == 656 and planned:
        check_sparse_supported(k_cache, "V32")
        return
    if is_fp8_kvcache and k_cache.shape[-1] == 656:
        raise NotImplementedError("dense decode over the 656-byte FP8 cache runs the sparse kernel on a plan of its "
                                  "own: pass a FlashMLASchedMeta from get_mla_metadata(), not tensors")
    if is_fp8_kvcache:
        raise NotImplementedError("dense decode over the per-tensor FP8 cache (descale_k) has no 'cute' kernel yet "
                                  "(backend='reference' runs it)")
    page = k_cache.shape[1]
    if page % 64 != 0:
        raise NotImplementedError(f"page_block_size {page}: the 'cute' dense kernel needs a multiple of 64")
    if not _aligned(k_cache):
        raise NotImplementedError("k_cache needs a contiguous last dimension, 16-byte aligned base and strides")


def _split_workspace(meta, lengths, max_len: int, parts: int, scheduler, b: int, h_kv: int, rows: int, device,
                     partial_dtype=torch.float32, extra_lengths=None, extra_max: int = 0):
    """Run the GPU scheduler (``scheduler``: its ``SchedulerConfig``) over ``lengths``, read as its ``lengths``
    says (within [0, ``max_len``]; over two caches with ``extra_lengths`` within [0, ``extra_max``]), into the
    metadata, and allocate the partials (O in ``partial_dtype``, lse in fp32)."""
    meta.tile_scheduler_metadata, meta.num_splits = run_scheduler(scheduler, lengths, parts, max_len, extra_lengths,
                                                                  extra_max)
    return _partials(b, parts, h_kv, rows, device, partial_dtype)


def run_scheduler(scheduler, lengths, parts: int, max_len: int, extra_lengths=None, extra_max: int = 0):
    """The GPU scheduler's plan over ``lengths`` (see ``_split_workspace``): records ``[parts, 8]`` and the split
    counts' prefix sum ``[b + 1]``, int32, on the lengths' device."""
    from ..kernels.build import compile_scheduler

    sched = torch.empty(parts, 8, dtype=torch.int32, device=lengths.device)
    splits = torch.empty(lengths.shape[0] + 1, dtype=torch.int32, device=lengths.device)
    compile_scheduler(scheduler)(lengths, extra_lengths, sched, splits, max_len, extra_max)
    return sched, splits


def _partials(b: int, parts: int, h_kv: int, rows: int, device, partial_dtype=torch.float32):
    """The split kernel's partials: at most one per request plus one extra per part (a part splits at most one
    request)."""
    o_accum = torch.empty(b + parts, h_kv, rows, 512, dtype=partial_dtype, device=device)
    lse_accum = torch.empty(b + parts, h_kv, rows, dtype=torch.float32, device=device)
    return o_accum, lse_accum


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


def _outputs(plan, device, out=None):
    """A plan's call's outputs (``decode_outputs``)."""
    return decode_outputs(plan.b, plan.s_q, plan.h_q, plan.dtype, device, out)


def decode_outputs(b: int, s_q: int, h_q: int, dtype, device, out=None):
    """FlashMLA's out ``[b, s_q, h_q, 512]`` (q dtype; the caller's ``out`` when given, checked by
    ``validation.check_out``) and lse ``[b, h_q, s_q]``: the kernels write them in place."""
    if out is None:
        out = torch.empty(b, s_q, h_q, 512, dtype=dtype, device=device)
    lse = torch.empty(b, h_q, s_q, dtype=torch.float32, device=device)
    return out, lse


class DensePlan:
    """What a metadata object holds for the cute backend: compiled step, workspace, launch constants,
    and the facts (``replay_plan``) and q row shape of the last call that passed every check."""

    __slots__ = ("schedule", "config", "step", "o_accum", "lse_accum", "b", "s_q", "h_q", "h_kv", "dtype", "facts",
                 "q_rows", "records", "d_qk", "invariant")

    def __init__(self, q, k_cache, block_table, causal, schedule: DenseDecodeSchedule, meta, cache_seqlens,
                 host_lengths, invariant: bool = False):
        from ..kernels.build import compile_all, compile_dense, compile_scheduler

        b, s_q, h_q, self.d_qk = q.shape
        page, h_kv = k_cache.shape[1], k_cache.shape[2]
        self.schedule, self.b, self.s_q, self.h_q, self.h_kv, self.dtype = schedule, b, s_q, h_q, h_kv, q.dtype
        self.facts = self.q_rows = None
        self.invariant = invariant
        if invariant:
            self._plan_invariant(q, block_table, causal, page, meta, cache_seqlens)
            return
        # With the lengths on the host (``host_lengths``, read by the first call's value checks; None inside a
        # capture) the resolver knows the plan: its cluster size, loads and whether it splits a request.  The
        # step of a plan the host does not know is loaded in any case, for a CUDA graph captured later.
        call = self.config = resolve_dense(schedule, dtype=str(q.dtype).replace("torch.", ""), s_q=s_q, h_q=h_q,
                                           h_kv=h_kv, causal=causal, page=page, device=device_facts(q.device),
                                           host_lengths=host_lengths)
        # The capture step too (for a CUDA graph captured later) and the scheduler (run below): any of them that
        # are cold build at once.
        _, self.step = compile_all([(compile_dense, call.capture_step), (compile_dense, call.step),
                                    (compile_scheduler, call.scheduler)])[:2]
        self.o_accum, self.lse_accum = _split_workspace(
            meta, cache_seqlens, block_table.shape[1] * page, call.parts, call.scheduler, b, h_kv,
            s_q * (h_q // h_kv), q.device)
        # The step's records: the clusters' and the fill's tables (views of the metadata's), or the whole table.
        sched = meta.tile_scheduler_metadata
        clusters = call.parts - call.fill_parts
        self.records = (sched[:clusters], sched[clusters:]) if call.fill_parts else (sched,)

    def _plan_invariant(self, q, block_table, causal, page, meta, cache_seqlens):
        """The batch-invariant plan (``enable_batch_invariant=True``): one step for every batch, each request cut
        by its own length (``planner.invariant_plan``, torch operations on the lengths' device)."""
        from ..kernels.build import compile_dense

        step = self.config = resolve_dense_invariant(
            self.schedule, dtype=str(q.dtype).replace("torch.", ""), s_q=self.s_q, h_q=self.h_q, h_kv=self.h_kv,
            causal=causal, page=page, device=device_facts(q.device))
        self.step = compile_dense(step)
        meta.tile_scheduler_metadata, meta.num_splits = call_invariant_plan(
            self.schedule, "dense", cache_seqlens, block_table.shape[1] * page)
        self.o_accum, self.lse_accum = _invariant_partials(meta.tile_scheduler_metadata, self.h_kv,
                                                           self.s_q * (self.h_q // self.h_kv), q.device)
        self.records = (meta.tile_scheduler_metadata,)


def _invariant_partials(records, h_kv: int, rows: int, device):
    """A batch-invariant plan's partials (fp32): one a record (a request's pieces at most its records)."""
    return _partials(0, records.shape[0], h_kv, rows, device)


def dense_decode(q, k_cache, block_table, cache_seqlens, softmax_scale, causal, meta, first,
                 schedule: DenseDecodeSchedule, host_lengths=None, out=None, invariant: bool = False):
    """``host_lengths``: ``cache_seqlens`` on the host when the caller has read them (a new plan then
    leaves out the combine if it splits no request), else None.  ``invariant``: the batch-invariant plan."""
    block_table, cache_seqlens = kernel_tables(block_table, cache_seqlens)
    plan = _reused_plan(meta, "dense", first, schedule)
    if plan is None:
        plan = meta._state["dense"] = DensePlan(q, k_cache, block_table, causal, schedule, meta, cache_seqlens,
                                                host_lengths, invariant)
    rows = query_rows(q, plan.h_kv)
    # With one KV head the rows are a plain view of q when the strides allow (same storage): a
    # replay of this call (``replay_plan``) then only re-views.  Grouped heads reorder, so they
    # always go through query_rows.
    plan.q_rows = tuple(rows.shape) if plan.h_kv == 1 and rows.data_ptr() == q.data_ptr() else None
    return _launch(plan, rows, k_cache, block_table, cache_seqlens, meta, softmax_scale, q.device, out)


def kernel_tables(block_table, cache_seqlens):
    """The block table with a unit column stride and the lengths packed, as the dense kernels take them: a view
    with other strides (a transposed table, ``lengths[::2]``) is copied (inside a CUDA graph the copy is part of
    the graph, so every replay reads the values then)."""
    if block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    if cache_seqlens.stride(0) != 1:
        cache_seqlens = cache_seqlens.contiguous()
    return block_table, cache_seqlens


def _launch(plan: DensePlan, rows, k_cache, block_table, cache_seqlens, meta, softmax_scale, device, out=None):
    """Allocate the outputs (``out``: the caller's) and run the compiled step (split + combine) once (the tables as
    ``kernel_tables`` gives them)."""
    out, lse = _outputs(plan, device, out)
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


def replay_dense(plan: DensePlan, q, k_cache, block_table, cache_seqlens, meta, softmax_scale, out=None):
    """The launch of ``dense_decode`` for a call ``replay_plan`` vouched for: equal facts make the
    rows the same view of q, or the same reordered copy."""
    rows = q.view(plan.q_rows) if plan.q_rows is not None else query_rows(q, plan.h_kv)
    return _launch(plan, rows, k_cache, *kernel_tables(block_table, cache_seqlens), meta, softmax_scale, q.device,
                   out)


# ---------------------------------------------------------------- dense decode over a plan given as tensors
# A plan made before the call (``get_mla_decoding_metadata``) knows no block table: the scheduler takes each length
# within a bound that keeps its int32 sums of b requests' blocks from overflowing (far above any cache's length).
# The split kernel serves each request within its block-table row and its length whatever the plan says.
def _unknown_table_bound(b: int) -> int:
    return (2**31 - 1) // (b + 1)


def plan_dense_tensors(seqlens_k, rows: int, h_kv: int, schedule: DenseDecodeSchedule):
    """``get_mla_decoding_metadata``'s plan on the GPU: (records ``[parts, 8]``, num_splits ``[b + 1]``) over
    ``seqlens_k`` for requests of ``rows`` query rows a KV head (``dense_tensor_plan``)."""
    parts, scheduler = dense_tensor_plan(schedule, rows=rows, h_kv=h_kv, device=device_facts(seqlens_k.device))
    return run_scheduler(scheduler, seqlens_k, parts, _unknown_table_bound(seqlens_k.shape[0]))


# The compiled step, part count and partials' dtype of a call over a given plan, by the call's facts (no tensors).
_GIVEN_STEPS: dict = {}


def _given_step(key, make):
    entry = _GIVEN_STEPS.get(key)
    if entry is None:
        entry = _GIVEN_STEPS[key] = make()
    return entry


def dense_decode_given(q, k_cache, block_table, cache_seqlens, softmax_scale, causal, records, num_splits,
                       schedule: DenseDecodeSchedule, out=None):
    """Dense decode over the plan in ``records`` / ``num_splits`` (made by ``plan_dense_tensors``; their shapes
    checked against this call by the caller): ``resolve_dense``'s capture step, the partials allocated a call (as
    FlashMLA does: inside CUDA graphs sharing a memory pool, the largest batch's)."""
    from ..kernels.build import compile_dense

    b, s_q, h_q, _ = q.shape
    page, h_kv = k_cache.shape[1], k_cache.shape[2]

    def make():
        call = resolve_dense(schedule, dtype=str(q.dtype).replace("torch.", ""), s_q=s_q, h_q=h_q, h_kv=h_kv,
                             causal=causal, page=page, device=device_facts(q.device))
        assert call.fill_parts == 0  # the plan of unknown lengths has no fill parts (``dense_tensor_plan``)
        return compile_dense(call.capture_step), call.parts

    step, parts = _given_step(("dense", q.dtype, s_q, h_q, h_kv, causal, page, schedule, q.device), make)
    o_accum, lse_accum = _partials(b, parts, h_kv, s_q * (h_q // h_kv), q.device)
    out, lse = decode_outputs(b, s_q, h_q, q.dtype, q.device, out)
    step(query_rows(q, h_kv), k_cache, *kernel_tables(block_table, cache_seqlens), records, num_splits, out, lse,
         o_accum, lse_accum, softmax_scale * _LOG2_E)
    return out, lse


def precompile_dense(dtype, s_q, h_q, h_kv, causal, page, schedule: DenseDecodeSchedule,
                     invariant: bool = False) -> None:
    """Every step and scheduler a call of this configuration can resolve to (``dense_precompile_steps``; with
    ``invariant``, the one step of ``enable_batch_invariant=True``)."""
    from ..kernels.build import compile_all, compile_dense, compile_scheduler

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if invariant:
        compile_dense(resolve_dense_invariant(schedule, dtype=str(dtype).replace("torch.", ""), s_q=s_q, h_q=h_q,
                                              h_kv=h_kv, causal=causal, page=page, device=device_facts(device)))
        return
    steps = dense_precompile_steps(schedule, dtype=str(dtype).replace("torch.", ""), s_q=s_q, h_q=h_q, h_kv=h_kv,
                                   causal=causal, page=page, device=device_facts(device))
    compile_all([(compile_dense, step) for step, _ in steps] + [(compile_scheduler, sched) for _, sched in steps])


# ---------------------------------------------------------------- dense decode over the 656-byte FP8 cache
def dense_positions(block_table, cache_seqlens, num_blocks: int, page: int, s_q: int, causal: bool):
    """Dense decode over the 656-byte cache as sparse decode over it: every token a request's block-table row covers
    as an index (``block * page + offset``; a block id outside the cache -1, skipped), its length (within the row)
    as ``topk_length``; causal with s_q > 1: a query's positions past its own end -1.  Torch operations on the
    tables' device (no host read: a CUDA graph captures them).  Returns indices int32 ``[b, s_q, blocks * page]``
    and the lengths int32 ``[b]``."""
    b, blocks = block_table.shape
    covered = blocks * page
    device = block_table.device
    pos = torch.arange(covered, dtype=torch.int32, device=device)
    ids = block_table.to(torch.int32)[:, pos // page]  # [b, covered]
    inside = (ids >= 0) & (ids < num_blocks)
    # int32 throughout: an id inside the cache gives an index below num_blocks * page (the cache's tokens); an id
    # outside it may wrap in the product, which the select then drops.
    idx = torch.where(inside, ids * page + pos % page, -1)
    lengths = cache_seqlens.to(torch.int32).clamp(0, covered)
    if causal and s_q > 1:  # bottom-right aligned: query t sees [0, length - (s_q - 1 - t))
        ends = lengths[:, None] - (s_q - 1 - torch.arange(s_q, dtype=torch.int32, device=device))[None, :]
        idx = torch.where(pos[None, None, :] < ends[:, :, None], idx[:, None, :], -1)
    else:
        idx = idx[:, None, :].expand(b, s_q, covered)
    return idx.contiguous(), lengths


def dense_decode_fp8_cache(q, k_cache, block_table, cache_seqlens, softmax_scale, causal, meta, first,
                           schedule: SparseDecodeSchedule, out=None, invariant: bool = False):
    """Dense decode over the 656-byte FP8 cache (bf16 q, one KV head): the sparse kernel over every position of each
    request (``dense_positions``, made again each call), planned over the requests' lengths with ``schedule``."""
    indices, lengths = dense_positions(block_table, cache_seqlens, k_cache.shape[0], k_cache.shape[1], q.shape[1],
                                       causal)
    return sparse_decode(q, k_cache, indices, lengths, None, softmax_scale, meta, first, schedule, "V32", None, out,
                         invariant)


# ---------------------------------------------------------------- sparse FP8 decode
def check_sparse_supported(k_cache: torch.Tensor, kv_format: str = "V32", name: str = "k_cache") -> None:
    """The sparse kernel reads a token's bytes with 16-byte loads: rows packed within a page (V4: the page's
    data and scale rows from its base, the 584-byte rows formal), 16-byte aligned (``name``: the argument, for
    the errors)."""
    check_kernel_format(kv_format, name)
    check_cache_layout(k_cache, kv_format, name, "sparse kernel")


def check_cache_layout(k_cache: torch.Tensor, kv_format: str, name: str, kernel: str) -> None:
    """What the kernels' 16-byte accesses need of a quantized cache: a page's rows packed (a page-blocked
    format's data and scale rows from the page's base, its formal rows included), 16-byte aligned base and block
    stride (``name``: the argument, ``kernel``: the kernel, for the errors)."""
    row = BYTES_PER_TOKEN[kv_format]
    if k_cache.stride(3) != 1 or k_cache.stride(1) != row:
        raise NotImplementedError(
            f"{name}: the 'cute' {kernel} needs the {row}-byte {kv_format} rows of a page packed "
            f"(strides [*, {row}, *, 1]), got strides {list(k_cache.stride())}"
        )
    if k_cache.data_ptr() % 16 != 0 or k_cache.stride(0) % 16 != 0:
        pad = (f" (quantize_kv_cache pads {kv_format} pages to {PAGE_BLOCKED[kv_format][2]}-byte multiples)"
               if kv_format in PAGE_BLOCKED else "")
        raise NotImplementedError(f"{name}: the 'cute' {kernel} needs a 16-byte aligned base and block stride, "
                                  f"got block stride {k_cache.stride(0)}{pad}")


def _writer_config(kv_format: str, dtype: torch.dtype, slot_dtype: torch.dtype) -> WriteCacheConfig:
    return WriteCacheConfig(kv_format, str(dtype).replace("torch.", ""), str(slot_dtype).replace("torch.", ""))


def precompile_writer(kv_format: str, dtype: torch.dtype, slot_dtype: torch.dtype) -> None:
    from ..kernels.build import compile_write_cache

    compile_write_cache(_writer_config(kv_format, dtype, slot_dtype))


def write_cache(k_cache: torch.Tensor, new_rows: torch.Tensor, slot_mapping: torch.Tensor, kv_format: str) -> None:
    """``write_kv_cache`` in one launch of the cache writer (``kernels/write_cache.py``); the arguments checked,
    ``check_cache_layout`` included."""
    from ..kernels.build import compile_write_cache

    if new_rows.shape[0] == 0:
        return
    rows = new_rows if _aligned(new_rows) else _packed_copy(new_rows)
    kernel = compile_write_cache(_writer_config(kv_format, new_rows.dtype, slot_mapping.dtype))
    data, scale, _ = PAGE_BLOCKED.get(kv_format, (BYTES_PER_TOKEN[kv_format], 0, 0))
    kernel(rows, slot_mapping.contiguous(), page_rows(k_cache, data + scale).view(torch.int32), k_cache.shape[1])


def merge(outs: torch.Tensor, lses: torch.Tensor, attn_sink: Optional[torch.Tensor]):
    """``merge_partial_attention`` in one launch of ``kernels/merge.py`` (bf16, fp16 or fp32 outs, d_v a multiple of
    256)."""
    from ..kernels.build import compile_merge
    from ..schedules.configs import MergeConfig

    if outs.dtype not in (torch.bfloat16, torch.float16, torch.float32) or outs.shape[-1] % 256:
        raise NotImplementedError(f"outs: the 'cute' merge takes bf16, fp16 or fp32 outs with d_v a multiple of 256, "
                                  f"got {outs.dtype} with d_v {outs.shape[-1]} (backend='reference' merges any)")
    r, b, s_q, h_q, d_v = outs.shape
    out = torch.empty((b, s_q, h_q, d_v), dtype=outs.dtype, device=outs.device)
    lse = torch.empty((b, h_q, s_q), dtype=torch.float32, device=outs.device)
    if out.numel() == 0:
        lse.fill_(math.inf)
        return out, lse
    packed = outs if outs.is_contiguous() and outs.data_ptr() % 16 == 0 else outs.clone(
        memory_format=torch.contiguous_format)
    kernel = compile_merge(MergeConfig(str(outs.dtype).replace("torch.", ""), d_v, attn_sink is not None))
    kernel(packed, lses.contiguous(), attn_sink.contiguous() if attn_sink is not None else None, out, lse)
    return out, lse


def check_kernel_format(kv_format: str, name: str) -> None:
    """The formats the sparse kernel reads as its main cache: every one but V41_FP4, which it reads only as the
    extra cache beside V41 / V41_PAGED (``name``: what the error names)."""
    if kv_format == "V41_FP4":
        raise NotImplementedError(f"{name}: the 'cute' sparse kernel reads V41_FP4 only as the extra cache beside a "
                                  "V41 or V41_PAGED k_cache")


def check_extra_cache_supported(k_cache: torch.Tensor, extra_k_cache: torch.Tensor, kv_format: str,
                                extra_format: str) -> None:
    """The sparse kernel reads an extra cache of the main cache's format, or V41_FP4 beside V41 / V41_PAGED
    (validation allows no other), laid out as it needs (see ``check_sparse_supported``), its rows numbered after
    the main cache's in 32 bits."""
    if extra_format not in (kv_format, "V41_FP4"):
        raise NotImplementedError(f"extra_k_cache: the 'cute' sparse kernel reads an extra cache of k_cache's format "
                                  f"({kv_format}) or V41_FP4, got {extra_format} (backend='reference' reads it)")
    check_cache_layout(extra_k_cache, extra_format, "extra_k_cache", "sparse kernel")
    rows = k_cache.shape[0] * k_cache.shape[1] + extra_k_cache.shape[0] * extra_k_cache.shape[1]
    if rows >= 2**31:
        raise NotImplementedError(f"k_cache and extra_k_cache: the 'cute' sparse kernel numbers both caches' tokens "
                                  f"in 32 bits, got {rows} tokens")


def cache_words(k_cache: torch.Tensor, kv_format: str) -> torch.Tensor:
    """The kernel's view of the cache: [num_blocks, page, row words] int32, a token's row (a page-blocked
    format's: its data row, at data-row bytes x t of the page; the kernel finds the scale rows after the page's
    data rows)."""
    words = k_cache.view(torch.int32)
    if kv_format not in PAGE_BLOCKED:
        return words.select(2, 0)
    nb, page, row = k_cache.shape[0], k_cache.shape[1], PAGE_BLOCKED[kv_format][0] // 4
    return torch.as_strided(words, (nb, page, row), (words.stride(0), row, 1), words.storage_offset())


class SparsePlan:
    """What a metadata object holds for the sparse cute kernel: the compiled step and the workspace.
    ``schedule`` is the call's, ``config`` the ``SparseCall`` resolved for it; with an extra cache ``full``
    holds the lengths the kernel reads for a cache whose lengths the call leaves out (its topk each)."""

    __slots__ = ("schedule", "config", "step", "o_accum", "lse_accum", "b", "s_q", "h_q", "has_sink", "dtype", "facts",
                 "kv_format", "extra_format", "full", "invariant", "views")

    def __init__(self, q, topk: int, topk_length, has_sink: bool, schedule: SparseDecodeSchedule, meta,
                 kv_format: str = "V32", extra=None, invariant: bool = False):
        from ..kernels.build import compile_all, compile_scheduler, compile_sparse

        b, s_q, h_q, _ = q.shape
        self.schedule, self.b, self.s_q, self.h_q, self.has_sink, self.dtype = schedule, b, s_q, h_q, has_sink, q.dtype
        self.facts, self.kv_format, self.full, self.invariant = None, kv_format, None, invariant
        self.views = [None, None]  # the last call's caches' words (``cache_view``)
        self.extra_format = extra[1] if extra is not None else None
        # Without topk_length every request has topk tokens: the kernel is built for that and loads no length
        # (the first call's choice holds for the metadata's later calls, as for attn_sink).  The step with the
        # combine is loaded in any case, for a CUDA graph captured later.  With an extra cache a request's
        # length is its main tokens' whole tiles and its extra tokens (``kernels/sparse_tiles.py``).
        # The scheduler reads the call's lengths tensors as they are (``SchedulerConfig.lengths``), so no torch
        # operation runs before it (inside a CUDA graph each would be one more kernel a replay).
        given = topk_length is not None
        capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
        extra_topk = 0
        if extra is None:
            total = topk
            main = topk_length if given else full_lengths(b, topk, q.device, capturing)
        else:
            extra_topk = extra[2].shape[-1]
            total = -(-topk // 64) * 64 + extra_topk
            self.full = (full_lengths(b, topk, q.device, capturing), full_lengths(b, extra_topk, q.device, capturing))
            main, more = self.lengths(topk_length, extra[3])
        if invariant:  # one step for every batch, each request cut by its own length (``planner.invariant_plan``)
            step = self.config = resolve_sparse_invariant(
                schedule, s_q=s_q, h_q=h_q, has_sink=has_sink, has_topk_length=given or extra is not None,
                kv_format=kv_format, extra_cache=extra[1] if extra is not None else "")
            self.step = compile_sparse(step)
            meta.tile_scheduler_metadata, meta.num_splits = (
                call_invariant_plan(schedule, "topk", main, topk) if extra is None
                else call_invariant_plan(schedule, "two_caches", main, topk, more, extra_topk))
            self.o_accum, self.lse_accum = _invariant_partials(meta.tile_scheduler_metadata, 1, s_q * h_q, q.device)
            return
        call = self.config = resolve_sparse(
            schedule, b=b, s_q=s_q, h_q=h_q, topk=total, has_sink=has_sink, has_topk_length=given or extra is not None,
            device=device_facts(q.device), capturing=capturing, kv_format=kv_format,
            extra_cache=extra[1] if extra is not None else "")
        _, self.step = compile_all([(compile_sparse, call.capture_step), (compile_sparse, call.step),
                                    (compile_scheduler, call.scheduler)])[:2]
        partials = q.dtype if call.step.split.partials_16bit else torch.float32
        self.o_accum, self.lse_accum = _split_workspace(
            meta, main, topk, call.parts, call.scheduler, b, 1, s_q * h_q, q.device, partials,
            more if extra is not None else None, extra_topk)

    def extra_args(self, extra):
        """``launch_sparse``'s ``extra`` from the call's (extra_k_cache, extra_indices_in_kvcache,
        extra_topk_length): None for a plan without an extra cache."""
        if self.extra_format is None:
            return None
        return extra[0], self.extra_format, extra[1], extra[2]

    def cache_view(self, slot: int, cache, kv_format: str) -> torch.Tensor:
        """``cache_words`` of the main cache (``slot`` 0) or the extra one (1), kept from the last call made with
        the same tensor at the same address, shape and strides (an engine passes its caches call after call; the
        views cost more host time than the checks).  The plan holds the last tensors it was given until it is
        dropped with its metadata object."""
        held = self.views[slot]
        if (held is not None and held[0] is cache and held[1] == cache.data_ptr() and held[2] == cache.shape
                and held[3] == cache.stride()):
            return held[4]
        words = cache_words(cache, kv_format)
        self.views[slot] = (cache, cache.data_ptr(), cache.shape, cache.stride(), words)
        return words

    def lengths(self, topk_length, extra_topk_length):
        """The two caches' lengths the extra-cache kernel reads (the full ones where the call gives none)."""
        return (topk_length if topk_length is not None else self.full[0],
                extra_topk_length if extra_topk_length is not None else self.full[1])


_FULL_LENGTHS: dict = {}


def full_lengths(b: int, value: int, device, capturing: bool) -> torch.Tensor:
    """An int32 ``[b]`` tensor of ``value`` each, the lengths of a call that passes none (never written).  Made
    outside a CUDA graph capture, it is kept and shared (a few, the oldest dropped first: its readers run at once);
    inside one (``capturing``: a fill kernel in the graph) it is always a fresh one in the graph's memory, since
    the graph reads it on every replay and a shared one could be dropped and its memory reused."""
    key = (b, value, device)
    if capturing:
        return torch.full((b,), value, dtype=torch.int32, device=device)
    t = _FULL_LENGTHS.get(key)
    if t is None:
        t = torch.full((b,), value, dtype=torch.int32, device=device)
        if len(_FULL_LENGTHS) >= 32:
            _FULL_LENGTHS.pop(next(iter(_FULL_LENGTHS)))
        _FULL_LENGTHS[key] = t
    return t


def sparse_decode(q, k_cache, indices, topk_length, attn_sink, softmax_scale, meta, first,
                  schedule: SparseDecodeSchedule, kv_format: str = "V32", extra=None, out=None,
                  invariant: bool = False):
    """``extra``: (extra_k_cache, its format, extra_indices_in_kvcache, extra_topk_length), or None.
    ``invariant``: the batch-invariant plan."""
    has_sink = attn_sink is not None
    plan = _reused_plan(meta, "sparse", first, schedule)
    if plan is None:
        plan = meta._state["sparse"] = SparsePlan(q, indices.shape[-1], topk_length, has_sink, schedule, meta,
                                                  kv_format, extra, invariant)
    elif plan.has_sink != has_sink:
        raise sink_presence_error(plan.has_sink)
    return launch_sparse(plan, q, k_cache, indices, topk_length, attn_sink, softmax_scale, meta, extra, out)


def launch_sparse(plan: SparsePlan, q, k_cache, indices, topk_length, attn_sink, softmax_scale, meta, extra=None,
                  out=None):
    """Allocate the outputs and run the compiled sparse step once (``sparse_decode``, and the replay of a
    call ``replay_sparse_plan`` vouched for)."""
    out, lse = _outputs(plan, q.device, out)
    two = (None, None, None)
    if extra is not None:
        extra_cache, extra_format, extra_indices, extra_topk_length = extra
        topk_length, extra_topk_length = plan.lengths(topk_length, extra_topk_length)
        two = (plan.cache_view(1, extra_cache, extra_format),
               extra_indices if extra_indices.stride(-1) == 1 else extra_indices.contiguous(),
               extra_topk_length.contiguous())
    _run_sparse_step(plan.step, plan.cache_view(0, k_cache, plan.kv_format), q, indices, topk_length, two,
                     meta.tile_scheduler_metadata, meta.num_splits, out, lse, plan.o_accum, plan.lse_accum, attn_sink,
                     softmax_scale)
    return out, lse


def _run_sparse_step(step, words, q, indices, topk_length, two, records, num_splits, out, lse, o_accum, lse_accum,
                     attn_sink, softmax_scale) -> None:
    """One run of a compiled sparse decode step, its tensors as its signature takes them (``words``: the cache's,
    ``cache_words``; ``two``: the extra cache's words, indices and lengths, or three None)."""
    step(
        q if _aligned(q) else _packed_copy(q),
        words,
        indices if indices.stride(-1) == 1 else indices.contiguous(),
        topk_length.contiguous() if topk_length is not None else None,
        *two,
        records, num_splits, out, lse, o_accum, lse_accum,
        attn_sink.contiguous() if attn_sink is not None else None,
        None,  # max_logits: decode has none
        softmax_scale * _LOG2_E,
    )


# ---------------------------------------------------------------- sparse decode over a plan given as tensors
def plan_sparse_tensors(b: int, s_q: int, h_q: int, topk: int, schedule: SparseDecodeSchedule, device):
    """``get_mla_decoding_metadata``'s sparse plan on the GPU: (records, num_splits) for ``b`` requests of
    ``topk`` tokens each (``sparse_tensor_plan``)."""
    parts, scheduler = sparse_tensor_plan(schedule, b=b, s_q=s_q, h_q=h_q, topk=topk, device=device_facts(device))
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    return run_scheduler(scheduler, full_lengths(b, topk, device, capturing), parts, topk)


def sparse_decode_given(q, k_cache, indices, topk_length, attn_sink, softmax_scale, records, num_splits,
                        schedule: SparseDecodeSchedule, kv_format: str, out=None):
    """One-cache sparse decode over the plan in ``records`` / ``num_splits`` (made by ``plan_sparse_tensors``;
    their shapes checked against this call by the caller), as ``dense_decode_given``."""
    from ..kernels.build import compile_sparse

    b, s_q, h_q, _ = q.shape
    topk, has_topk_length, has_sink = indices.shape[-1], topk_length is not None, attn_sink is not None

    def make():
        call = resolve_sparse(schedule, b=b, s_q=s_q, h_q=h_q, topk=topk, has_sink=has_sink,
                              has_topk_length=has_topk_length, device=device_facts(q.device), capturing=True,
                              kv_format=kv_format)
        partials = q.dtype if call.capture_step.split.partials_16bit else torch.float32
        return compile_sparse(call.capture_step), call.parts, partials

    step, parts, partials = _given_step(
        ("sparse", q.dtype, b, s_q, h_q, topk, has_topk_length, has_sink, kv_format, schedule, q.device), make)
    o_accum, lse_accum = _partials(b, parts, 1, s_q * h_q, q.device, partials)
    out, lse = decode_outputs(b, s_q, h_q, q.dtype, q.device, out)
    _run_sparse_step(step, cache_words(k_cache, kv_format), q, indices, topk_length, (None, None, None), records,
                     num_splits, out, lse, o_accum, lse_accum, attn_sink, softmax_scale)
    return out, lse


def _tensor_facts(t) -> Optional[tuple]:
    """What the checks read of an optional tensor argument (raises AttributeError for a non-tensor)."""
    if t is None:
        return None
    return (type(t), t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16)


def sparse_call_facts(q, k_cache, indices, topk_length, attn_sink, block_table, cache_seqlens, head_dim_v,
                      causal, is_fp8_kvcache, kv_format, extra) -> tuple:
    """Everything the checks of a sparse call read, except the identity and values of topk_length and
    extra_topk_length (the metadata tracks those); ``kv_format`` as given; ``extra``: (extra_k_cache,
    extra_indices_in_kvcache, extra_topk_length)."""
    return (
        _tensor_facts(q), _tensor_facts(k_cache), _tensor_facts(indices), _tensor_facts(topk_length),
        _tensor_facts(attn_sink), _tensor_facts(block_table), _tensor_facts(cache_seqlens),
        _tensor_facts(extra[0]), _tensor_facts(extra[1]), _tensor_facts(extra[2]),
        head_dim_v, causal, is_fp8_kvcache, type(kv_format), kv_format,
    )


def replay_sparse_plan(meta, q, k_cache, indices, topk_length, attn_sink, block_table, cache_seqlens, head_dim_v,
                       causal, is_fp8_kvcache, kv_format, extra) -> SparsePlan:
    """Mark the metadata's sparse plan replayable for calls with the facts of this one, which just
    passed every check in ``sparse_decode`` (``extra`` as ``sparse_call_facts`` takes it)."""
    plan = meta._state["sparse"]
    plan.facts = sparse_call_facts(q, k_cache, indices, topk_length, attn_sink, block_table, cache_seqlens,
                                   head_dim_v, causal, is_fp8_kvcache, kv_format, extra)
    return plan


def precompile_sparse(s_q, h_q, has_sink, schedule: SparseDecodeSchedule, has_topk_length: bool = False,
                      kv_format: str = "V32", extra_cache: str = "", invariant: bool = False) -> None:
    """Every step and scheduler a sparse call of this configuration can resolve to (``sparse_precompile_steps``;
    with ``invariant``, the one step of ``enable_batch_invariant=True``); ``extra_cache``: the extra cache's format
    ("": none)."""
    from ..kernels.build import compile_all, compile_scheduler, compile_sparse

    if invariant:
        compile_sparse(resolve_sparse_invariant(schedule, s_q=s_q, h_q=h_q, has_sink=has_sink,
                                                has_topk_length=has_topk_length or bool(extra_cache),
                                                kv_format=kv_format, extra_cache=extra_cache))
        return
    steps = sparse_precompile_steps(schedule, s_q=s_q, h_q=h_q, has_sink=has_sink, has_topk_length=has_topk_length,
                                    kv_format=kv_format, extra_cache=extra_cache)
    compile_all([(compile_sparse, step) for step, _ in steps] + [(compile_scheduler, sched) for _, sched in steps])


# ---------------------------------------------------------------- sparse prefill
def sparse_prefill(q, kv, indices, sm_scale, attn_sink, topk_length, out=None):
    """out (the caller's ``out`` when given), max_logits, lse of ``flash_mla_sparse_fwd`` from the prefill kernel
    (one launch)."""
    from ..kernels.build import compile_sparse_prefill

    s_q, h_q, d_qk = q.shape
    call = resolve_sparse_prefill(s_q=s_q, h_q=h_q, d_qk=d_qk, has_sink=attn_sink is not None,
                                  has_topk_length=topk_length is not None,
                                  device=DeviceFacts(num_sms=num_sms(q.device)))
    kernel = compile_sparse_prefill(call.config)
    if out is None:
        out = torch.empty(s_q, h_q, 512, dtype=q.dtype, device=q.device)
    max_logits = torch.empty(s_q, h_q, dtype=torch.float32, device=q.device)
    lse = torch.empty_like(max_logits)
    rows = kv.select(1, 0)
    indices = indices.select(1, 0)
    kernel(
        q if _aligned(q) else _packed_copy(q),
        rows if _aligned(rows) else _packed_copy(rows),
        indices if indices.stride(-1) == 1 else indices.contiguous(),
        topk_length.contiguous() if topk_length is not None else None,
        attn_sink.contiguous() if attn_sink is not None else None,
        out, max_logits, lse, call.parts, sm_scale * _LOG2_E,
    )
    return out, max_logits, lse


def precompile_sparse_prefill(h_q: int, d_qk: int, has_sink: bool, has_topk_length: bool) -> None:
    """The prefill kernel a call of this configuration resolves to."""
    from ..kernels.build import compile_sparse_prefill

    for config in sparse_prefill_precompile_configs(h_q=h_q, d_qk=d_qk, has_sink=has_sink,
                                                    has_topk_length=has_topk_length):
        compile_sparse_prefill(config)


# ------------------------------------------------- sparse prefill from the FP8 cache
_WHOLE_PLANS: dict = {}


def _whole_plan(s_q: int, parts: int, device):
    """``whole_token_plan``'s records and split counts on ``device`` (a shape fact: made once a shape; a few
    are kept)."""
    key = (s_q, parts, device)
    plan = _WHOLE_PLANS.get(key)
    if plan is None:
        if len(_WHOLE_PLANS) >= 16:
            _WHOLE_PLANS.pop(next(iter(_WHOLE_PLANS)))
        records, splits = whole_token_plan(s_q, parts)
        plan = _WHOLE_PLANS[key] = (records.to(device), splits.to(device))
    return plan


_UNUSED_PARTIALS: dict = {}


def _unused_partials(h_q: int, device):
    """The O and lse partials the kernel's signature takes (one request's worth, never written: no split), made
    once per (h_q, device)."""
    key = (h_q, device)
    if key not in _UNUSED_PARTIALS:
        _UNUSED_PARTIALS[key] = (torch.empty(1, 1, h_q, 512, dtype=torch.float32, device=device),
                                 torch.empty(1, 1, h_q, dtype=torch.float32, device=device))
    return _UNUSED_PARTIALS[key]


def sparse_prefill_fp8(q, k_cache, indices, sm_scale, attn_sink, topk_length, out=None):
    """out, max_logits, lse of ``flash_mla_sparse_fwd`` over the paged FP8 cache: the sparse decode kernel with
    each query token a request of one position (``resolve_sparse_prefill_fp8``), every token served whole by
    one part (``whole_token_plan``), max_logits written beside lse (one launch, no combine)."""
    from ..kernels.build import compile_sparse

    s_q, h_q, _ = q.shape
    call = resolve_sparse_prefill_fp8(s_q=s_q, h_q=h_q, has_sink=attn_sink is not None,
                                      has_topk_length=topk_length is not None,
                                      device=DeviceFacts(num_sms=num_sms(q.device)))
    kernel = compile_sparse(call.step)
    records, splits = _whole_plan(s_q, call.parts, q.device)
    if out is None:
        out = torch.empty(s_q, h_q, 512, dtype=q.dtype, device=q.device)
    max_logits = torch.empty(s_q, h_q, dtype=torch.float32, device=q.device)
    lse = torch.empty_like(max_logits)
    o_accum, lse_accum = _unused_partials(h_q, q.device)
    rows = q.unsqueeze(1)  # [s_q, 1, h_q, 576]: a token is a request of one position
    kernel(
        rows if _aligned(rows) else _packed_copy(rows),
        k_cache.view(torch.int32).select(2, 0),
        (indices if indices.stride(-1) == 1 else indices.contiguous()),
        topk_length.contiguous() if topk_length is not None else None,
        None, None, None,  # no extra cache
        records, splits, out.unsqueeze(1), lse.unsqueeze(-1), o_accum, lse_accum,
        attn_sink.contiguous() if attn_sink is not None else None,
        max_logits.unsqueeze(-1),
        sm_scale * _LOG2_E,
    )
    return out, max_logits, lse


def precompile_sparse_prefill_fp8(h_q: int, has_sink: bool, has_topk_length: bool) -> None:
    """The kernel a prefill call over the FP8 cache of this configuration resolves to."""
    from ..kernels.build import compile_sparse

    compile_sparse(resolve_sparse_prefill_fp8(s_q=1, h_q=h_q, has_sink=has_sink,
                                              has_topk_length=has_topk_length).step)
