"""FlashMLA's interface with the split plan as tensors, as sgl-kernel's ``sgl_kernel.flash_mla`` serves it (and
FlashMLA's releases before its metadata object), for engines that call it that way::

    from mla_cute.flash_mla_tensors import flash_mla_with_kvcache, get_mla_metadata

``get_mla_metadata`` returns ``(tile_scheduler_metadata, num_splits)`` tensors (``mla_cute.get_mla_decoding_metadata``
under sgl-kernel's argument names); ``flash_mla_with_kvcache`` and ``flash_mla_sparse_fwd`` are mla-cute's, whose
positional order starts as sgl-kernel's (``q, k_cache, block_table, cache_seqlens, head_dim_v,
tile_scheduler_metadata, num_splits, softmax_scale, causal, is_fp8_kvcache, indices``)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .api import flash_mla_sparse_fwd, flash_mla_with_kvcache, get_mla_decoding_metadata

__all__ = ["get_mla_metadata", "flash_mla_with_kvcache", "flash_mla_sparse_fwd"]


def get_mla_metadata(cache_seqlens: torch.Tensor, num_q_tokens_per_head_k: int, num_heads_k: int,
                     num_heads_q: Optional[int] = None, is_fp8_kvcache: bool = False,
                     topk: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``get_mla_decoding_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_heads_q,
    is_fp8_kvcache, topk)``: the plan as ``(tile_scheduler_metadata, num_splits)`` tensors."""
    return get_mla_decoding_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_heads_q, is_fp8_kvcache,
                                     topk)
