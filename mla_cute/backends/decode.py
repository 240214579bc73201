"""Decode's operation objects: ``DenseDecode`` and ``SparseDecode``, each owning its call's path for both backends:
the checks, the schedule, the metadata's binding (``metadata.py``), the ``reference`` backend's torch code or the
``cute`` backend's kernels, the replay of a call whose facts match the last checked one, and calls over a plan
given as tensors (``get_mla_decoding_metadata``'s, which they also make).  ``api.flash_mla_with_kvcache`` is their
adapter: it reads the arguments FlashMLA's builds differ on, asks the capture state once, picks the backend between
an object's checks and its run, and hands the call over.  The schedule a call runs (``use_schedule``) is chosen
here too.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Optional

import torch

from .. import validation as V
from ..backend import ENV_VAR
from ..device import device_facts
from ..fp8 import D_QK, dequantize_kv_cache
from ..metadata import FlashMLASchedMeta, bind_metadata, check_metadata, lengths_key, unbind_on_error
from ..schedules import (DEFAULT_DENSE_SCHEDULE, DEFAULT_SPARSE_SCHEDULE, DenseDecodeSchedule, SparseDecodeSchedule,
                         call_invariant_plan, dense_tensor_plan, plan_splits, resolve_dense, resolve_sparse,
                         sparse_lengths, sparse_tensor_plan)
from . import cute, reference
from .operations import into_out

_SCHEDULE_TYPES = (DenseDecodeSchedule, SparseDecodeSchedule)
_DEFAULTS = {DenseDecodeSchedule: DEFAULT_DENSE_SCHEDULE, SparseDecodeSchedule: DEFAULT_SPARSE_SCHEDULE}
_DEFAULT_SCALE = D_QK ** -0.5
_INF = float("inf")
_schedule_override: contextvars.ContextVar[dict] = contextvars.ContextVar("mla_cute_schedules", default={})


# ----------------------------------------------------------------------------------------------- schedules
@contextlib.contextmanager
def use_schedule(schedule):
    """Run the calls inside the block with ``schedule`` (validated now, compiled on first use).

    A ``DenseDecodeSchedule`` applies to dense decode, a ``SparseDecodeSchedule`` to sparse
    FP8 decode; blocks nest, one schedule of each kind at a time::

        with mla_cute.use_schedule(DenseDecodeSchedule(split_fixed_cost=3)):
            out, lse = mla_cute.flash_mla_with_kvcache(...)
    """
    if not isinstance(schedule, _SCHEDULE_TYPES):
        raise TypeError(f"schedule must be a DenseDecodeSchedule or SparseDecodeSchedule, got {type(schedule).__name__}")
    schedule.validate()
    token = _schedule_override.set({**_schedule_override.get(), type(schedule): schedule})
    try:
        yield schedule
    finally:
        _schedule_override.reset(token)


def resolve_schedule(schedule, kind: type, what: Optional[str] = None):
    """The schedule of this call: the argument, else the innermost ``use_schedule`` of that kind, else the default
    (``what``: the call, for the error)."""
    if schedule is None:
        return _schedule_override.get().get(kind) or _DEFAULTS[kind]
    if not isinstance(schedule, kind):
        what = what or ("dense decode" if kind is DenseDecodeSchedule else "sparse decode (indices given)")
        raise TypeError(f"schedule must be a {kind.__name__} for {what}, got {type(schedule).__name__}")
    schedule.validate()
    return schedule


def call_scale(softmax_scale, q) -> float:
    """The call's scale: the argument checked, else FlashMLA's default, q's head_dim ``** -0.5`` (576's for a q the
    call's own checks will refuse)."""
    if softmax_scale is not None:
        return V.check_scale("softmax_scale", softmax_scale)
    return q.shape[-1] ** -0.5 if isinstance(q, torch.Tensor) and q.dim() == 4 else _DEFAULT_SCALE


