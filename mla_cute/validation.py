"""Input validation for the public API: every check runs before any launch.

Errors name the argument, what was given and what is expected.  TypeError for a
wrong type or dtype, ValueError for a wrong value, shape or device.

Values (the contents of ``block_table``, ``cache_seqlens``, ``indices``, ``topk_length`` and
``extra_topk_length``) are checked only where a call reads them on the host anyway, so that no check
costs a host sync of its own:

- Dense decode's first call with a metadata object (outside a CUDA graph capture) reads ``cache_seqlens``
  for its plan: ``check_dense_values`` refuses there, on both backends, a negative length, a length past
  what the block table covers, and a block id outside ``[0, num_blocks)`` that a length uses.
- Nothing else is read on the host: later calls with that metadata (a new block table or cache, lengths
  written where the version counter does not see it), CUDA graph replays, and every sparse call (sparse
  decode plans on the device; prefill plans nothing).  There the kernels take each value within its range,
  and the reference backend takes it the same way: a length within ``[0, block_table.shape[1] *
  page_block_size]`` (a negative one attends to nothing), a used block id outside the cache reads keys and
  values of zeros (zero scores in the softmax; over an FP8 cache its tokens are skipped), ``topk_length`` and ``extra_topk_length`` within
  ``[0, topk]`` (a negative one counts no index, one past topk all of them), an index outside the cache is
  skipped.  The reference backend holds these values on the host but does not refuse them: it is the
  specification the kernels are tested against, so both backends give one result for any value.
"""

from __future__ import annotations

import numbers
import sys
from typing import Optional

import torch

from .fp8 import D_LATENT, D_QK, FP8_BYTES_PER_TOKEN
from .kv_formats import BYTES_PER_TOKEN, HEAD_DIM, check_page_layout, format_of

FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.uint8, torch.int8)
HALF_DTYPES = (torch.bfloat16, torch.float16)
DEVICE_TYPES = ("cpu", "cuda")
_INF = float("inf")


def type_name(value) -> str:
    """The name of ``value``'s type as an error shows it: ``float``, ``numpy.bool``, ``torch.Tensor``."""
    t = type(value)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__.split('.')[0]}.{t.__qualname__}"


def _is_numpy_bool(value) -> bool:
    np = sys.modules.get("numpy")  # a numpy bool exists only once numpy is imported
    return np is not None and isinstance(value, np.bool_)


def check_causal(causal) -> bool:
    """``causal`` as a Python bool: a bool or a numpy bool; anything else (an int such as 1 too) is a TypeError."""
    if type(causal) is bool:
        return causal
    if _is_numpy_bool(causal):
        return bool(causal)
    raise TypeError(f"causal must be a bool, got {type_name(causal)}")


def check_scale(name: str, value) -> float:
    """A softmax scale as a finite positive Python float.

    Takes what FlashMLA's float argument takes: a float or int, a numpy number, a 0-dim tensor (read
    with ``float()``: a CUDA one syncs).  A bool (Python or numpy, or a bool tensor) is not a scale.
    """
    if type(value) is float:
        v = value
    elif isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype == torch.bool or value.is_complex():
            raise TypeError(f"{name} must be a float or a 0-dim real tensor, got a {value.dtype} tensor "
                            f"of shape {list(value.shape)}")
        if value.device.type not in DEVICE_TYPES:
            raise ValueError(f"{name} must be a float or a CPU/CUDA 0-dim tensor, got one on device {value.device}")
        v = float(value)
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):  # numpy numbers included
        try:
            v = float(value)
        except OverflowError:  # an int too large for a float
            v = _INF
    else:
        raise TypeError(f"{name} must be a positive finite float, got {type_name(value)}")
    if not 0.0 < v < _INF:  # False for nan too
        raise ValueError(f"{name} must be a positive finite float, got {value!r}")
    return v


def check_device(name: str, t: torch.Tensor) -> None:
    """Only CPU and CUDA tensors: other devices (meta, mps, ...) have no backend."""
    if t.device.type not in DEVICE_TYPES:
        raise ValueError(
            f"{name} is on device {t.device}, which mla-cute does not support: use CPU tensors (the 'reference' "
            "backend) or CUDA tensors (the 'cute' kernels on an SM90 GPU; backend='reference' on other GPUs)"
        )


