"""The reference backend: pure torch, fp32 math, CPU or CUDA.

It is the executable specification every kernel is tested against
(semantics: FlashMLA's contract).  Clarity over speed: one request at a time.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..fp8 import D_LATENT, dequantize_kv_cache

_INF = float("inf")


def _softmax_pv(scores: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [B, m, n] (masked = -inf), v [B, n, dv] -> (out [B, m, dv], natural-log lse [B, m]).

    Rows with nothing to attend get out 0 and lse +inf.
    """
    lse = torch.logsumexp(scores, dim=-1)
    empty = lse == -_INF
    probs = torch.exp(scores - torch.where(empty, 0.0, lse).unsqueeze(-1))
    probs = torch.where(empty.unsqueeze(-1), 0.0, probs)
    out = probs @ v
    return out, torch.where(empty, _INF, lse)


def dense_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    head_dim_v: int = D_LATENT,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense paged decode. Shapes as in ``mla_cute.flash_mla_with_kvcache``."""
    b, s_q, h_q, d = q.shape
    page, h_kv = k_cache.shape[1], k_cache.shape[2]
    group = h_q // h_kv
    out = torch.zeros(b, s_q, h_q, head_dim_v, dtype=torch.float32, device=q.device)
    lse = torch.full((b, h_q, s_q), _INF, dtype=torch.float32, device=q.device)
    lens = cache_seqlens.tolist()
    for i in range(b):
        n = int(lens[i])
        if n == 0:
            continue
        blocks = block_table[i, : math.ceil(n / page)].long()
        kv = k_cache.index_select(0, blocks).reshape(-1, h_kv, d)[:n].float()  # [n, h_kv, d]
        kv = kv.repeat_interleave(group, dim=1).transpose(0, 1)  # [h_q, n, d]
        qi = q[i].float().transpose(0, 1)  # [h_q, s_q, d]
        scores = (qi @ kv.transpose(1, 2)) * softmax_scale  # [h_q, s_q, n]
        if causal and s_q > 1:
            # Bottom-right aligned: query t sees keys [0, n - (s_q - 1 - t)).
            t = torch.arange(s_q, device=q.device).unsqueeze(1)
            k = torch.arange(n, device=q.device).unsqueeze(0)
            scores = scores.masked_fill(k >= n - (s_q - 1 - t), -_INF)
        o, l = _softmax_pv(scores, kv[:, :, :head_dim_v])  # o [h_q, s_q, dv]
        out[i] = o.transpose(0, 1)
        lse[i] = l
    return out.to(q.dtype), lse


def _apply_sink(out: torch.Tensor, lse: torch.Tensor, attn_sink: Optional[torch.Tensor]) -> torch.Tensor:
    """out [..., h, dv], lse [..., h] natural log: out *= 1 / (1 + exp(sink - lse))."""
    if attn_sink is None:
        return out
    factor = torch.sigmoid(lse - attn_sink.float())  # = exp(lse) / (exp(lse) + exp(sink))
    factor = torch.where(lse == _INF, 0.0, factor)  # nothing attended: out stays 0
    return out * factor.unsqueeze(-1)


def _sparse_attend(
    q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor, scale: float, head_dim_v: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [t, h, d] fp32, kv [n, d] fp32, idx/valid [t, topk] -> out [t, h, dv], lse [t, h], max_logit [t, h]."""
    safe = torch.where(valid, idx, torch.zeros_like(idx)).long()
    rows = kv.index_select(0, safe.flatten()).reshape(*idx.shape, kv.shape[-1])  # [t, topk, d]
    rows = torch.where(valid.unsqueeze(-1), rows, 0.0)  # invalid rows may hold NaN
    scores = (q @ rows.transpose(1, 2)) * scale  # [t, h, topk]
    scores = scores.masked_fill(~valid.unsqueeze(1), -_INF)
    max_logit = scores.amax(dim=-1)
    out, lse = _softmax_pv(scores, rows[..., :head_dim_v])
    return out, lse, max_logit


def sparse_decode_fp8(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    topk_length: Optional[torch.Tensor] = None,
    attn_sink: Optional[torch.Tensor] = None,
    head_dim_v: int = D_LATENT,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse decode over the 656-byte FP8 cache.

    q [b, s_q, h_q, 576] bf16; k_cache [num_blocks, page, 1, 656]; indices [b, s_q, topk]
    int32 (block * page + offset; -1 or anything outside the cache is skipped);
    topk_length [b]; attn_sink [h_q].  Returns out [b, s_q, h_q, 512] bf16, lse [b, h_q, s_q].
    """
    b, s_q, h_q, d = q.shape
    kv = dequantize_kv_cache(k_cache).reshape(-1, d).float()
    topk = indices.shape[-1]
    idx = indices.reshape(b * s_q, topk).long()
    valid = (idx >= 0) & (idx < kv.shape[0])
    if topk_length is not None:
        pos = torch.arange(topk, device=q.device).unsqueeze(0)
        valid &= pos < topk_length.long().repeat_interleave(s_q).unsqueeze(1)
    out, lse, _ = _sparse_attend(q.reshape(b * s_q, h_q, d).float(), kv, idx, valid, softmax_scale, head_dim_v)
    out = _apply_sink(out, lse, attn_sink)
    return out.reshape(b, s_q, h_q, head_dim_v).to(q.dtype), lse.reshape(b, s_q, h_q).transpose(1, 2).contiguous()


def sparse_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = D_LATENT,
    attn_sink: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse prefill: q [s_q, h_q, 576], kv [s_kv, 1, 576], indices [s_q, 1, topk]
    (valid when 0 <= index < s_kv).  Returns out [s_q, h_q, d_v] (q dtype), max_logits and
    lse [s_q, h_q] float32 (natural log; -inf / +inf when nothing is valid)."""
    s_q, h_q, d = q.shape
    s_kv = kv.shape[0]
    topk = indices.shape[-1]
    idx = indices.reshape(s_q, topk).long()
    valid = (idx >= 0) & (idx < s_kv)
    if topk_length is not None:
        valid &= torch.arange(topk, device=q.device).unsqueeze(0) < topk_length.long().unsqueeze(1)
    out, lse, max_logit = _sparse_attend(q.float(), kv.reshape(s_kv, d).float(), idx, valid, sm_scale, d_v)
    out = _apply_sink(out, lse, attn_sink)
    return out.to(q.dtype), max_logit, lse