# ----------------------------------------------------------------------------------------------- shared rules
def _check_ignored_tables(block_table, cache_seqlens) -> None:
    """Sparse decode ignores the block table and lengths, but takes them only as FlashMLA does (or None)."""
    if block_table is not None:
        V.check_tensor("block_table", block_table, dim=2, dtypes=(torch.int32,))
    if cache_seqlens is not None:
        V.check_tensor("cache_seqlens", cache_seqlens, dim=1, dtypes=(torch.int32,))


def _refuse_sparse_descales(descale_q, descale_k) -> None:
    for name, val in (("descale_q", descale_q), ("descale_k", descale_k)):
        if val is not None:
            raise ValueError(f"{name} applies to dense decode over the per-tensor FP8 cache; sparse decode's caches "
                             "carry their scales: pass None")


def _check_plan_tensors(q, records, num_splits, parts: int, hint: str, what: str) -> None:
    """The plan tensors' types, dtypes, shapes (``[parts, 8]``, ``[b + 1]``), layout and device."""
    b = q.shape[0]
    for name, t, shape in (("tile_scheduler_metadata", records, (parts, 8)), ("num_splits", num_splits, (b + 1,))):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor beside the other one (both from {hint}), got {V.type_name(t)}")
        V.check_tensor(name, t, dim=len(shape), dtypes=(torch.int32,))
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)}: the plan {hint} makes for this call ({what}), "
                             f"got {list(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    V.check_same_device("q", q, tile_scheduler_metadata=records, num_splits=num_splits)


def _check_given_plan(records, num_splits, lengths, parts: int, scheduler, what: str) -> None:
    """The reference backend's check of a plan given as tensors: the one ``get_mla_decoding_metadata`` makes over
    ``lengths`` (the cute backend cannot read it without waiting for the GPU, and trusts it)."""
    want_records, want_splits = plan_splits(lengths, parts, 64, *scheduler.policy())
    if not (torch.equal(records.cpu(), want_records) and torch.equal(num_splits.cpu(), want_splits)):
        raise ValueError(f"tile_scheduler_metadata / num_splits hold another plan than get_mla_decoding_metadata "
                         f"makes over {what}: make them again (or refresh them in place) when the lengths change")


def _replay_scale(softmax_scale, default: float) -> Optional[float]:
    """A replayed call's scale, converted as the checked path converts it (``validation.check_scale``;
    ``default`` for None); None when the checked path must judge it (and report the error)."""
    if type(softmax_scale) is float:  # the usual case, first and cheap
        return softmax_scale if 0.0 < softmax_scale < _INF else None
    if softmax_scale is None:
        return default
    try:
        return V.check_scale("softmax_scale", softmax_scale)
    except (TypeError, ValueError):
        return None


def _replay_schedule_and_backend(plan, schedule, kind: type, backend) -> bool:
    """Whether this call's schedule (argument, ``use_schedule``, default) is the plan's and its backend
    (argument, else the environment variable) is the cute one."""
    sched = schedule if schedule is not None else (_schedule_override.get().get(kind) or _DEFAULTS[kind])
    if sched is not plan.schedule and sched != plan.schedule:
        return False
    return (backend if backend is not None else os.environ.get(ENV_VAR)) in (None, "", "cute")


