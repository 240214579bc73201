"""The public API, argument for argument FlashMLA's: a FlashMLA user changes only the import."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import os
from typing import Iterable, Optional, Tuple

import torch

from . import validation as V
from .backend import ENV_VAR, select_backend
from .backends import cute, reference
from .backends.operations import CACHE_WRITE, SPARSE_PREFILL, into_out
from .device import capture_id, device_facts
from .host import without_function_modes
from .fp8 import D_LATENT, D_QK, dequantize_kv_cache
from .kv_formats import HEAD_DIM, format_of
from .schedules.configs import check_extra_format
from .schedules import (
    DEFAULT_DENSE_SCHEDULE,
    DEFAULT_SPARSE_SCHEDULE,
    DenseDecodeSchedule,
    SparseDecodeSchedule,
    dense_tensor_plan,
    plan_splits,
    sparse_tensor_plan,
    resolve_dense,
    resolve_sparse,
    sparse_lengths,
)

_SCHEDULE_TYPES = (DenseDecodeSchedule, SparseDecodeSchedule)
_Q_DTYPES = V.HALF_DTYPES + (torch.float8_e4m3fn,)
_OUT_DTYPE = {torch.float8_e4m3fn: torch.bfloat16}  # out's dtype where it is not q's
_DEFAULT_SCALE = D_QK ** -0.5
_INF = float("inf")
_LOG2_E = math.log2(math.e)
_DEFAULTS = {DenseDecodeSchedule: DEFAULT_DENSE_SCHEDULE, SparseDecodeSchedule: DEFAULT_SPARSE_SCHEDULE}
_schedule_override: contextvars.ContextVar[dict] = contextvars.ContextVar("mla_cute_schedules", default={})


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


def _resolve_schedule(schedule, kind: type):
    """The schedule of this call: the argument, else the innermost ``use_schedule`` of that kind, else the default."""
    if schedule is None:
        return _schedule_override.get().get(kind) or _DEFAULTS[kind]
    if not isinstance(schedule, kind):
        what = "dense decode" if kind is DenseDecodeSchedule else "sparse decode (indices given)"
        raise TypeError(f"schedule must be a {kind.__name__} for {what}, got {type(schedule).__name__}")
    schedule.validate()
    return schedule


@dataclasses.dataclass
class FlashMLASchedMeta:
    """Tile-scheduler metadata, filled by the first ``flash_mla_with_kvcache`` call.

    Reuse one object across the layers of a decode step: the shapes, the config and
    the values of ``cache_seqlens`` (or ``topk_length``) must stay the same.

    tile_scheduler_metadata: int32 ``[num_sm_parts, 8]`` (see ``mla_cute.schedules.RECORD_FIELDS``).
    num_splits: int32 ``[batch_size + 1]``, prefix sum of the split count of each request.
    """

    @dataclasses.dataclass
    class Config:
        b: int
        s_q: int
        h_q: int
        page_block_size: int
        h_k: int
        causal: bool
        is_fp8_kvcache: bool
        topk: Optional[int]
        extra_page_block_size: Optional[int] = None
        extra_topk: Optional[int] = None
        kv_format: Optional[str] = None  # sparse: the cache's format (one metadata object serves one)
        extra_kv_format: Optional[str] = None  # sparse: the extra cache's format
        head_dim: Optional[int] = None  # dense: q's and the cache's head_dim (576 or 512; a kernel each)
        dtype: Optional[torch.dtype] = None  # dense: q's dtype (a kernel each)

    have_initialized: bool = False
    config: Optional[Config] = None
    tile_scheduler_metadata: Optional[torch.Tensor] = None
    num_splits: Optional[torch.Tensor] = None
    # What the metadata was computed from: the lengths tensor and its version counter,
    # so a reuse with other lengths is caught without reading device memory.
    _lengths_ref: Optional[torch.Tensor] = dataclasses.field(default=None, repr=False)
    _lengths_key: Optional[tuple] = dataclasses.field(default=None, repr=False)
    _lengths_copy: Optional[torch.Tensor] = dataclasses.field(default=None, repr=False)
    # The same for sparse decode's extra_topk_length.
    _extra_lengths_ref: Optional[torch.Tensor] = dataclasses.field(default=None, repr=False)
    _extra_lengths_key: Optional[tuple] = dataclasses.field(default=None, repr=False)
    _extra_lengths_copy: Optional[torch.Tensor] = dataclasses.field(default=None, repr=False)
    # Whether the first call ran inside a CUDA graph capture (its replays then plan the lengths they find), and
    # that capture's id (the scheduler kernel is in that graph only).
    _in_capture: bool = dataclasses.field(default=False, repr=False)
    _capture_id: Optional[int] = dataclasses.field(default=None, repr=False)
    # Backend-private state (workspaces, launch plans), keyed by the backend.
    _state: dict = dataclasses.field(default_factory=dict, repr=False)
    # The dense cute plan once a call has passed every check; later calls with the same
    # facts (see ``cute.dense_call_facts``) skip straight to the launch.
    _replay: Optional[object] = dataclasses.field(default=None, repr=False)


def get_mla_metadata(*args, **kwargs) -> Tuple[FlashMLASchedMeta, None]:
    """Return an empty :class:`FlashMLASchedMeta` (filled by the first attention call).

    Arguments are accepted and ignored, for compatibility with FlashMLA's older interface.
    Returns ``(FlashMLASchedMeta(), None)``.
    """
    return FlashMLASchedMeta(), None


@without_function_modes
def get_mla_decoding_metadata(seqlens_k: torch.Tensor, num_q_tokens_per_head_k: int, h_k: int,
                              h_q: Optional[int] = None, is_fp8_kvcache: bool = False, topk: Optional[int] = None,
                              use_legacy: bool = False, *, schedule: Optional[DenseDecodeSchedule] = None,
                              backend: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The split plan as tensors, made before the call (FlashMLA's Hopper build and sgl-kernel:
    ``(tile_scheduler_metadata, num_splits)``, passed to ``flash_mla_with_kvcache`` in those two arguments).

    seqlens_k: int32 ``[b]``, the requests' KV lengths (the call's ``cache_seqlens``).
    num_q_tokens_per_head_k: the query rows a KV head serves, ``s_q * h_q // h_kv``.  h_k: the KV heads.
    h_q: dense: None or a multiple of ``h_k`` (the plan does not depend on it); sparse: required.
    is_fp8_kvcache: dense: the per-tensor FP8 cache (the reference backend only); sparse: must be True.
    topk: None for dense decode; sparse decode over one cache: the indices a query (the plan of b requests of topk
    tokens each).  use_legacy: accepted and ignored.
    schedule: as the call takes it (keyword; the call must use the same).  backend: as the call takes it.

    Returns ``tile_scheduler_metadata`` int32 ``[parts, 8]`` (``parts`` depends on the device and the shapes,
    not on the lengths: an engine keeps one buffer for all its CUDA graphs and refreshes it in place) and
    ``num_splits`` int32 ``[b + 1]``, on ``seqlens_k``'s device; planned on the GPU by the cute backend, with
    no host synchronisation.  The call runs the plan they hold: they must be made for the call's own lengths and
    batch (the cute backend does not read them to check: see docs/api.md)."""
    V.check_tensor("seqlens_k", seqlens_k, dim=1, dtypes=(torch.int32,))
    V.check_device("seqlens_k", seqlens_k)
    if seqlens_k.shape[0] < 1 or not seqlens_k.is_contiguous():
        raise ValueError(f"seqlens_k must be contiguous with batch >= 1, got shape {list(seqlens_k.shape)}")
    for name, val in (("num_q_tokens_per_head_k", num_q_tokens_per_head_k), ("h_k", h_k)):
        if type(val) is not int:
            raise TypeError(f"{name} must be an int, got {V.type_name(val)}")
        if val < 1:
            raise ValueError(f"{name} must be >= 1, got {val}")
    if h_q is not None and type(h_q) is not int:
        raise TypeError(f"h_q must be an int or None, got {V.type_name(h_q)}")
    if h_q is not None and (h_q < 1 or h_q % h_k):
        raise ValueError(f"h_q must be None or a positive multiple of h_k ({h_k}), got {h_q}")
    for name, val in (("is_fp8_kvcache", is_fp8_kvcache), ("use_legacy", use_legacy)):
        if type(val) is not bool:
            raise TypeError(f"{name} must be a bool, got {V.type_name(val)}")
    if topk is not None:
        return _sparse_decoding_metadata(seqlens_k, num_q_tokens_per_head_k, h_k, h_q, is_fp8_kvcache, topk,
                                         schedule, backend)
    sched = _resolve_schedule(schedule, DenseDecodeSchedule)
    rows, device = num_q_tokens_per_head_k, seqlens_k.device
    if select_backend(device, backend) == "cute":
        if is_fp8_kvcache:
            raise NotImplementedError("is_fp8_kvcache=True: dense decode over the FP8 cache has no 'cute' kernel "
                                      "yet (backend='reference' runs it)")
        return cute.plan_dense_tensors(seqlens_k, rows, h_k, sched)
    parts, scheduler = dense_tensor_plan(sched, rows=rows, h_kv=h_k, device=device_facts(device))
    lengths = seqlens_k.cpu()
    if int(lengths.min()) < 0:  # read on the host here anyway (the cute backend's scheduler clamps them)
        raise ValueError(f"seqlens_k must be >= 0, got a minimum of {int(lengths.min())}")
    records, splits = plan_splits(lengths, parts, 64, *scheduler.policy())
    return records.to(device), splits.to(device)


