"""The public API, argument for argument FlashMLA's: a FlashMLA user changes only the import.  Each function is an
adapter over its call kind's operation object (``backends/decode.py``, ``backends/operations.py``)."""

from __future__ import annotations

import math
from typing import Iterable, Optional, Tuple

import torch

from . import validation as V
from .backend import select_backend
from .backends import cute
from .backends.decode import (DENSE_DECODE, SPARSE_DECODE, call_scale, fill_sparse_reference_metadata,
                              resolve_schedule, use_schedule)
from .backends.operations import CACHE_WRITE, SPARSE_PREFILL
from .device import capture_id
from .host import without_function_modes
from .fp8 import D_LATENT, D_QK
from .kv_formats import HEAD_DIM, format_of
from .metadata import FlashMLASchedMeta
from .schedules.configs import check_extra_format
from .schedules import DenseDecodeSchedule, SparseDecodeSchedule

_Q_DTYPES = V.HALF_DTYPES + (torch.float8_e4m3fn,)
_OUT_DTYPE = {torch.float8_e4m3fn: torch.bfloat16}  # out's dtype where it is not q's
_LOG2_E = math.log2(math.e)
_resolve_schedule = resolve_schedule  # the name precompile and older callers use
_fill_sparse_reference_metadata = fill_sparse_reference_metadata


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
    sched = resolve_schedule(schedule, DenseDecodeSchedule)
    kind = select_backend(seqlens_k.device, backend)
    return DENSE_DECODE.plan_tensors(kind, seqlens_k, num_q_tokens_per_head_k, h_k, is_fp8_kvcache, sched)


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
    sched = resolve_schedule(schedule, SparseDecodeSchedule)
    b, s_q, device = seqlens_k.shape[0], rows // h_q, seqlens_k.device
    return SPARSE_DECODE.plan_tensors(select_backend(device, backend), b, s_q, h_q, topk, sched, device)


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
            ``[b, s_q, h_q, 512]`` (no RoPE part: V is the whole row; the reference backend only).
        k_cache: ``[num_blocks, page_block_size, h_kv, 576]`` (or 512, q's head_dim), dtype of q; or, with
            ``is_fp8_kvcache=True``, ``[num_blocks, page_block_size, 1, 656]`` FP8 rows (see ``mla_cute.fp8``)
            with bf16 q (on the cute backend the sparse kernel over every position, with a metadata object and a
            ``SparseDecodeSchedule``), or the per-tensor FP8 cache ``[.., h_kv, 576]`` float8_e4m3fn with
            ``descale_k`` and q bf16 or float8_e4m3fn with ``descale_q`` (out bf16; the reference backend only).
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
        enable_batch_invariant: True: a request's out and lse are bit-identical whatever batch it is in and
            whatever the other requests' lengths.  Split-KV is kept: each request is cut into pieces by its own
            length alone (the schedule's ``invariant_piece_blocks`` / ``invariant_max_pieces``), one part each, and
            every batch size runs the same kernels (docs/api.md, "Batch invariance").  With a metadata object only
            (not get_mla_decoding_metadata's tensors); the object keeps the choice of its first call.
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
        schedule: a ``mla_cute.schedules.DenseDecodeSchedule`` for the dense cute kernel (a
            ``SparseDecodeSchedule`` for sparse decode and for dense decode over the 656-byte cache)
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
    invariant = enable_batch_invariant is True
    if out is not None and isinstance(q, torch.Tensor) and q.dim() == 4 and q.dtype in _Q_DTYPES:
        # Once a call, replays included (a q this skips fails its own check before any launch; head_dim_v too).
        # An FP8 q (the per-tensor FP8 cache) gives a bf16 out.
        V.check_out(out, (*q.shape[:3], D_LATENT), _OUT_DTYPE.get(q.dtype, q.dtype), q.device)
    # Asked once a call: the capture state (and the capture's id) on the replay path, reused by the first call's
    # checks and binding.
    capturing = _capturing(q)
    capture = (capturing, capture_id(q.device) if capturing else None)
    meta = tile_scheduler_metadata
    if isinstance(meta, FlashMLASchedMeta) and meta.have_initialized:
        if capturing != meta._in_capture:
            _refuse_across_capture(capturing)
        if capturing and capture[1] != meta._capture_id:
            raise ValueError(
                "tile_scheduler_metadata was computed inside another CUDA graph capture: its scheduler kernel is "
                "in that graph only, so this graph would reuse a plan made for other lengths; call "
                "get_mla_metadata() inside each capture"
            )
    extra = (extra_k_cache, extra_indices_in_kvcache, extra_topk_length)
    descales = (descale_q, descale_k)
    if (num_splits is None and type(meta) is FlashMLASchedMeta and meta._replay is not None
            and descale_q is None and descale_k is None):
        if (indices is None and attn_sink is None and topk_length is None and kv_format is None
                and extra_k_cache is None and extra_indices_in_kvcache is None and extra_topk_length is None):
            done = DENSE_DECODE.replay(meta, q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale,
                                       causal, is_fp8_kvcache, schedule, backend, out, invariant)
        else:
            done = SPARSE_DECODE.replay(meta, q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale,
                                        causal, is_fp8_kvcache, indices, attn_sink, topk_length, kv_format, schedule,
                                        backend, extra, out, invariant)
        if done is not None:
            return done
    given_plan = isinstance(meta, torch.Tensor) or (
        isinstance(num_splits, torch.Tensor) and not isinstance(meta, FlashMLASchedMeta))
    if given_plan:  # the plan as tensors (get_mla_decoding_metadata)
        if invariant:
            raise ValueError("enable_batch_invariant=True plans each request by its own length on the call: pass "
                             "a FlashMLASchedMeta from get_mla_metadata() as tile_scheduler_metadata (and "
                             "num_splits None), not get_mla_decoding_metadata's tensors")
        if indices is None:
            DENSE_DECODE.check(q, k_cache, block_table, cache_seqlens, head_dim_v, is_fp8_kvcache, descales,
                               (attn_sink, topk_length, kv_format, *extra))
            return DENSE_DECODE.given(select_backend(q.device, backend), meta, num_splits, q, k_cache, block_table,
                                      cache_seqlens, head_dim_v, softmax_scale, causal, is_fp8_kvcache, descales,
                                      schedule, out)
        fmt = SPARSE_DECODE.check_given(q, k_cache, block_table, cache_seqlens, indices, topk_length, attn_sink,
                                        head_dim_v, is_fp8_kvcache, causal, kv_format, extra, descales)
        return SPARSE_DECODE.given(select_backend(q.device, backend), meta, num_splits, q, k_cache, indices,
                                   topk_length, attn_sink, softmax_scale, head_dim_v, fmt, schedule, out)
    if num_splits is not None:
        raise ValueError("num_splits must be None with a FlashMLASchedMeta (the split counts live in it); as a "
                         "tensor it comes with tile_scheduler_metadata from get_mla_decoding_metadata")
    softmax_scale = call_scale(softmax_scale, q)
    if indices is None:
        DENSE_DECODE.check(q, k_cache, block_table, cache_seqlens, head_dim_v, is_fp8_kvcache, descales,
                           (attn_sink, topk_length, kv_format, *extra))
        return DENSE_DECODE(select_backend(q.device, backend), meta, capture, q, k_cache, block_table, cache_seqlens,
                            head_dim_v, softmax_scale, causal, is_fp8_kvcache, descales, schedule, out, invariant)
    formats = SPARSE_DECODE.check(q, k_cache, block_table, cache_seqlens, indices, topk_length, attn_sink, head_dim_v,
                                  is_fp8_kvcache, causal, kv_format, extra, descales)
    return SPARSE_DECODE(select_backend(q.device, backend), meta, capture, q, k_cache, block_table, cache_seqlens,
                         head_dim_v, softmax_scale, causal, is_fp8_kvcache, indices, attn_sink, topk_length,
                         kv_format, extra, formats, schedule, out, invariant)


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


def precompile(configs: Iterable[dict], *, schedule=None) -> int:
    """Compile (or load from the disk cache) the decode kernels for each configuration.

    Dense decode: a dict with ``dtype`` (torch.bfloat16 / torch.float16), ``s_q``, ``h_q``,
    ``h_kv`` and optionally ``causal`` (False), ``page_block_size`` (64),
    ``batch_invariant`` (False: the kernels of ``enable_batch_invariant=True`` calls) and ``schedule``.
    Sparse FP8 decode: a dict with ``sparse=True``, ``s_q``, ``h_q`` and optionally
    ``attn_sink`` and ``topk_length`` (False: whether calls pass one), ``kv_format`` ("V32"), ``extra_cache``
    (False: whether calls pass ``extra_k_cache``; True: one of ``kv_format``, or its format's name, e.g.
    "V41_FP4"), ``batch_invariant`` (False) and ``schedule``.
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
        allowed = required | {"schedule", "batch_invariant"} | ({"attn_sink", "topk_length", "kv_format", "extra_cache"}
                                                                if sparse else {"causal", "page_block_size"})
        missing = required - cfg.keys()
        if missing:
            raise ValueError(f"precompile config {i} lacks {sorted(missing)}: {cfg}")
        extra = cfg.keys() - allowed
        if extra:
            raise ValueError(f"precompile config {i} has unknown keys {sorted(extra)}")
        for key in ("s_q", "h_q") + (() if sparse else ("h_kv",)):
            if not isinstance(cfg[key], int) or isinstance(cfg[key], bool) or cfg[key] < 1:
                raise ValueError(f"precompile config {i}: {key} must be an int >= 1, got {cfg[key]!r}")
        invariant = cfg.get("batch_invariant", False)
        if type(invariant) is not bool:
            raise TypeError(f"precompile config {i}: batch_invariant must be a bool, got {V.type_name(invariant)}")
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
                                   bool(cfg.get("topk_length", False)), fmt, extra,
                                   **({"invariant": True} if invariant else {}))
            count += 1
            continue
        if cfg["dtype"] not in V.HALF_DTYPES:
            raise TypeError(f"precompile config {i}: dtype must be torch.bfloat16 or torch.float16, got {cfg['dtype']}")
        if cfg["h_q"] % cfg["h_kv"] != 0:
            raise ValueError(f"precompile config {i}: h_q ({cfg['h_q']}) must be a multiple of h_kv ({cfg['h_kv']})")
        page = cfg.get("page_block_size", 64)
        if page % 64 != 0:
            raise NotImplementedError(f"precompile config {i}: page_block_size {page} is not a multiple of 64")
        cute.precompile_dense(cfg["dtype"], cfg["s_q"], cfg["h_q"], cfg["h_kv"], bool(cfg.get("causal", False)), page,
                              sched, **({"invariant": True} if invariant else {}))
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
    ``enable_batch_invariant`` a bool."""
    if type(use_legacy) is not bool:
        raise TypeError(f"use_legacy must be a bool, got {V.type_name(use_legacy)}")
    if type(enable_batch_invariant) is not bool:
        raise TypeError(f"enable_batch_invariant must be a bool, got {V.type_name(enable_batch_invariant)}")
