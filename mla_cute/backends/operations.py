"""Operation objects: one per call kind, each owning its call's path for both backends: the checks (every rule
stated here once), then the ``reference`` backend's torch code (``reference.py``, the specification) or the
``cute`` backend's kernels (``cute.py``: resolve, compile, launch).  The public functions are thin adapters over
them (``api.flash_mla_sparse_fwd``, ``api.write_kv_cache``, ``distributed.merge_partial_attention``).  Decode's
two (``DenseDecode``, ``SparseDecode``, behind ``api.flash_mla_with_kvcache``) are in ``decode.py``, beside the
metadata object they fill (``metadata.py``).

  SparsePrefill  sparse prefill over bf16 rows or the paged FP8 cache (``kernels/sparse_prefill.py``, or the
                 sparse decode kernel serving each query token whole)
  CacheWrite  rows quantized into their slots of a quantized cache (``kernels/write_cache.py``)
  Merge       R partial attention results merged by log-sum-exp (``kernels/merge.py``)
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import validation as V
from ..backend import select_backend
from ..fp8 import _check_cache
from ..kv_formats import _BYTES_IN, _HALF_IN, BYTES_PER_TOKEN, HEAD_DIM, check_page_layout, format_of
from . import cute, reference


def last_writes(slot_mapping: torch.Tensor) -> torch.Tensor:
    """``slot_mapping`` with each row whose slot a later row names again set to -1 (skipped): of rows aimed at one
    slot only the last, in ``slot_mapping`` order, is written, whole, as a sequential write would leave it.  Torch
    operations on the slots' device (a stable sort; no host read, so a CUDA graph captures them)."""
    if slot_mapping.shape[0] < 2:
        return slot_mapping
    ordered, order = torch.sort(slot_mapping, stable=True)
    repeated = torch.zeros_like(ordered, dtype=torch.bool)  # a later row (in order) names the same slot
    repeated[:-1] = ordered[:-1] == ordered[1:]
    return torch.empty_like(slot_mapping).scatter_(0, order, ordered.masked_fill(repeated, -1))


def into_out(out: Optional[torch.Tensor], result: tuple) -> tuple:
    """A reference result with its first tensor written into the caller's ``out`` (when given), returned as the
    kernels return it."""
    if out is None:
        return result
    out.copy_(result[0])
    return (out, *result[1:])


class SparsePrefill:
    """``flash_mla_sparse_fwd``'s attention: (out, max_logits, lse) in natural units."""

    def __call__(self, q, kv, indices, sm_scale, d_v, attn_sink, topk_length, backend: Optional[str] = None,
                 out: Optional[torch.Tensor] = None) -> tuple:
        V.check_sparse_prefill(q, kv, indices, d_v, attn_sink, topk_length)
        sm_scale = V.check_scale("sm_scale", sm_scale)
        if out is not None:
            V.check_out(out, (*q.shape[:2], d_v), q.dtype, q.device)
        if select_backend(q.device, backend) == "reference":
            return into_out(out, reference.sparse_prefill(q, kv, indices, sm_scale, d_v, attn_sink, topk_length))
        if kv.dim() == 4:  # the paged FP8 cache
            cute.check_sparse_supported(kv, "V32", "kv")
            return cute.sparse_prefill_fp8(q, kv, indices, sm_scale, attn_sink, topk_length, out)
        return cute.sparse_prefill(q, kv, indices, sm_scale, attn_sink, topk_length, out)