def _sparse_decoding_metadata(seqlens_k, rows: int, h_k: int, h_q, is_fp8_kvcache: bool, topk, schedule, backend):
    """``get_mla_decoding_metadata`` with ``topk``: the one-cache sparse plan over ``topk`` tokens a request (the
    lengths' values are not read: a request attends to its indices, as many as topk)."""
    if type(topk) is not int:
        raise TypeError(f"topk must be an int or None, got {V.type_name(topk)}")
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    if not is_fp8_kvcache:
        raise ValueError("is_fp8_kvcache must be True with topk (sparse decode reads the FP8 cache)")
    if h_q is None or h_k != 1:
        raise ValueError(f"h_q must be given and h_k be 1 with topk (sparse decode has one KV head), got h_q={h_q!r}, "
                         f"h_k={h_k}")
    if rows % h_q:
        raise ValueError(f"num_q_tokens_per_head_k ({rows}) must be s_q * h_q, a multiple of h_q ({h_q})")
    sched = _resolve_schedule(schedule, SparseDecodeSchedule)
    b, s_q, device = seqlens_k.shape[0], rows // h_q, seqlens_k.device
    if select_backend(device, backend) == "cute":
        return cute.plan_sparse_tensors(b, s_q, h_q, topk, sched, device)
    parts, scheduler = sparse_tensor_plan(sched, b=b, s_q=s_q, h_q=h_q, topk=topk, device=device_facts(device))
    records, splits = plan_splits(sparse_lengths(topk, None, b), parts, 64, *scheduler.policy())
    return records.to(device), splits.to(device)


def _lengths_key(t: torch.Tensor) -> tuple:
    """What identifies a lengths tensor's values between calls without reading them: its storage, shape,
    device and version counter.  A tensor made under ``torch.inference_mode()`` keeps no version counter
    (inference engines make theirs so): its key has none, so a reuse with that same tensor is trusted as
    FlashMLA trusts every reuse.  Whatever the lengths hold then, the kernels read nothing outside the
    block table and the cache."""
    return (t.data_ptr(), None if t.is_inference() else t._version, tuple(t.shape), t.device)


def _check_metadata(meta: FlashMLASchedMeta, config: FlashMLASchedMeta.Config, lengths: Optional[torch.Tensor],
                    extra_lengths: Optional[torch.Tensor] = None) -> bool:
    """Check a reused metadata object against this call (``extra_lengths``: sparse decode's extra_topk_length).
    Returns True when it is still empty."""
    if not isinstance(meta, FlashMLASchedMeta):
        raise TypeError(
            f"tile_scheduler_metadata must be a FlashMLASchedMeta (from get_mla_metadata()), got {type(meta).__name__}"
        )
    if not meta.have_initialized:
        if meta.tile_scheduler_metadata is not None or meta.num_splits is not None:
            # Tensors a caller put on an empty object (a plan made elsewhere): the kernels would run their own
            # plan over them, which is not what the caller asked for.
            raise ValueError(
                "tile_scheduler_metadata: an empty FlashMLASchedMeta carries tile_scheduler_metadata / num_splits "
                "tensors made outside mla-cute; mla-cute plans the split itself: pass get_mla_metadata()[0] as it is"
            )
        return True
    if meta.config != config:
        diffs = [
            f"{f.name}: {getattr(meta.config, f.name)!r} -> {getattr(config, f.name)!r}"
            for f in dataclasses.fields(config)
            if getattr(meta.config, f.name) != getattr(config, f.name)
        ]
        raise ValueError(
            "tile_scheduler_metadata was computed for another configuration (" + ", ".join(diffs) + "); "
            "call get_mla_metadata() again for a new configuration"
        )
    _check_lengths(meta, lengths, "topk_length", "_lengths", "cache_seqlens/topk_length")
    _check_lengths(meta, extra_lengths, "extra_topk_length", "_extra_lengths", "extra_topk_length")
    return False