def check_tensor(name: str, t, *, dim: Optional[int] = None, dtypes: Optional[tuple] = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimensions, got shape {list(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype {want}, got {t.dtype}")


def check_shape(name: str, t: torch.Tensor, expected: tuple, what: str) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {what} = {list(expected)}, got {list(t.shape)}")


def check_same_device(ref_name: str, ref: torch.Tensor, **others) -> None:
    for name, t in others.items():
        if t is not None and t.device != ref.device:
            raise ValueError(f"{name} must be on the same device as {ref_name} ({ref.device}), got {t.device}")


def check_out(out, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    """The caller's ``out`` tensor, which the kernels write in place: ``shape``, ``dtype``, ``device``, contiguous
    with a 16-byte aligned base (a slice of a larger buffer along its first dimension is)."""
    check_tensor("out", out)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device:
        raise ValueError(f"out must be a {dtype} tensor of shape {list(shape)} on {device}, got {out.dtype} "
                         f"{list(out.shape)} on {out.device}")
    if not out.is_contiguous() or out.data_ptr() % 16:
        raise ValueError(f"out must be contiguous with a 16-byte aligned base, got strides {list(out.stride())}")


def check_dense(q, k_cache, block_table, cache_seqlens, head_dim_v, is_fp8_kvcache, descale_q=None,
                descale_k=None) -> None:
    """Shapes, dtypes and devices of a dense decode call (no tensor values read).  A 16-bit q and cache share one
    head_dim: 576 (512 latent + 64 RoPE) or 512 (no RoPE part); V is a row's first 512 features.  With
    ``is_fp8_kvcache`` the cache is the 656-byte V3.2 one (bf16 q, one KV head, its own scales) or the per-tensor
    FP8 one: float8_e4m3fn ``[.., 576]`` with ``descale_k``, q bf16 or float8_e4m3fn with ``descale_q``."""
    check_tensor("q", q, dim=4, dtypes=HALF_DTYPES + (torch.float8_e4m3fn,))
    check_device("q", q)
    b, s_q, h_q, d = q.shape
    if d not in (D_QK, D_LATENT):
        raise ValueError(f"q must have head_dim {D_QK} (512 latent + 64 RoPE) or {D_LATENT} (no RoPE part), got {d}")
    if d != D_QK and is_fp8_kvcache:
        raise ValueError(f"q must have head_dim {D_QK} with is_fp8_kvcache=True (the FP8 caches hold 576 features a "
                         f"token), got {d}")
    if b < 1 or s_q < 1 or h_q < 1:
        raise ValueError(f"q must have batch, s_q and h_q >= 1, got shape {list(q.shape)}")
    if head_dim_v != D_LATENT:
        raise ValueError(f"head_dim_v must be {D_LATENT}, got {head_dim_v}")
    per_tensor = False
    if is_fp8_kvcache:
        check_tensor("k_cache", k_cache, dim=4, dtypes=FP8_CACHE_DTYPES)
        per_tensor = k_cache.dtype == torch.float8_e4m3fn and k_cache.shape[3] == D_QK
        if per_tensor:
            check_descale("descale_k", descale_k, q.device)
            if q.dtype == torch.float8_e4m3fn:
                check_descale("descale_q", descale_q, q.device)
            elif q.dtype != torch.bfloat16:
                raise TypeError(f"q must be torch.bfloat16 or torch.float8_e4m3fn with the per-tensor FP8 cache, "
                                f"got {q.dtype}")
            elif descale_q is not None:
                raise ValueError("descale_q applies to a float8_e4m3fn q; q is bfloat16: pass None")
        else:
            if q.dtype != torch.bfloat16:
                raise TypeError(f"q must be torch.bfloat16 with the 656-byte FP8 cache, got {q.dtype}")
            if k_cache.shape[3] != FP8_BYTES_PER_TOKEN or k_cache.shape[2] != 1:
                raise ValueError(
                    f"k_cache must have shape [num_blocks, page_block_size, 1, {FP8_BYTES_PER_TOKEN}] (the V3.2 "
                    f"cache's bytes) or [num_blocks, page_block_size, h_kv, {D_QK}] float8_e4m3fn (the per-tensor "
                    f"FP8 cache, with descale_k) with is_fp8_kvcache=True, got {list(k_cache.shape)} {k_cache.dtype}"
                )
    else:
        if q.dtype not in HALF_DTYPES:
            raise TypeError(f"q must be torch.bfloat16 or torch.float16 with a 16-bit cache, got {q.dtype}")
        check_tensor("k_cache", k_cache, dim=4)
        if k_cache.dtype != q.dtype:
            raise TypeError(f"k_cache must have the dtype of q ({q.dtype}), got {k_cache.dtype}")
        if k_cache.shape[3] != d:
            raise ValueError(f"k_cache must have q's head_dim {d}, got shape {list(k_cache.shape)}")
    if not per_tensor:
        for name, val in (("descale_q", descale_q), ("descale_k", descale_k)):
            if val is not None:
                raise ValueError(f"{name} applies to dense decode over the per-tensor FP8 cache (a float8_e4m3fn "
                                 f"k_cache [.., {D_QK}] with is_fp8_kvcache=True): pass None")
    num_blocks, page, h_kv = k_cache.shape[:3]
    if page < 1 or num_blocks < 1:
        raise ValueError(f"k_cache must have num_blocks >= 1 and page_block_size >= 1, got shape {list(k_cache.shape)}")
    if h_kv < 1 or h_q % h_kv != 0:
        raise ValueError(f"h_q ({h_q}, q.shape[2]) must be a multiple of h_kv ({h_kv}, k_cache.shape[2])")
    check_tensor("block_table", block_table, dim=2, dtypes=(torch.int32,))
    if block_table.shape[0] != b:
        raise ValueError(f"block_table must have shape [batch_size={b}, max_num_blocks], got {list(block_table.shape)}")
    check_tensor("cache_seqlens", cache_seqlens, dim=1, dtypes=(torch.int32,))
    check_shape("cache_seqlens", cache_seqlens, (b,), "[batch_size]")
    check_same_device("q", q, k_cache=k_cache, block_table=block_table, cache_seqlens=cache_seqlens)


def check_descale(name: str, t, device) -> None:
    """A per-tensor FP8 operand's descale (its true values are the stored ones times it): float32 ``[1]`` on the
    call's device."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a float32 tensor [1] (true value = stored value x {name}), got "
                        f"{type_name(t)}")
    if t.dtype != torch.float32 or tuple(t.shape) != (1,):
        raise ValueError(f"{name} must be a float32 tensor [1], got {t.dtype} {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on the same device as q ({device}), got {t.device}")


def check_dense_values(block_table: torch.Tensor, cache_seqlens: torch.Tensor, page: int,
                       num_blocks: int) -> torch.Tensor:
    """Value checks (one host sync): lengths covered by the block table, block ids in range.  Returns the
    lengths on the host (int64, CPU), read by the same transfer."""
    max_blocks = block_table.shape[1]
    lens = cache_seqlens.long()
    needed = (lens + page - 1) // page  # blocks each request uses
    pos = torch.arange(max_blocks, device=block_table.device).unsqueeze(0)
    used = pos < needed.unsqueeze(1)
    bad_ids = (used & ((block_table < 0) | (block_table >= num_blocks))).flatten().long()
    first_bad = bad_ids.argmax() if bad_ids.numel() else torch.zeros_like(lens.max())
    host = torch.cat([torch.stack([lens.min(), lens.max(), bad_ids.sum(), first_bad]), lens]).cpu()
    lo, hi, any_bad, flat = host[:4].tolist()
    if lo < 0:
        raise ValueError(f"cache_seqlens must be >= 0, got a minimum of {lo}")
    if hi > max_blocks * page:
        raise ValueError(
            f"cache_seqlens has a length of {hi} but block_table covers only "
            f"{max_blocks} blocks x page_block_size {page} = {max_blocks * page} tokens"
        )
    if any_bad:
        i, j = divmod(int(flat), max_blocks)
        raise ValueError(
            f"block_table[{i}, {j}] = {int(block_table[i, j])} is used by cache_seqlens[{i}] but is outside "
            f"[0, num_blocks={num_blocks})"
        )
    return host[4:]


def sink_presence_error(first_had_sink: bool) -> ValueError:
    """The error of a call that gives ``attn_sink`` where the metadata's first call did not, or the reverse: the
    plan (the kernel, its workspace) is made for one or the other."""
    return ValueError(
        "attn_sink must be given on every call with this tile_scheduler_metadata or on none "
        f"(first call: {'given' if first_had_sink else 'None'})"
    )


def check_sink_presence(meta, has_sink: bool, first: bool) -> None:
    """Sparse decode's ``attn_sink`` given on every call with one metadata object or on none, whatever the
    backend: the first call (``first``) records it in the metadata's state, a later one must match."""
    if first or "attn_sink" not in meta._state:
        meta._state["attn_sink"] = has_sink
    elif meta._state["attn_sink"] != has_sink:
        raise sink_presence_error(meta._state["attn_sink"])


def _check_topk_length_and_sink(topk_length, length_shape: tuple, length_what: str, attn_sink, h_q: int) -> None:
    if topk_length is not None:
        check_tensor("topk_length", topk_length, dim=1, dtypes=(torch.int32,))
        check_shape("topk_length", topk_length, length_shape, length_what)
    if attn_sink is not None:
        check_tensor("attn_sink", attn_sink, dim=1, dtypes=(torch.float32,))
        check_shape("attn_sink", attn_sink, (h_q,), "[h_q]")


def check_sparse_decode(q, k_cache, indices, topk_length, attn_sink, head_dim_v, is_fp8_kvcache, causal,
                        kv_format=None, extra=None) -> tuple:
    """Shapes, dtypes and devices of a sparse decode call; ``extra``: (extra_k_cache, extra_indices_in_kvcache,
    extra_topk_length) or None.  Returns the formats of the cache and the extra cache (None without one)."""
    if not is_fp8_kvcache:
        raise ValueError("is_fp8_kvcache must be True when indices is given (sparse decode reads the FP8 cache)")
    if causal:
        raise ValueError("causal must be False when indices is given (sparse decode)")
    check_tensor("q", q, dim=4, dtypes=(torch.bfloat16,))
    check_device("q", q)
    b, s_q, h_q, d = q.shape
    if b < 1 or s_q < 1 or h_q < 1:
        raise ValueError(f"q must have batch, s_q and h_q >= 1, got shape {list(q.shape)}")
    if head_dim_v != D_LATENT:
        raise ValueError(f"head_dim_v must be {D_LATENT}, got {head_dim_v}")
    fmt = _check_quantized_cache("k_cache", k_cache, kv_format)
    if fmt == "V41_FP4":
        raise ValueError("kv_format V41_FP4 is only valid for extra_k_cache, beside a V41 or V41_PAGED k_cache")
    if d != HEAD_DIM[fmt]:
        raise ValueError(f"q must have head_dim {HEAD_DIM[fmt]} with a {fmt} cache, got {d}")
    check_tensor("indices", indices, dim=3, dtypes=(torch.int32,))
    if tuple(indices.shape[:2]) != (b, s_q) or indices.shape[2] < 1:
        raise ValueError(f"indices must have shape [batch_size={b}, s_q={s_q}, topk>=1], got {list(indices.shape)}")
    _check_topk_length_and_sink(topk_length, (b,), "[batch_size]", attn_sink, h_q)
    check_same_device("q", q, k_cache=k_cache, indices=indices, topk_length=topk_length, attn_sink=attn_sink)
    if extra is None:
        return fmt, None
    extra_k_cache, extra_indices, extra_topk_length = extra
    if extra_k_cache is None or extra_indices is None:
        raise ValueError("extra_k_cache and extra_indices_in_kvcache must be given together "
                         "(extra_topk_length only with them)")
    same = fmt if extra_k_cache.dim() == 4 and extra_k_cache.shape[-1] == BYTES_PER_TOKEN[fmt] else None
    extra_fmt = _check_quantized_cache("extra_k_cache", extra_k_cache, same)
    if extra_fmt == "V41_FP4" and fmt not in ("V41", "V41_PAGED"):
        raise ValueError(f"extra_k_cache in V41_FP4 needs a V41 or V41_PAGED k_cache, got {fmt}")
    if HEAD_DIM[extra_fmt] != d:
        raise ValueError(f"extra_k_cache ({extra_fmt}) must hold q's head_dim {d}, it holds {HEAD_DIM[extra_fmt]}")
    check_tensor("extra_indices_in_kvcache", extra_indices, dim=3, dtypes=(torch.int32,))
    if tuple(extra_indices.shape[:2]) != (b, s_q) or extra_indices.shape[2] < 1:
        raise ValueError(f"extra_indices_in_kvcache must have shape [batch_size={b}, s_q={s_q}, extra_topk>=1], "
                         f"got {list(extra_indices.shape)}")
    if extra_topk_length is not None:
        check_tensor("extra_topk_length", extra_topk_length, dim=1, dtypes=(torch.int32,))
        check_shape("extra_topk_length", extra_topk_length, (b,), "[batch_size]")
    check_same_device("q", q, extra_k_cache=extra_k_cache, extra_indices_in_kvcache=extra_indices,
                      extra_topk_length=extra_topk_length)
    return fmt, extra_fmt


def _check_quantized_cache(name: str, cache, kv_format) -> str:
    """A quantized cache ``[num_blocks, page_block_size, 1, bytes per token]``, a page-blocked one laid out as
    ``check_page_layout`` says; returns its format."""
    check_tensor(name, cache, dim=4, dtypes=FP8_CACHE_DTYPES)
    fmt = format_of(cache, kv_format, name)
    if cache.shape[2] != 1 or cache.shape[3] != BYTES_PER_TOKEN[fmt]:
        raise ValueError(f"{name} must have shape [num_blocks, page_block_size, 1, {BYTES_PER_TOKEN[fmt]}], "
                         f"got {list(cache.shape)}")
    if cache.shape[0] < 1 or cache.shape[1] < 1:
        raise ValueError(f"{name} must have num_blocks >= 1 and page_block_size >= 1, got shape {list(cache.shape)}")
    check_page_layout(name, cache, fmt)
    return fmt


def check_sparse_prefill(q, kv, indices, d_v, attn_sink, topk_length) -> None:
    check_tensor("q", q, dim=3, dtypes=(torch.bfloat16,))
    check_device("q", q)
    s_q, h_q, d = q.shape
    if d not in (D_QK, D_LATENT):
        raise ValueError(f"q must have head_dim {D_QK} (latent and RoPE) or {D_LATENT} (latent only), got {d}")
    if s_q < 1 or h_q < 1:
        # FlashMLA cannot run these either (its TMA descriptors and grid need s_q >= 1, and h_q is 64 or 128).
        raise ValueError(f"q must have s_q and h_q >= 1, got shape {list(q.shape)}")
    if d_v != D_LATENT:
        raise ValueError(f"d_v must be {D_LATENT}, got {d_v}")
    if isinstance(kv, torch.Tensor) and kv.dim() == 4:
        _check_prefill_fp8_cache(kv, d)
    else:
        check_tensor("kv", kv, dim=3, dtypes=(torch.bfloat16,))
        if kv.shape[1] != 1 or kv.shape[2] != d:
            raise ValueError(f"kv must have shape [s_kv, 1, {d}] (q's head_dim), got {list(kv.shape)}")
        if kv.shape[0] < 1:
            raise ValueError(f"kv must have s_kv >= 1 tokens, got shape {list(kv.shape)}")
    check_tensor("indices", indices, dim=3, dtypes=(torch.int32,))
    if indices.shape[0] != s_q or indices.shape[1] != 1 or indices.shape[2] < 1:
        raise ValueError(f"indices must have shape [s_q={s_q}, 1, topk>=1], got {list(indices.shape)}")
    _check_topk_length_and_sink(topk_length, (s_q,), "[s_q]", attn_sink, h_q)
    check_same_device("q", q, kv=kv, indices=indices, topk_length=topk_length, attn_sink=attn_sink)


def _check_prefill_fp8_cache(kv, d: int) -> None:
    """kv as the paged FP8 cache of sparse decode (prefill straight from it)."""
    check_tensor("kv", kv, dim=4, dtypes=FP8_CACHE_DTYPES)
    if kv.shape[2] != 1 or kv.shape[3] != FP8_BYTES_PER_TOKEN:
        raise ValueError(
            f"kv as the FP8 cache must have shape [num_blocks, page_block_size, 1, {FP8_BYTES_PER_TOKEN}], "
            f"got {list(kv.shape)}"
        )
    if kv.shape[0] < 1 or kv.shape[1] < 1:
        raise ValueError(f"kv must have num_blocks >= 1 and page_block_size >= 1, got shape {list(kv.shape)}")
    if d != D_QK:
        raise ValueError(f"q must have head_dim {D_QK} with the {FP8_BYTES_PER_TOKEN}-byte FP8 cache as kv "
                         f"(its rows hold 512 latent and 64 RoPE features), got {d}")
