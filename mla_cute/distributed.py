"""Decode across ranks (context parallelism): each rank holds part of every request's cache, runs the decode on
its part, and the ranks merge their outputs by log-sum-exp.

``merge_partial_attention(outs, lses)`` is the merge of R partial results (one kernel launch on Hopper,
``kernels/merge.py``), as the split-KV combine merges a request's splits: ``lse = log sum_r exp(lse_r)``, ``out = sum_r exp(lse_r - lse) out_r`` in fp32, a part with
lse +inf (nothing attended) contributing nothing, a row with no part out 0 and lse +inf; an attention sink, given
once here, scales the merged rows by ``1 / (1 + exp(sink - lse))`` (lse unchanged), as a whole decode call
applies it.

``context_parallel_decode(...)`` is ``flash_mla_with_kvcache`` on this rank's shard, then one all-gather of
(out, lse) over a ``torch.distributed`` process group and the merge.  ``shard_pages`` splits a paged cache's
requests over the ranks by whole pages, for examples and tests.
"""

from __future__ import annotations

from typing import Optional

import torch

from .backends.operations import MERGE
from .host import without_function_modes


@without_function_modes
def merge_partial_attention(outs: torch.Tensor, lses: torch.Tensor, attn_sink: Optional[torch.Tensor] = None,
                            backend: Optional[str] = None):
    """Merge R partial attention results: ``outs`` ``[R, b, s_q, h_q, d_v]`` (any float dtype), ``lses`` ``[R, b, h_q,
    s_q]`` float32, natural log, +inf where a part attended to nothing; ``attn_sink`` ``[h_q]`` float32 or None.
    Returns out ``[b, s_q, h_q, d_v]`` (outs' dtype) and lse ``[b, h_q, s_q]`` float32.  On the ``cute`` backend (CUDA
    tensors on Hopper; ``backend`` as the decode calls take it) one kernel launch (``kernels/merge.py``: bf16, fp16
    or fp32 outs, d_v a multiple of 256), else torch operations."""
    return MERGE(outs, lses, attn_sink, backend)


def context_parallel_decode(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, *,
                            group=None, attn_sink=None, causal=False, **kwargs):
    """``flash_mla_with_kvcache`` over a cache split across the ranks of ``group`` (a ``torch.distributed`` process
    group; None: the default): every rank passes its own shard (``k_cache``, ``block_table``, ``cache_seqlens``, or
    for sparse decode ``indices`` into its shard) and the same q; each decodes its shard without the sink, the
    ranks all-gather (out, lse) and every rank returns the merged out and lse of the whole cache, with
    ``attn_sink`` applied once.  ``kwargs``: the decode's other arguments (``softmax_scale``, ``indices``,
    ``topk_length``, ``kv_format``, ``backend``, ...).  Works inside a CUDA graph capture with NCCL.  Causal masks
    with s_q > 1 need each token's position in the whole request, which a shard does not know: refused."""
    import torch.distributed as dist

    from .api import flash_mla_with_kvcache

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("context_parallel_decode needs an initialized torch.distributed process group")
    if causal and isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[1] > 1:
        raise NotImplementedError("causal: a shard's causal mask needs its tokens' positions in the whole request; "
                                  "context_parallel_decode takes causal=True only with s_q = 1")
    out, lse = flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                                      causal=causal, **kwargs)
    world = dist.get_world_size(group)
    outs = out.new_empty((world,) + tuple(out.shape))
    lses = lse.new_empty((world,) + tuple(lse.shape))
    if dist.get_backend(group) == "nccl":
        dist.all_gather_into_tensor(outs, out.contiguous(), group=group)
        dist.all_gather_into_tensor(lses, lse.contiguous(), group=group)
    else:
        dist.all_gather(list(outs.unbind(0)), out.contiguous(), group=group)
        dist.all_gather(list(lses.unbind(0)), lse.contiguous(), group=group)
    return merge_partial_attention(outs, lses, attn_sink, kwargs.get("backend"))


def shard_pages(block_table: torch.Tensor, cache_seqlens: torch.Tensor, page_block_size: int, world_size: int,
                rank: int):
    """Rank ``rank``'s shard of a paged cache's requests: each request's pages split into ``world_size`` runs of
    whole pages (the first ranks one page more when they do not divide; a short request's last ranks get
    nothing).  Returns (block_table ``[b, pages]`` int32 of this rank's pages, padded with the request's first
    block, cache_seqlens ``[b]`` int32 of its tokens); the cache and its block ids stay the caller's."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size = {world_size}), got {rank}")
    lengths = cache_seqlens.tolist()
    rows, counts = [], []
    for i, n in enumerate(lengths):
        pages = -(-n // page_block_size)
        share, extra = divmod(pages, world_size)
        first = rank * share + min(rank, extra)
        mine = share + (1 if rank < extra else 0)
        tokens = max(0, min(n - first * page_block_size, mine * page_block_size))
        rows.append(block_table[i, first:first + mine])
        counts.append(tokens)
    width = max(1, max(len(r) for r in rows))
    table = torch.empty(len(rows), width, dtype=torch.int32, device=block_table.device)
    for i, r in enumerate(rows):
        table[i] = block_table[i, 0]
        table[i, : len(r)] = r
    return table, torch.tensor(counts, dtype=torch.int32, device=cache_seqlens.device)