def _check_lengths(meta: FlashMLASchedMeta, lengths: Optional[torch.Tensor], name: str, attr: str, what: str) -> None:
    """A reused metadata object's lengths (``attr``: its fields' prefix): given now as on the first call, with
    the same values (read only when the tensor is another one, or written since)."""
    ref, key, copy = (getattr(meta, attr + suffix) for suffix in ("_ref", "_key", "_copy"))
    if (lengths is None) != (copy is None):
        # Sparse decode only (dense always has cache_seqlens): the plan was made for the lengths
        # given, or for topk tokens each.
        raise ValueError(
            f"{name} must be given on every call with this tile_scheduler_metadata or on none "
            f"(first call: {'given' if copy is not None else 'None'})"
        )
    if lengths is not None and (lengths is not ref or _lengths_key(lengths) != key):
        capturing = lengths.is_cuda and torch.cuda.is_current_stream_capturing()
        if not capturing and not torch.equal(lengths, copy):
            raise ValueError(
                f"tile_scheduler_metadata was computed for other {what} values; "
                "call get_mla_metadata() again when the lengths change"
            )
        setattr(meta, attr + "_ref", lengths)
        setattr(meta, attr + "_key", _lengths_key(lengths))


def _bind_metadata(meta: FlashMLASchedMeta, config: FlashMLASchedMeta.Config, capturing: bool,
                   lengths: Optional[torch.Tensor], extra_lengths: Optional[torch.Tensor] = None,
                   device: Optional[torch.device] = None) -> None:
    """Record what an empty metadata object is computed for (after the call's checks passed), and whether the
    call runs inside a CUDA graph capture (which one: on ``device``)."""
    meta.config = config
    meta.have_initialized = True
    meta._in_capture = capturing
    meta._capture_id = capture_id(device) if capturing else None
    for attr, given in (("_lengths", lengths), ("_extra_lengths", extra_lengths)):
        if given is not None:
            setattr(meta, attr + "_ref", given)
            setattr(meta, attr + "_key", _lengths_key(given))
            setattr(meta, attr + "_copy", given.clone())


@contextlib.contextmanager
def _unbind_on_error(meta: FlashMLASchedMeta, first: bool):
    """A first call that fails after its checks (and the binding) leaves the metadata empty again, as
    ``get_mla_metadata()`` made it, so the next call computes it afresh instead of inheriting a half-filled one."""
    if not first:
        yield
        return
    try:
        yield
    except BaseException:
        fresh = FlashMLASchedMeta()
        for f in dataclasses.fields(FlashMLASchedMeta):
            setattr(meta, f.name, getattr(fresh, f.name))
        raise