# ----------------------------------------------------------------------------------------------- dense
class DenseDecode:
    """Dense decode over a paged cache: 16-bit (head_dim 576 or 512), or FP8 on the reference backend."""

    @staticmethod
    def check(q, k_cache, block_table, cache_seqlens, head_dim_v, is_fp8_kvcache, descales, sparse_only) -> None:
        """The call's arguments (no value read); ``sparse_only``: (attn_sink, topk_length, kv_format, extra_k_cache,
        extra_indices_in_kvcache, extra_topk_length) as given, all None for dense decode."""
        names = ("attn_sink", "topk_length", "kv_format", "extra_k_cache", "extra_indices_in_kvcache",
                 "extra_topk_length")
        for name, val in zip(names, sparse_only):
            if val is not None:
                raise ValueError(f"{name} is only valid for sparse decode (with indices); got it with indices=None")
        if block_table is None or cache_seqlens is None:
            raise ValueError("block_table and cache_seqlens are required for dense decode (indices=None)")
        V.check_dense(q, k_cache, block_table, cache_seqlens, head_dim_v, is_fp8_kvcache, *descales)

    def __call__(self, kind: str, meta, capture: tuple, q, k_cache, block_table, cache_seqlens, head_dim_v,
                 softmax_scale: float, causal: bool, is_fp8_kvcache: bool, descales, schedule, out,
                 invariant: bool = False):
        """A checked call (``check`` passed; ``kind`` the backend) with a metadata object: bound on its first call
        (``capture``: (capturing, capture id)), checked against it on later ones.  ``invariant``:
        ``enable_batch_invariant`` (the reference computes each request alone in any case).  Over the 656-byte
        cache the cute backend runs the sparse kernel (``cute.dense_positions``): the schedule is a
        ``SparseDecodeSchedule``, and the reference fills the metadata with that kernel's plan."""
        positions = is_fp8_kvcache and k_cache.shape[-1] == 656  # the 656-byte cache: the sparse kernel's plan
        sched = (resolve_schedule(schedule, SparseDecodeSchedule, "dense decode over the 656-byte cache (the sparse "
                                  "kernel over every position)") if positions
                 else resolve_schedule(schedule, DenseDecodeSchedule))
        if kind == "cute":
            cute.check_supported(k_cache, is_fp8_kvcache)
        config = FlashMLASchedMeta.Config(
            q.shape[0], q.shape[1], q.shape[2], k_cache.shape[1], k_cache.shape[2],
            causal, is_fp8_kvcache, None, head_dim=q.shape[3], dtype=q.dtype, batch_invariant=invariant,
        )
        first = check_metadata(meta, config, cache_seqlens)
        host_lengths = None  # read by the value checks; not inside a CUDA graph capture
        if first:
            if not capture[0]:
                host_lengths = V.check_dense_values(block_table, cache_seqlens, k_cache.shape[1], k_cache.shape[0])
            bind_metadata(meta, config, capture, cache_seqlens)
        masked = causal and q.shape[1] > 1  # the mask (causal is ignored when s_q == 1)
        with unbind_on_error(meta, first):
            if kind == "reference":
                if first and positions:
                    covered = block_table.shape[1] * k_cache.shape[1]
                    fill_sparse_reference_metadata(meta, q, covered, cache_seqlens.clamp(0, covered), sched,
                                                   invariant)
                elif first:
                    fill_reference_metadata(meta, q, k_cache, block_table, cache_seqlens, masked, sched, host_lengths,
                                            invariant)
                return into_out(out, self.reference(q, k_cache, block_table, cache_seqlens, softmax_scale, masked,
                                                    head_dim_v, is_fp8_kvcache, *descales))
            if positions:  # the per-tensor cache has no cute kernel (check_supported)
                return cute.dense_decode_fp8_cache(q, k_cache, block_table, cache_seqlens, softmax_scale, masked,
                                                   meta, first, sched, out, invariant)
            out, lse = cute.dense_decode(q, k_cache, block_table, cache_seqlens, softmax_scale, masked, meta, first,
                                         sched, host_lengths, out, invariant)
        # The facts hold the argument as given (the replay compares it), not the mask.
        meta._replay = cute.replay_plan(meta, q, k_cache, block_table, head_dim_v, causal, is_fp8_kvcache)
        return out, lse

    @staticmethod
    def reference(q, k_cache, block_table, cache_seqlens, softmax_scale, masked, head_dim_v, is_fp8_kvcache,
                  descale_q, descale_k):
        """The reference's dense decode over the operands' true values: the 656-byte cache dequantized; the
        per-tensor FP8 cache (and an FP8 q) times its descale, in fp32, the output bf16.  Over an FP8 cache a block
        id outside the cache (never in a checked call) is skipped, as the sparse kernel over every position skips
        it (``cute.dense_positions``)."""
        if is_fp8_kvcache and descale_k is None:
            k_cache = dequantize_kv_cache(k_cache)
        elif is_fp8_kvcache:
            k_cache = k_cache.float() * descale_k
        fp8_q = q.dtype == torch.float8_e4m3fn
        if fp8_q:
            q = q.float() * descale_q
        out, lse = reference.dense_decode(q, k_cache, block_table, cache_seqlens, softmax_scale, masked, head_dim_v,
                                          skip_outside=is_fp8_kvcache)
        return (out.to(torch.bfloat16) if fp8_q else out), lse

    @staticmethod
    def replay(meta, q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, is_fp8_kvcache,
               schedule, backend, out=None, invariant: bool = False):
        """The launch of a call whose every checked fact matches the last call that passed all checks.

        Returns None (the full path then checks and reports) when anything differs: a tensor's shape,
        strides, dtype, device or 16-byte alignment, the lengths tensor or its version, the schedule,
        the scale, ``enable_batch_invariant``, or the backend (argument or environment).
        """
        plan = meta._replay
        if not isinstance(plan, cute.DensePlan) or plan.invariant is not invariant:
            return None
        # Equal facts (checked below, before any launch) make q's head_dim the plan's.
        scale = _replay_scale(softmax_scale, plan.d_qk ** -0.5)
        # The lengths tensor the metadata was checked against, unchanged since: same object, storage,
        # shape and version (in-place writes bump it; assigning ``.data`` moves the storage).
        if scale is None or cache_seqlens is not meta._lengths_ref or type(causal) is not bool:
            return None
        try:
            facts = cute.dense_call_facts(q, k_cache, block_table, head_dim_v, causal, is_fp8_kvcache)
        except AttributeError:  # not tensors: the full path names the argument
            return None
        if (facts != plan.facts or lengths_key(cache_seqlens) != meta._lengths_key
                or not _replay_schedule_and_backend(plan, schedule, DenseDecodeSchedule, backend)):
            return None
        return cute.replay_dense(plan, q, k_cache, block_table, cache_seqlens, meta, scale, out)

    def given(self, kind: str, records, num_splits, q, k_cache, block_table, cache_seqlens, head_dim_v,
              softmax_scale, causal: bool, is_fp8_kvcache: bool, descales, schedule, out):
        """A checked call over a plan given as tensors (``get_mla_decoding_metadata``'s): checked as a first call
        is, but for the lengths' values, which the GPU holds (the reference backend checks the plan against
        them)."""
        sched = resolve_schedule(schedule, DenseDecodeSchedule)
        if kind == "cute":
            cute.check_supported(k_cache, is_fp8_kvcache, planned=False)
        b, s_q, h_q, _ = q.shape
        h_kv = k_cache.shape[2]
        rows = s_q * (h_q // h_kv)
        parts, scheduler = dense_tensor_plan(sched, rows=rows, h_kv=h_kv, device=device_facts(q.device))
        _check_plan_tensors(q, records, num_splits, parts,
                            f"get_mla_decoding_metadata(cache_seqlens, {rows}, {h_kv})",
                            f"batch {b}, {rows} query rows a KV head")
        softmax_scale = call_scale(softmax_scale, q)
        masked = causal and s_q > 1
        if kind == "reference":
            host_lengths = V.check_dense_values(block_table, cache_seqlens, k_cache.shape[1], k_cache.shape[0])
            _check_given_plan(records, num_splits, host_lengths, parts, scheduler, "this call's cache_seqlens")
            return into_out(out, self.reference(q, k_cache, block_table, cache_seqlens, softmax_scale, masked,
                                                head_dim_v, is_fp8_kvcache, *descales))
        return cute.dense_decode_given(q, k_cache, block_table, cache_seqlens, softmax_scale, masked, records,
                                       num_splits, sched, out)

    @staticmethod
    def plan_tensors(kind: str, seqlens_k, rows: int, h_k: int, is_fp8_kvcache: bool, sched):
        """``get_mla_decoding_metadata``'s dense plan (its arguments and schedule ``sched`` checked)."""
        device = seqlens_k.device
        if kind == "cute":
            if is_fp8_kvcache:
                raise NotImplementedError("is_fp8_kvcache=True: dense decode over an FP8 cache takes no plan as "
                                          "tensors on the 'cute' backend (the 656-byte cache plans on the call, "
                                          "with a FlashMLASchedMeta; backend='reference' runs both)")
            return cute.plan_dense_tensors(seqlens_k, rows, h_k, sched)
        parts, scheduler = dense_tensor_plan(sched, rows=rows, h_kv=h_k, device=device_facts(device))
        lengths = seqlens_k.cpu()
        if int(lengths.min()) < 0:  # read on the host here anyway (the cute backend's scheduler clamps them)
            raise ValueError(f"seqlens_k must be >= 0, got a minimum of {int(lengths.min())}")
        records, splits = plan_splits(lengths, parts, 64, *scheduler.policy())
        return records.to(device), splits.to(device)


def fill_reference_metadata(meta: FlashMLASchedMeta, q, k_cache, block_table, cache_seqlens, causal, schedule,
                            host_lengths, invariant: bool = False) -> None:
    """Give reference users the same metadata tensors the kernels would use."""
    if invariant:
        meta.tile_scheduler_metadata, meta.num_splits = call_invariant_plan(
            schedule, "dense", cache_seqlens, block_table.shape[1] * k_cache.shape[1])
        return
    dtype = "bfloat16" if q.dtype == torch.float8_e4m3fn else str(q.dtype).replace("torch.", "")
    call = resolve_dense(schedule, dtype=dtype, s_q=q.shape[1], h_q=q.shape[2],
                         h_kv=k_cache.shape[2], causal=causal, page=k_cache.shape[1], device=device_facts(q.device),
                         host_lengths=host_lengths)
    records, splits = plan_splits(cache_seqlens, call.parts, 64, *call.scheduler.policy())
    meta.tile_scheduler_metadata = records.to(q.device)
    meta.num_splits = splits.to(q.device)


# ----------------------------------------------------------------------------------------------- sparse
class SparseDecode:
    """Sparse decode over a quantized cache (and an extra one beside it)."""

    @staticmethod
    def check(q, k_cache, block_table, cache_seqlens, indices, topk_length, attn_sink, head_dim_v, is_fp8_kvcache,
              causal, kv_format, extra, descales) -> tuple:
        """The call's arguments (no value read); ``extra``: (extra_k_cache, extra_indices_in_kvcache,
        extra_topk_length) as given.  Returns the caches' formats (the extra one None without an extra cache)."""
        _refuse_sparse_descales(*descales)
        _check_ignored_tables(block_table, cache_seqlens)
        given = any(val is not None for val in extra)
        return V.check_sparse_decode(q, k_cache, indices, topk_length, attn_sink, head_dim_v, is_fp8_kvcache, causal,
                                     kv_format, extra if given else None)

    def __call__(self, kind: str, meta, capture: tuple, q, k_cache, block_table, cache_seqlens, head_dim_v,
                 softmax_scale: float, causal: bool, is_fp8_kvcache: bool, indices, attn_sink, topk_length, kv_format,
                 extra, formats: tuple, schedule, out, invariant: bool = False):
        """A checked call (``check`` passed and gave ``formats``; ``kind`` the backend) with a metadata object
        (``capture`` and ``invariant`` as ``DenseDecode`` takes them); the arguments as given (a replay compares
        them)."""
        fmt, extra_fmt = formats
        extra_k_cache, extra_indices, extra_topk_length = extra
        given = extra_fmt is not None
        sched = resolve_schedule(schedule, SparseDecodeSchedule)
        if kind == "cute":
            cute.check_sparse_supported(k_cache, fmt)
            if given:
                cute.check_extra_cache_supported(k_cache, extra_k_cache, fmt, extra_fmt)
        config = FlashMLASchedMeta.Config(
            q.shape[0], q.shape[1], q.shape[2], k_cache.shape[1], k_cache.shape[2],
            False, True, indices.shape[-1], kv_format=fmt,
            extra_page_block_size=extra_k_cache.shape[1] if given else None,
            extra_topk=extra_indices.shape[-1] if given else None,
            extra_kv_format=extra_fmt, batch_invariant=invariant,
        )
        first = check_metadata(meta, config, topk_length, extra_topk_length)
        V.check_sink_presence(meta, attn_sink is not None, first)
        if first:
            bind_metadata(meta, config, capture, topk_length, extra_topk_length)
        two = (extra_k_cache, extra_fmt, extra_indices, extra_topk_length) if given else None
        with unbind_on_error(meta, first):
            if kind == "reference":
                if first:
                    fill_sparse_reference_metadata(meta, q, indices.shape[-1], topk_length, sched, invariant, two)
                return into_out(out, reference.sparse_decode_fp8(q, k_cache, indices, softmax_scale, topk_length,
                                                                 attn_sink, head_dim_v, fmt, two))
            out, lse = cute.sparse_decode(q, k_cache, indices, topk_length, attn_sink, softmax_scale, meta, first,
                                          sched, fmt, two, out, invariant)
        meta._replay = cute.replay_sparse_plan(meta, q, k_cache, indices, topk_length, attn_sink, block_table,
                                               cache_seqlens, head_dim_v, causal, is_fp8_kvcache, kv_format, extra)
        return out, lse

    @staticmethod
    def replay(meta, q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, is_fp8_kvcache,
               indices, attn_sink, topk_length, kv_format, schedule, backend, extra, out=None, invariant: bool = False):
        """The launch of a call whose every checked fact matches the last call that passed all checks (as
        ``DenseDecode.replay``: None sends the call down the checked path); ``extra``: (extra_k_cache,
        extra_indices_in_kvcache, extra_topk_length) as given."""
        plan = meta._replay
        extra_lengths = extra[2]
        # topk_length and extra_topk_length (or their absence) as the metadata was checked against: the same
        # tensors, storage, shape and version.
        if (not isinstance(plan, cute.SparsePlan) or plan.invariant is not invariant
                or topk_length is not meta._lengths_ref
                or extra_lengths is not meta._extra_lengths_ref or type(causal) is not bool):
            return None
        try:
            facts = cute.sparse_call_facts(q, k_cache, indices, topk_length, attn_sink, block_table, cache_seqlens,
                                           head_dim_v, causal, is_fp8_kvcache, kv_format, extra)
        except (AttributeError, TypeError):  # not tensors: the full path names the argument
            return None
        if (facts != plan.facts or (topk_length is not None and lengths_key(topk_length) != meta._lengths_key)
                or (extra_lengths is not None and lengths_key(extra_lengths) != meta._extra_lengths_key)
                or not _replay_schedule_and_backend(plan, schedule, SparseDecodeSchedule, backend)):
            return None
        scale = _replay_scale(softmax_scale, q.shape[-1] ** -0.5)  # equal facts: q is the checked call's 4-d tensor
        if scale is None:
            return None
        return cute.launch_sparse(plan, q, k_cache, indices, topk_length, attn_sink, scale, meta,
                                  plan.extra_args(extra), out)

    def check_given(self, q, k_cache, block_table, cache_seqlens, indices, topk_length, attn_sink, head_dim_v,
                    is_fp8_kvcache, causal, kv_format, extra, descales) -> str:
        """``check`` for a call over a plan given as tensors, which serves one cache: an extra cache is refused
        first.  Returns the cache's format."""
        _refuse_sparse_descales(*descales)
        if any(val is not None for val in extra):
            raise TypeError("tile_scheduler_metadata: a call over two caches plans on its first call and takes a "
                            "FlashMLASchedMeta from get_mla_metadata(), not tensors")
        return self.check(q, k_cache, block_table, cache_seqlens, indices, topk_length, attn_sink, head_dim_v,
                          is_fp8_kvcache, causal, kv_format, extra, descales)[0]

    @staticmethod
    def given(kind: str, records, num_splits, q, k_cache, indices, topk_length, attn_sink, softmax_scale, head_dim_v,
              fmt: str, schedule, out):
        """One-cache sparse decode over a plan given as tensors (as ``DenseDecode.given``; ``check`` passed and
        gave ``fmt``)."""
        sched = resolve_schedule(schedule, SparseDecodeSchedule)
        if kind == "cute":
            cute.check_sparse_supported(k_cache, fmt)
        b, s_q, h_q, _ = q.shape
        topk = indices.shape[-1]
        parts, scheduler = sparse_tensor_plan(sched, b=b, s_q=s_q, h_q=h_q, topk=topk, device=device_facts(q.device))
        _check_plan_tensors(q, records, num_splits, parts,
                            f"get_mla_decoding_metadata(cache_seqlens, {s_q * h_q}, 1, {h_q}, True, {topk})",
                            f"batch {b}, s_q {s_q}, h_q {h_q}, topk {topk}")
        softmax_scale = call_scale(softmax_scale, q)
        if kind == "reference":
            _check_given_plan(records, num_splits, sparse_lengths(topk, None, b), parts, scheduler, f"topk ({topk})")
            return into_out(out, reference.sparse_decode_fp8(q, k_cache, indices, softmax_scale, topk_length,
                                                             attn_sink, head_dim_v, fmt, None))
        return cute.sparse_decode_given(q, k_cache, indices, topk_length, attn_sink, softmax_scale, records,
                                        num_splits, sched, fmt, out)

    @staticmethod
    def plan_tensors(kind: str, b: int, s_q: int, h_q: int, topk: int, sched, device):
        """``get_mla_decoding_metadata``'s one-cache sparse plan (its arguments and schedule ``sched`` checked):
        b requests of topk tokens each."""
        if kind == "cute":
            return cute.plan_sparse_tensors(b, s_q, h_q, topk, sched, device)
        parts, scheduler = sparse_tensor_plan(sched, b=b, s_q=s_q, h_q=h_q, topk=topk, device=device_facts(device))
        records, splits = plan_splits(sparse_lengths(topk, None, b), parts, 64, *scheduler.policy())
        return records.to(device), splits.to(device)


def fill_sparse_reference_metadata(meta: FlashMLASchedMeta, q, topk: int, topk_length, schedule,
                                   invariant: bool = False, extra=None) -> None:
    """The split plan of the sparse kernel, as the cute backend makes it (``resolve_sparse``: 64-token blocks over
    topk; small plans with their own fixed cost; ``invariant``: ``planner.invariant_plan`` over the lengths as the
    kernel serves them, both caches' with ``extra``, ``reference.sparse_decode_fp8``'s)."""
    b = q.shape[0]
    if invariant:
        given = topk_length if topk_length is not None else torch.full((b,), topk, dtype=torch.int32)
        if extra is None:
            records, splits = call_invariant_plan(schedule, "topk", given, topk)
        else:
            extra_topk = extra[2].shape[-1]
            more = extra[3] if extra[3] is not None else torch.full((b,), extra_topk, dtype=torch.int32)
            records, splits = call_invariant_plan(schedule, "two_caches", given, topk, more.to(given.device),
                                                  extra_topk)
        meta.tile_scheduler_metadata, meta.num_splits = records.to(q.device), splits.to(q.device)
        return
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        return  # planning on the host needs the lengths' values
    b, s_q, h_q, _ = q.shape
    call = resolve_sparse(schedule, b=b, s_q=s_q, h_q=h_q, topk=topk, has_sink=False,
                          has_topk_length=topk_length is not None, device=device_facts(q.device))
    records, splits = plan_splits(sparse_lengths(topk, topk_length, b), call.parts, 64, *call.scheduler.policy())
    meta.tile_scheduler_metadata = records.to(q.device)
    meta.num_splits = splits.to(q.device)


DENSE_DECODE = DenseDecode()
SPARSE_DECODE = SparseDecode()