class CacheWrite:
    """``write_kv_cache``: rows ``[n, d_qk]`` into slots ``slot_mapping`` of a quantized cache, in place."""

    def __call__(self, k_cache, new_rows, slot_mapping, kv_format=None, backend: Optional[str] = None) -> None:
        fmt = self.check(k_cache, new_rows, slot_mapping, kv_format)
        if select_backend(k_cache.device, backend) == "cute":
            # One launch reading no value on the host: a slot outside the cache is skipped like -1.
            cute.check_cache_layout(k_cache, fmt, "k_cache", "cache writer")
            cute.write_cache(k_cache, new_rows, last_writes(slot_mapping), fmt)
        else:
            reference.check_slots(slot_mapping, k_cache)
            reference.write_cache(k_cache, new_rows, last_writes(slot_mapping), fmt)

    @staticmethod
    def check(k_cache, new_rows, slot_mapping, kv_format) -> str:
        """Shapes, dtypes and devices (no value read); returns the cache's format."""
        fmt = format_of(k_cache, kv_format)
        _check_cache("k_cache", k_cache, BYTES_PER_TOKEN[fmt], _BYTES_IN)
        check_page_layout("k_cache", k_cache, fmt)
        d = HEAD_DIM[fmt]
        if not isinstance(new_rows, torch.Tensor) or new_rows.dim() != 2 or new_rows.shape[1] != d:
            got = list(new_rows.shape) if isinstance(new_rows, torch.Tensor) else type(new_rows).__name__
            raise ValueError(f"new_rows must be a tensor [n, {d}] for a {fmt} cache, got {got}")
        if new_rows.dtype not in _HALF_IN:
            raise TypeError(f"new_rows must have dtype bfloat16, float16 or float32, got {new_rows.dtype}")
        if (not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dim() != 1
                or slot_mapping.dtype not in (torch.int32, torch.int64)):
            raise TypeError("slot_mapping must be an int32 or int64 tensor [n]")
        if slot_mapping.shape[0] != new_rows.shape[0]:
            raise ValueError(f"slot_mapping must have shape [{new_rows.shape[0]}] (new_rows' n), got "
                             f"{list(slot_mapping.shape)}")
        if new_rows.device != k_cache.device or slot_mapping.device != k_cache.device:
            raise ValueError("new_rows and slot_mapping must be on k_cache's device")
        return fmt


class Merge:
    """``merge_partial_attention``: R partial results ``outs`` ``[R, b, s_q, h_q, d_v]`` with their ``lses`` merged."""

    def __call__(self, outs, lses, attn_sink=None, backend: Optional[str] = None):
        self.check(outs, lses, attn_sink)
        if select_backend(outs.device, backend) == "cute":
            return cute.merge(outs, lses, attn_sink)
        return reference.merge(outs, lses, attn_sink)

    @staticmethod
    def check(outs, lses, attn_sink) -> None:
        if not isinstance(outs, torch.Tensor) or outs.dim() != 5 or not outs.dtype.is_floating_point:
            raise ValueError(f"outs must be a float tensor [R, b, s_q, h_q, d_v], got "
                             f"{tuple(outs.shape) if isinstance(outs, torch.Tensor) else type(outs).__name__}")
        r, b, s_q, h_q, _ = outs.shape
        if r == 0:
            raise ValueError("outs must hold at least one part (R >= 1)")
        if not isinstance(lses, torch.Tensor) or tuple(lses.shape) != (r, b, h_q, s_q) or lses.dtype != torch.float32:
            got = (tuple(lses.shape), lses.dtype) if isinstance(lses, torch.Tensor) else type(lses).__name__
            raise ValueError(f"lses must be a float32 tensor [R, b, h_q, s_q] = {[r, b, h_q, s_q]} (outs'), got {got}")
        if lses.device != outs.device:
            raise ValueError(f"lses must be on outs' device ({outs.device}), got {lses.device}")
        if attn_sink is not None and (not isinstance(attn_sink, torch.Tensor) or tuple(attn_sink.shape) != (h_q,)
                                      or attn_sink.dtype != torch.float32 or attn_sink.device != outs.device):
            raise ValueError(f"attn_sink must be a float32 tensor [{h_q}] on outs' device, or None")


SPARSE_PREFILL = SparsePrefill()
CACHE_WRITE = CacheWrite()
MERGE = Merge()