@without_function_modes
def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: Optional[torch.Tensor],
    cache_seqlens: Optional[torch.Tensor],
    head_dim_v: int,
    tile_scheduler_metadata: FlashMLASchedMeta,
    num_splits: None = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    is_fp8_kvcache: Optional[bool] = None,
    indices: Optional[torch.Tensor] = None,
    attn_sink: Optional[torch.Tensor] = None,
    extra_k_cache: Optional[torch.Tensor] = None,
    extra_indices_in_kvcache: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    extra_topk_length: Optional[torch.Tensor] = None,
    enable_batch_invariant: bool = False,
    use_legacy: bool = False,
    kv_format: Optional[str] = None,
    descale_q: Optional[torch.Tensor] = None,
    descale_k: Optional[torch.Tensor] = None,
    *,
    backend: Optional[str] = None,
    schedule: Optional[DenseDecodeSchedule] = None,
    out: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """MLA decode attention over a paged cache (dense, or sparse over the FP8 cache).

    Dense (``indices is None``):
        q: ``[b, s_q, h_q, 576]`` bf16 or fp16 (512 latent + 64 RoPE), or, dense with a 16-bit cache,
            ``[b, s_q, h_q, 512]`` (no RoPE part: V is the whole row).
        k_cache: ``[num_blocks, page_block_size, h_kv, 576]`` (or 512, q's head_dim), dtype of q; or, with
            ``is_fp8_kvcache=True`` (the reference backend only), ``[num_blocks, page_block_size, 1, 656]`` FP8
            rows (see ``mla_cute.fp8``) with bf16 q, or the per-tensor FP8 cache ``[.., h_kv, 576]``
            float8_e4m3fn with ``descale_k`` and q bf16 or float8_e4m3fn with ``descale_q`` (out bf16).
        block_table: int32 ``[b, max_num_blocks]``: logical block j of request i is
            physical block ``block_table[i, j]``.
        cache_seqlens: int32 ``[b]``, KV length of each request (0 allowed).
        causal: bottom-right aligned mask (query t of s_q sees keys ``[0, len - (s_q-1-t))``).
    Sparse (``indices`` given, ``is_fp8_kvcache=True``, h_kv = 1):
        indices: int32 ``[b, s_q, topk]``, ``physical_block * page_block_size + offset``;
            -1 or any value outside the cache is skipped.
        topk_length: int32 ``[b]``, only the first ``topk_length[i]`` indices count.
        attn_sink: float32 ``[h_q]``: out *= exp(lse) / (exp(lse) + exp(attn_sink)).
        block_table and cache_seqlens may be None.
    Common:
        head_dim_v: must be 512.  tile_scheduler_metadata: from :func:`get_mla_metadata`; or, with
            ``num_splits``, the tensors of :func:`get_mla_decoding_metadata` (dense, or sparse over one cache).
        num_splits: None with a metadata object.  softmax_scale: default q's head_dim ``** -0.5``; a finite float > 0
            (an int, a numpy number or a 0-dim tensor is read with ``float()``; a bool is refused).
        causal: a bool (a numpy bool too; an int such as 1 is refused).
        is_fp8_kvcache: None (the default) means ``indices is not None``, as in FlashMLA's Hopper build.
        enable_batch_invariant: must be False (a request's result independent of its batch is not built yet).
        use_legacy: accepted (a bool) and ignored: FlashMLA's Hopper build selects its SM90 kernels with it;
            mla-cute has only those.
        descale_q, descale_k: float32 ``[1]`` for the per-tensor FP8 cache (true value = stored x descale);
            None elsewhere.
        kv_format: the sparse cache's format (``mla_cute.kv_formats``): "V32" (656 bytes, d_qk 576),
            "V32_NO_ROPE" (528), "V4" (584), "V41" (528), "V41_PAGED" (528: V41 page-blocked), with q's head_dim
            512 for all but V32; None: as the bytes per token name it (528: V41).  Both backends read every one.
        extra_k_cache / extra_indices_in_kvcache / extra_topk_length: a second quantized cache (its own page
            size and blocks; V41_FP4 beside V41 or V41_PAGED, else k_cache's format) whose indices join the same
            softmax: out and lse over the union of both index sets.  The cute kernel reads an extra cache of k_cache's
            format (V41_FP4: the reference backend only).
        backend: ``"cute"`` or ``"reference"`` (keyword only; default by device, or the
            ``MLA_CUTE_BACKEND`` environment variable).
        out (keyword): ``[b, s_q, h_q, 512]`` of q's dtype, contiguous, 16-byte aligned: the output is written
            there (the kernels write it in place, no copy; inside a CUDA graph too) and returned.
        schedule: a ``mla_cute.schedules.DenseDecodeSchedule`` for the dense cute kernel
            (keyword only; default: the one set by :func:`use_schedule`, else the default
            schedule).  A metadata object keeps the schedule it was first used with.

    Returns:
        out ``[b, s_q, h_q, 512]`` (q dtype) and lse ``[b, h_q, s_q]`` float32, natural
        log; a query with nothing to attend has out 0 and lse +inf.
    """
    if type(causal) is not bool:  # a numpy bool becomes a bool; anything else is a TypeError (before any work)
        causal = V.check_causal(causal)
    if is_fp8_kvcache is None:  # FlashMLA's Hopper build: inferred from indices
        is_fp8_kvcache = indices is not None
    if enable_batch_invariant is not False or use_legacy is not False:
        _check_hopper_build_arguments(enable_batch_invariant, use_legacy)
    if out is not None and isinstance(q, torch.Tensor) and q.dim() == 4 and q.dtype in _Q_DTYPES:
        # Once a call, replays included (a q this skips fails its own check before any launch; head_dim_v too).
        # An FP8 q (the per-tensor FP8 cache) gives a bf16 out.
        V.check_out(out, (*q.shape[:3], D_LATENT), _OUT_DTYPE.get(q.dtype, q.dtype), q.device)
    # Asked once a call: the one query of the capture state on the replay path, reused by the first call's checks.
    capturing = _capturing(q)
    if isinstance(tile_scheduler_metadata, FlashMLASchedMeta) and tile_scheduler_metadata.have_initialized:
        if capturing != tile_scheduler_metadata._in_capture:
            _refuse_across_capture(capturing)
        if capturing and capture_id(q.device) != tile_scheduler_metadata._capture_id:
            raise ValueError(
                "tile_scheduler_metadata was computed inside another CUDA graph capture: its scheduler kernel is "
                "in that graph only, so this graph would reuse a plan made for other lengths; call "
                "get_mla_metadata() inside each capture"
            )
    if (num_splits is None and type(tile_scheduler_metadata) is FlashMLASchedMeta
            and tile_scheduler_metadata._replay is not None and descale_q is None and descale_k is None):
        extra = (extra_k_cache, extra_indices_in_kvcache, extra_topk_length)
        if (indices is None and attn_sink is None and topk_length is None and kv_format is None
                and extra_k_cache is None and extra_indices_in_kvcache is None and extra_topk_length is None):
            done = _replay_dense(tile_scheduler_metadata, q, k_cache, block_table, cache_seqlens, head_dim_v,
                                 softmax_scale, causal, is_fp8_kvcache, schedule, backend, out)
        else:
            done = _replay_sparse(tile_scheduler_metadata, q, k_cache, block_table, cache_seqlens, head_dim_v,
                                  softmax_scale, causal, is_fp8_kvcache, indices, attn_sink, topk_length,
                                  kv_format, schedule, backend, extra, out)
        if done is not None:
            return done
    given_plan = isinstance(tile_scheduler_metadata, torch.Tensor) or (
        isinstance(num_splits, torch.Tensor) and not isinstance(tile_scheduler_metadata, FlashMLASchedMeta))
    if given_plan:  # dense decode's plan as tensors (get_mla_decoding_metadata)
        return _given_plan(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits,
                           softmax_scale, causal, is_fp8_kvcache, indices, attn_sink, topk_length, kv_format,
                           (extra_k_cache, extra_indices_in_kvcache, extra_topk_length), backend, schedule, out,
                           (descale_q, descale_k))
    if num_splits is not None:
        raise ValueError("num_splits must be None with a FlashMLASchedMeta (the split counts live in it); as a "
                         "tensor it comes with tile_scheduler_metadata from get_mla_decoding_metadata")
    given = extra_k_cache is not None or extra_indices_in_kvcache is not None or extra_topk_length is not None
    softmax_scale = _call_scale(softmax_scale, q)

    if indices is None:
        _check_dense_arguments(block_table, cache_seqlens, attn_sink, topk_length, kv_format,
                               (extra_k_cache, extra_indices_in_kvcache, extra_topk_length))
        V.check_dense(q, k_cache, block_table, cache_seqlens, head_dim_v, is_fp8_kvcache, descale_q, descale_k)
        kind = select_backend(q.device, backend)
        sched = _resolve_schedule(schedule, DenseDecodeSchedule)
        if kind == "cute":
            cute.check_supported(k_cache, is_fp8_kvcache)
        config = FlashMLASchedMeta.Config(
            q.shape[0], q.shape[1], q.shape[2], k_cache.shape[1], k_cache.shape[2],
            causal, is_fp8_kvcache, None, head_dim=q.shape[3], dtype=q.dtype,
        )
        first = _check_metadata(tile_scheduler_metadata, config, cache_seqlens)
        host_lengths = None  # read by the value checks; not inside a CUDA graph capture
        if first:
            if not capturing:
                host_lengths = V.check_dense_values(block_table, cache_seqlens, k_cache.shape[1], k_cache.shape[0])
            _bind_metadata(tile_scheduler_metadata, config, capturing, cache_seqlens, device=q.device)
        masked = causal and q.shape[1] > 1  # the mask (causal is ignored when s_q == 1)
        with _unbind_on_error(tile_scheduler_metadata, first):
            if kind == "reference":
                if first:
                    _fill_reference_metadata(tile_scheduler_metadata, q, k_cache, cache_seqlens, masked, sched,
                                             host_lengths)
                return into_out(out, _reference_dense(q, k_cache, block_table, cache_seqlens, softmax_scale, masked,
                                                   head_dim_v, is_fp8_kvcache, descale_q, descale_k))
            out, lse = cute.dense_decode(
                q, k_cache, block_table, cache_seqlens, softmax_scale, masked, tile_scheduler_metadata, first, sched,
                host_lengths, out,
            )
        # The facts hold the argument as given (the replay compares it), not the mask.
        tile_scheduler_metadata._replay = cute.replay_plan(
            tile_scheduler_metadata, q, k_cache, block_table, head_dim_v, causal, is_fp8_kvcache)
        return out, lse

    _refuse_sparse_descales(descale_q, descale_k)
    _check_ignored_tables(block_table, cache_seqlens)
    fmt, extra_fmt = V.check_sparse_decode(
        q, k_cache, indices, topk_length, attn_sink, head_dim_v, is_fp8_kvcache, causal, kv_format,
        (extra_k_cache, extra_indices_in_kvcache, extra_topk_length) if given else None)
    kind = select_backend(q.device, backend)
    sched = _resolve_schedule(schedule, SparseDecodeSchedule)
    if kind == "cute":
        cute.check_sparse_supported(k_cache, fmt)
        if given:
            cute.check_extra_cache_supported(k_cache, extra_k_cache, fmt, extra_fmt)
    config = FlashMLASchedMeta.Config(
        q.shape[0], q.shape[1], q.shape[2], k_cache.shape[1], k_cache.shape[2],
        False, True, indices.shape[-1], kv_format=fmt,
        extra_page_block_size=extra_k_cache.shape[1] if given else None,
        extra_topk=extra_indices_in_kvcache.shape[-1] if given else None,
        extra_kv_format=extra_fmt,
    )
    first = _check_metadata(tile_scheduler_metadata, config, topk_length, extra_topk_length)
    V.check_sink_presence(tile_scheduler_metadata, attn_sink is not None, first)
    if first:
        _bind_metadata(tile_scheduler_metadata, config, capturing, topk_length, extra_topk_length, q.device)
    with _unbind_on_error(tile_scheduler_metadata, first):
        if kind == "reference":
            if first:
                _fill_sparse_reference_metadata(tile_scheduler_metadata, q, indices.shape[-1], topk_length, sched)
            extra = (extra_k_cache, extra_fmt, extra_indices_in_kvcache, extra_topk_length) if given else None
            return into_out(out, reference.sparse_decode_fp8(q, k_cache, indices, softmax_scale, topk_length, attn_sink,
                                                          head_dim_v, fmt, extra))
        extra = (extra_k_cache, extra_fmt, extra_indices_in_kvcache, extra_topk_length) if given else None
        out, lse = cute.sparse_decode(
            q, k_cache, indices, topk_length, attn_sink, softmax_scale, tile_scheduler_metadata, first, sched, fmt,
            extra, out,
        )
    tile_scheduler_metadata._replay = cute.replay_sparse_plan(
        tile_scheduler_metadata, q, k_cache, indices, topk_length, attn_sink, block_table, cache_seqlens, head_dim_v,
        causal, is_fp8_kvcache, kv_format, (extra_k_cache, extra_indices_in_kvcache, extra_topk_length))
    return out, lse


def _given_plan(q, k_cache, block_table, cache_seqlens, head_dim_v, records, num_splits, softmax_scale, causal,
                is_fp8_kvcache, indices, attn_sink, topk_length, kv_format, extra, backend, schedule, out, descales):
    """A call over a plan given as tensors (``get_mla_decoding_metadata``'s): checked as a first call is, but for
    the lengths' values, which the GPU holds (the reference backend checks the plan against them)."""
    if indices is not None:
        _refuse_sparse_descales(*descales)
        return _sparse_given_plan(q, k_cache, block_table, cache_seqlens, head_dim_v, records, num_splits,
                                  softmax_scale, causal, is_fp8_kvcache, indices, attn_sink, topk_length, kv_format,
                                  extra, backend, schedule, out)
    _check_dense_arguments(block_table, cache_seqlens, attn_sink, topk_length, kv_format, extra)
    V.check_dense(q, k_cache, block_table, cache_seqlens, head_dim_v, is_fp8_kvcache, *descales)
    kind = select_backend(q.device, backend)
    sched = _resolve_schedule(schedule, DenseDecodeSchedule)
    if kind == "cute":
        cute.check_supported(k_cache, is_fp8_kvcache)
    b, s_q, h_q, _ = q.shape
    h_kv = k_cache.shape[2]
    rows = s_q * (h_q // h_kv)
    parts, scheduler = dense_tensor_plan(sched, rows=rows, h_kv=h_kv, device=device_facts(q.device))
    _check_plan_tensors(q, records, num_splits, parts, f"get_mla_decoding_metadata(cache_seqlens, {rows}, {h_kv})",
                        f"batch {b}, {rows} query rows a KV head")
    softmax_scale = _call_scale(softmax_scale, q)
    masked = causal and s_q > 1
    if kind == "reference":
        host_lengths = V.check_dense_values(block_table, cache_seqlens, k_cache.shape[1], k_cache.shape[0])
        _check_given_plan(records, num_splits, host_lengths, parts, scheduler, "this call's cache_seqlens")
        return into_out(out, _reference_dense(q, k_cache, block_table, cache_seqlens, softmax_scale, masked, head_dim_v,
                                           is_fp8_kvcache, *descales))
    return cute.dense_decode_given(q, k_cache, block_table, cache_seqlens, softmax_scale, masked, records, num_splits,
                                   sched, out)


def _sparse_given_plan(q, k_cache, block_table, cache_seqlens, head_dim_v, records, num_splits, softmax_scale, causal,
                       is_fp8_kvcache, indices, attn_sink, topk_length, kv_format, extra, backend, schedule, out):
    """One-cache sparse decode over a plan given as tensors (``_given_plan``)."""
    if any(val is not None for val in extra):
        raise TypeError("tile_scheduler_metadata: a call over two caches plans on its first call and takes a "
                        "FlashMLASchedMeta from get_mla_metadata(), not tensors")
    _check_ignored_tables(block_table, cache_seqlens)
    fmt, _ = V.check_sparse_decode(q, k_cache, indices, topk_length, attn_sink, head_dim_v, is_fp8_kvcache, causal,
                                   kv_format, None)
    kind = select_backend(q.device, backend)
    sched = _resolve_schedule(schedule, SparseDecodeSchedule)
    if kind == "cute":
        cute.check_sparse_supported(k_cache, fmt)
    b, s_q, h_q, _ = q.shape
    topk = indices.shape[-1]
    parts, scheduler = sparse_tensor_plan(sched, b=b, s_q=s_q, h_q=h_q, topk=topk, device=device_facts(q.device))
    _check_plan_tensors(q, records, num_splits, parts,
                        f"get_mla_decoding_metadata(cache_seqlens, {s_q * h_q}, 1, {h_q}, True, {topk})",
                        f"batch {b}, s_q {s_q}, h_q {h_q}, topk {topk}")
    softmax_scale = _call_scale(softmax_scale, q)
    if kind == "reference":
        _check_given_plan(records, num_splits, sparse_lengths(topk, None, b), parts, scheduler, f"topk ({topk})")
        return into_out(out, reference.sparse_decode_fp8(q, k_cache, indices, softmax_scale, topk_length, attn_sink,
                                                      head_dim_v, fmt, None))
    return cute.sparse_decode_given(q, k_cache, indices, topk_length, attn_sink, softmax_scale, records, num_splits,
                                    sched, fmt, out)


def _check_dense_arguments(block_table, cache_seqlens, attn_sink, topk_length, kv_format, extra) -> None:
    """A dense call's tables are given and no sparse-only argument is (``extra``: the three extra-cache ones)."""
    named = (("attn_sink", attn_sink), ("topk_length", topk_length), ("kv_format", kv_format),
             ("extra_k_cache", extra[0]), ("extra_indices_in_kvcache", extra[1]), ("extra_topk_length", extra[2]))
    for name, val in named:
        if val is not None:
            raise ValueError(f"{name} is only valid for sparse decode (with indices); got it with indices=None")
    if block_table is None or cache_seqlens is None:
        raise ValueError("block_table and cache_seqlens are required for dense decode (indices=None)")


def _check_ignored_tables(block_table, cache_seqlens) -> None:
    """Sparse decode ignores the block table and lengths, but takes them only as FlashMLA does (or None)."""
    if block_table is not None:
        V.check_tensor("block_table", block_table, dim=2, dtypes=(torch.int32,))
    if cache_seqlens is not None:
        V.check_tensor("cache_seqlens", cache_seqlens, dim=1, dtypes=(torch.int32,))


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


def _call_scale(softmax_scale, q) -> float:
    """The call's scale: the argument checked, else FlashMLA's default, q's head_dim ``** -0.5`` (576's for a q the
    call's own checks will refuse)."""
    if softmax_scale is not None:
        return V.check_scale("softmax_scale", softmax_scale)
    return q.shape[-1] ** -0.5 if isinstance(q, torch.Tensor) and q.dim() == 4 else _DEFAULT_SCALE


def _check_given_plan(records, num_splits, lengths, parts: int, scheduler, what: str) -> None:
    """The reference backend's check of a plan given as tensors: the one ``get_mla_decoding_metadata`` makes over
    ``lengths`` (the cute backend cannot read it without waiting for the GPU, and trusts it)."""
    want_records, want_splits = plan_splits(lengths, parts, 64, *scheduler.policy())
    if not (torch.equal(records.cpu(), want_records) and torch.equal(num_splits.cpu(), want_splits)):
        raise ValueError(f"tile_scheduler_metadata / num_splits hold another plan than get_mla_decoding_metadata "
                         f"makes over {what}: make them again (or refresh them in place) when the lengths change")


def _capturing(q) -> bool:
    """Whether a CUDA graph capture is under way on q's device's current stream (asked once a call)."""
    return isinstance(q, torch.Tensor) and q.is_cuda and torch.cuda.is_current_stream_capturing()


def _refuse_across_capture(capturing: bool) -> None:
    """A metadata object serves the calls on its side of a CUDA graph capture: one planned outside a capture is
    not used inside one (the graph's replays would reuse that plan whatever lengths they find), and one planned
    inside a capture not outside it (its plan is made again only by that graph's replays)."""
    if capturing:
        raise ValueError(
            "tile_scheduler_metadata was computed outside this CUDA graph capture, for the lengths of that call; "
            "its replays would reuse that plan whatever lengths they find: call get_mla_metadata() inside the "
            "capture and pass the new object"
        )
    raise ValueError(
        "tile_scheduler_metadata was computed inside a CUDA graph capture: only that graph's replays plan its "
        "lengths again, so a call outside the graph would reuse a plan made for other lengths; call "
        "get_mla_metadata() for calls outside the graph"
    )


def _check_hopper_build_arguments(enable_batch_invariant, use_legacy) -> None:
    """The arguments of FlashMLA's Hopper build beyond the upstream interface: ``use_legacy`` a bool (ignored),
    ``enable_batch_invariant`` refused until its kernels exist."""
    if type(use_legacy) is not bool:
        raise TypeError(f"use_legacy must be a bool, got {V.type_name(use_legacy)}")
    if type(enable_batch_invariant) is not bool:
        raise TypeError(f"enable_batch_invariant must be a bool, got {V.type_name(enable_batch_invariant)}")
    if enable_batch_invariant:
        raise NotImplementedError("enable_batch_invariant=True: batch-invariant decode is not built yet; pass False")


def _refuse_sparse_descales(descale_q, descale_k) -> None:
    for name, val in (("descale_q", descale_q), ("descale_k", descale_k)):
        if val is not None:
            raise ValueError(f"{name} applies to dense decode over the per-tensor FP8 cache; sparse decode's caches "
                             "carry their scales: pass None")


def _reference_dense(q, k_cache, block_table, cache_seqlens, softmax_scale, masked, head_dim_v, is_fp8_kvcache,
                     descale_q, descale_k):
    """The reference's dense decode over the operands' true values: the 656-byte cache dequantized; the per-tensor
    FP8 cache (and an FP8 q) times its descale, in fp32, the output bf16."""
    if is_fp8_kvcache and descale_k is None:
        k_cache = dequantize_kv_cache(k_cache)
    elif is_fp8_kvcache:
        k_cache = k_cache.float() * descale_k
    fp8_q = q.dtype == torch.float8_e4m3fn
    if fp8_q:
        q = q.float() * descale_q
    out, lse = reference.dense_decode(q, k_cache, block_table, cache_seqlens, softmax_scale, masked, head_dim_v)
    return (out.to(torch.bfloat16) if fp8_q else out), lse


def _replay_dense(meta, q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, is_fp8_kvcache,
                  schedule, backend, out=None):
    """The launch of a dense call whose every checked fact matches the last call that passed all checks.

    Returns None (the full path then checks and reports) when anything differs: a tensor's shape,
    strides, dtype, device or 16-byte alignment, the lengths tensor or its version, the schedule,
    the scale, or the backend (argument or environment).
    """
    plan = meta._replay
    if not isinstance(plan, cute.DensePlan):
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
    if (facts != plan.facts or _lengths_key(cache_seqlens) != meta._lengths_key
            or not _replay_schedule_and_backend(plan, schedule, DenseDecodeSchedule, backend)):
        return None
    return cute.replay_dense(plan, q, k_cache, block_table, cache_seqlens, meta, scale, out)


def _replay_sparse(meta, q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, is_fp8_kvcache,
                   indices, attn_sink, topk_length, kv_format, schedule, backend, extra, out=None):
    """The launch of a sparse decode call whose every checked fact matches the last call that passed
    all checks (as ``_replay_dense``: None sends the call down the checked path); ``extra``: (extra_k_cache,
    extra_indices_in_kvcache, extra_topk_length) as given."""
    plan = meta._replay
    extra_lengths = extra[2]
    # topk_length and extra_topk_length (or their absence) as the metadata was checked against: the same
    # tensors, storage, shape and version.
    if (not isinstance(plan, cute.SparsePlan) or topk_length is not meta._lengths_ref
            or extra_lengths is not meta._extra_lengths_ref or type(causal) is not bool):
        return None
    try:
        facts = cute.sparse_call_facts(q, k_cache, indices, topk_length, attn_sink, block_table, cache_seqlens,
                                       head_dim_v, causal, is_fp8_kvcache, kv_format, extra)
    except (AttributeError, TypeError):  # not tensors: the full path names the argument
        return None
    if (facts != plan.facts or (topk_length is not None and _lengths_key(topk_length) != meta._lengths_key)
            or (extra_lengths is not None and _lengths_key(extra_lengths) != meta._extra_lengths_key)
            or not _replay_schedule_and_backend(plan, schedule, SparseDecodeSchedule, backend)):
        return None
    scale = _replay_scale(softmax_scale, q.shape[-1] ** -0.5)  # equal facts: q is the checked call's 4-d tensor
    if scale is None:
        return None
    return cute.launch_sparse(plan, q, k_cache, indices, topk_length, attn_sink, scale, meta,
                              plan.extra_args(extra), out)


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


@without_function_modes
def write_kv_cache(k_cache: torch.Tensor, new_rows: torch.Tensor, slot_mapping: torch.Tensor, kv_format=None,
                   backend=None) -> None:
    """Quantize rows ``[n, d_qk]`` (bf16, fp16 or fp32) into their slots of a quantized cache, in place: row i goes
    to token ``slot_mapping[i]`` (``block * page + offset``; -1 skips the row), its bytes those
    ``quantize_kv_cache`` gives the row.  Slots must be -1 or within the cache, ``[0, num_blocks *
    page_block_size)``.  Rows aimed at one slot: the last of them in ``slot_mapping`` order is written, whole, on
    either backend (``backends.operations.last_writes``), as a sequential write would leave the slot.

    On the ``cute`` backend (CUDA tensors on Hopper) this is one kernel launch that reads no value on the host, so
    a CUDA graph can capture it: a slot outside the cache (any negative one, -5 as -1, or one past its end) is
    skipped like -1; the duplicates' rule adds a few torch operations (a sort of the slots) before it.  The
    ``reference`` backend (torch code, the CPU's, or any device's with ``backend="reference"``) reads the slots on
    the host and raises ValueError naming slot_mapping for a slot outside the cache (a negative one other than -1
    included)."""
    CACHE_WRITE(k_cache, new_rows, slot_mapping, kv_format, backend)


@without_function_modes
def flash_mla_sparse_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    use_legacy: bool = False,
    return_log2_lse: Optional[bool] = None,
    *,
    backend: Optional[str] = None,
    out: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Sparse prefill attention.

    q: ``[s_q, h_q, d_qk]`` bf16 with d_qk 576 (512 latent + 64 RoPE features, DeepSeek V3.2) or 512 (the
    latent part only: V4 and models without RoPE); kv: ``[s_kv, 1, d_qk]`` bf16; indices: int32
    ``[s_q, 1, topk]`` (valid when ``0 <= index < s_kv``); sm_scale: softmax scale, a finite
    float > 0 (as ``softmax_scale`` of :func:`flash_mla_with_kvcache`); d_v: must be 512;
    attn_sink: float32 ``[h_q]``; topk_length: int32 ``[s_q]``.  s_q, h_q and s_kv must be >= 1
    (FlashMLA's kernel cannot run an empty s_q either).

    Beyond FlashMLA, kv may be the paged FP8 cache of sparse decode, ``[num_blocks, page_block_size, 1, 656]``
    (float8_e4m3fn, uint8 or int8; ``mla_cute.quantize_kv_cache``'s rows), with d_qk 576 and indices
    ``block * page_block_size + offset`` (valid when ``0 <= index < num_blocks * page_block_size``): the
    prefill over the dequantized cache, which the kernel dequantizes as it gathers the rows, so no bf16 copy
    of the top-k rows is made.

    use_legacy (FlashMLA's Hopper build): accepted (a bool) and ignored.  return_log2_lse: None (the default)
    returns max_logits and lse as below; False returns None for both; True returns both in base 2 (times
    log2(e)), as FlashMLA's SM90 kernel writes them.  out (keyword): ``[s_q, h_q, 512]`` bf16, contiguous, 16-byte
    aligned: the output is written there in place and returned.

    Returns (out ``[s_q, h_q, 512]`` bf16, max_logits ``[s_q, h_q]`` float32 (max of
    scaled scores, -inf when nothing is valid), lse ``[s_q, h_q]`` float32, natural
    log, +inf when nothing is valid).
    """
    if type(use_legacy) is not bool:
        raise TypeError(f"use_legacy must be a bool, got {V.type_name(use_legacy)}")
    if return_log2_lse is not None and type(return_log2_lse) is not bool:
        raise TypeError(f"return_log2_lse must be None or a bool, got {V.type_name(return_log2_lse)}")
    res = SPARSE_PREFILL(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, backend, out)
    if return_log2_lse is None:
        return res
    if not return_log2_lse:
        return res[0], None, None
    return res[0], res[1].mul_(_LOG2_E), res[2].mul_(_LOG2_E)


def _fill_reference_metadata(meta: FlashMLASchedMeta, q, k_cache, cache_seqlens, causal, schedule,
                             host_lengths) -> None:
    """Give reference users the same metadata tensors the kernels would use."""
    dtype = "bfloat16" if q.dtype == torch.float8_e4m3fn else str(q.dtype).replace("torch.", "")
    call = resolve_dense(schedule, dtype=dtype, s_q=q.shape[1], h_q=q.shape[2],
                         h_kv=k_cache.shape[2], causal=causal, page=k_cache.shape[1], device=device_facts(q.device),
                         host_lengths=host_lengths, d_qk=q.shape[3])
    records, splits = plan_splits(cache_seqlens, call.parts, 64, *call.scheduler.policy())
    meta.tile_scheduler_metadata = records.to(q.device)
    meta.num_splits = splits.to(q.device)


def _fill_sparse_reference_metadata(meta: FlashMLASchedMeta, q, topk: int, topk_length, schedule) -> None:
    """The split plan of the sparse kernel, as the cute backend makes it (``resolve_sparse``: 64-token blocks over
    topk; small plans with their own fixed cost)."""
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        return  # planning on the host needs the lengths' values
    b, s_q, h_q, _ = q.shape
    call = resolve_sparse(schedule, b=b, s_q=s_q, h_q=h_q, topk=topk, has_sink=False,
                          has_topk_length=topk_length is not None, device=device_facts(q.device))
    records, splits = plan_splits(sparse_lengths(topk, topk_length, b), call.parts, 64, *call.scheduler.policy())
    meta.tile_scheduler_metadata = records.to(q.device)
    meta.num_splits = splits.to(q.device)


def precompile(configs: Iterable[dict], *, schedule=None) -> int:
    """Compile (or load from the disk cache) the decode kernels for each configuration.

    Dense decode: a dict with ``dtype`` (torch.bfloat16 / torch.float16), ``s_q``, ``h_q``,
    ``h_kv`` and optionally ``causal`` (False), ``page_block_size`` (64), ``d_qk`` (576 or 512; 576) and
    ``schedule``.
    Sparse FP8 decode: a dict with ``sparse=True``, ``s_q``, ``h_q`` and optionally
    ``attn_sink`` and ``topk_length`` (False: whether calls pass one), ``kv_format`` ("V32"), ``extra_cache``
    (False: whether calls pass ``extra_k_cache``; True: one of ``kv_format``, or its format's name, e.g.
    "V41_FP4") and ``schedule``.
    The cache writer (:func:`write_kv_cache`): a dict with ``write_cache=True`` and optionally ``kv_format``
    ("V32"), ``dtype`` (the rows', torch.bfloat16) and ``slot_dtype`` (torch.int64); one kernel each.
    Sparse prefill (:func:`flash_mla_sparse_fwd`): a dict with ``prefill=True``, ``h_q`` and optionally
    ``d_qk`` (576 or 512; 576), ``attn_sink``, ``topk_length`` and ``fp8_cache`` (False: kv is the paged FP8
    cache); one kernel each.
    ``schedule`` (keyword) is the default for configurations of its kind.  Every kernel a call of the
    configuration can resolve to is built (``mla_cute.schedules.dense_precompile_steps`` and
    ``sparse_precompile_steps``): for dense decode normal and evict-first loads, each with and without the
    combine, and where the shape takes 4-CTA clusters their step too; for sparse decode the kernels of
    plans that are small (``small_plan_tiles``) and of those that are not.  Needs no GPU (set
    ``CUTE_DSL_ARCH=sm_90a`` before importing cutlass on a machine without one).  Returns the
    number of configurations prepared; each cold compile logs a line with its configuration.
    """
    from collections.abc import Mapping

    sets = "named shape sets are built by `python -m mla_cute.precompile --sets NAME` (`--list` names them)"
    if isinstance(configs, (str, Mapping)):
        raise TypeError(f"precompile takes an iterable of configuration dicts, got a {type(configs).__name__} "
                        f"{configs!r:.80}: pass [config] for one; {sets}")
    count = 0
    for i, cfg in enumerate(configs):
        if not isinstance(cfg, Mapping):
            raise TypeError(f"precompile configurations are dicts, config {i} is a {type(cfg).__name__} "
                            f"{cfg!r:.80}; {sets}")
        cfg = dict(cfg)
        if cfg.pop("prefill", False):
            _precompile_prefill(i, cfg)
            count += 1
            continue
        if cfg.pop("write_cache", False):
            _precompile_writer(i, cfg)
            count += 1
            continue
        sparse = bool(cfg.pop("sparse", False))
        required = {"s_q", "h_q"} if sparse else {"dtype", "s_q", "h_q", "h_kv"}
        allowed = required | ({"attn_sink", "topk_length", "kv_format", "extra_cache", "schedule"} if sparse
                              else {"causal", "page_block_size", "d_qk", "schedule"})
        missing = required - cfg.keys()
        if missing:
            raise ValueError(f"precompile config {i} lacks {sorted(missing)}: {cfg}")
        extra = cfg.keys() - allowed
        if extra:
            raise ValueError(f"precompile config {i} has unknown keys {sorted(extra)}")
        for key in ("s_q", "h_q") + (() if sparse else ("h_kv",)):
            if not isinstance(cfg[key], int) or isinstance(cfg[key], bool) or cfg[key] < 1:
                raise ValueError(f"precompile config {i}: {key} must be an int >= 1, got {cfg[key]!r}")
        kind = SparseDecodeSchedule if sparse else DenseDecodeSchedule
        default = schedule if isinstance(schedule, kind) else None
        sched = _resolve_schedule(cfg.get("schedule", default), kind)
        if sparse:
            fmt = format_of(None, cfg.get("kv_format", "V32"), "kv_format")
            cute.check_kernel_format(fmt, f"precompile config {i}")
            extra = cfg.get("extra_cache", False)
            if extra is True:
                extra = fmt
            elif extra in (False, None, ""):
                extra = ""
            elif extra not in HEAD_DIM:
                raise ValueError(f"precompile config {i}: extra_cache must be True, False or a format name "
                                 f"({sorted(HEAD_DIM)}), got {extra!r}")
            check_extra_format(fmt, extra, f"precompile config {i}: extra_cache")
            cute.precompile_sparse(cfg["s_q"], cfg["h_q"], bool(cfg.get("attn_sink", False)), sched,
                                   bool(cfg.get("topk_length", False)), fmt, extra)
            count += 1
            continue
        if cfg["dtype"] not in V.HALF_DTYPES:
            raise TypeError(f"precompile config {i}: dtype must be torch.bfloat16 or torch.float16, got {cfg['dtype']}")
        if cfg["h_q"] % cfg["h_kv"] != 0:
            raise ValueError(f"precompile config {i}: h_q ({cfg['h_q']}) must be a multiple of h_kv ({cfg['h_kv']})")
        page = cfg.get("page_block_size", 64)
        if page % 64 != 0:
            raise NotImplementedError(f"precompile config {i}: page_block_size {page} is not a multiple of 64")
        d_qk = cfg.get("d_qk", D_QK)
        if d_qk not in (D_QK, D_LATENT) or isinstance(d_qk, bool):
            raise ValueError(f"precompile config {i}: d_qk must be {D_QK} or {D_LATENT}, got {d_qk!r}")
        cute.precompile_dense(cfg["dtype"], cfg["s_q"], cfg["h_q"], cfg["h_kv"], bool(cfg.get("causal", False)), page,
                              sched, d_qk)
        count += 1
    return count


def _precompile_writer(i: int, cfg: dict) -> None:
    """``precompile``'s cache-writer configuration ``i`` (``write_cache`` already taken out)."""
    extra = cfg.keys() - {"kv_format", "dtype", "slot_dtype"}
    if extra:
        raise ValueError(f"precompile config {i} has unknown keys {sorted(extra)}")
    fmt = format_of(None, cfg.get("kv_format", "V32"), "kv_format")
    dtype, slot_dtype = cfg.get("dtype", torch.bfloat16), cfg.get("slot_dtype", torch.int64)
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"precompile config {i}: dtype must be torch.bfloat16, torch.float16 or torch.float32, "
                        f"got {dtype}")
    if slot_dtype not in (torch.int32, torch.int64):
        raise TypeError(f"precompile config {i}: slot_dtype must be torch.int32 or torch.int64, got {slot_dtype}")
    cute.precompile_writer(fmt, dtype, slot_dtype)


def _precompile_prefill(i: int, cfg: dict) -> None:
    """``precompile``'s prefill configuration ``i`` (``prefill`` already taken out)."""
    extra = cfg.keys() - {"h_q", "d_qk", "attn_sink", "topk_length", "fp8_cache"}
    if extra:
        raise ValueError(f"precompile config {i} has unknown keys {sorted(extra)}")
    h_q, d_qk = cfg.get("h_q"), cfg.get("d_qk", D_QK)
    if not isinstance(h_q, int) or isinstance(h_q, bool) or h_q < 1:
        raise ValueError(f"precompile config {i}: h_q must be an int >= 1, got {h_q!r}")
    if d_qk not in (D_QK, 512):
        raise ValueError(f"precompile config {i}: d_qk must be {D_QK} or 512, got {d_qk!r}")
    sink, lengths = bool(cfg.get("attn_sink", False)), bool(cfg.get("topk_length", False))
    if cfg.get("fp8_cache", False):
        if d_qk != D_QK:
            raise ValueError(f"precompile config {i}: the FP8 cache (fp8_cache) takes d_qk {D_QK}, got {d_qk!r}")
        cute.precompile_sparse_prefill_fp8(h_q, sink, lengths)
        return
    cute.precompile_sparse_prefill(h_q, d_qk, sink, lengths)
