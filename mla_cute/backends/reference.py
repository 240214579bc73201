"""The reference backend: pure torch, fp32 math, CPU or CUDA.

It is the executable specification every kernel is tested against
(semantics: FlashMLA's contract).  Clarity over speed: one request at a time.

Memory stays O(inputs + outputs): keys are read ``_CHUNK`` at a time in fp32 (a KV head's
query heads share them by broadcasting, never by copying the cache per head), and the
softmax merges the chunks online, so the fp32 scores are at most ``_CHUNK`` keys wide.
"""

from __future__ import annotations

import math
from typing import Callable, Iterator, Optional

import torch

from ..fp8 import D_LATENT
from ..kv_formats import PAGE_BLOCKED, _token_bytes, format_of, gather_rows, page_rows, quantize_kv_cache

_INF = float("inf")
# Keys held in fp32 at a time (per KV head): 4096 x 576 x 4 bytes = 9 MiB.
_CHUNK = 4096

# A source of key chunks: each (keys [B, c, d] fp32, visible: bool broadcastable to [B, m, c], or None for all).
_KeyChunks = Callable[[], Iterator[tuple[torch.Tensor, Optional[torch.Tensor]]]]


def _scores(q: torch.Tensor, keys: torch.Tensor, visible: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    s = (q @ keys.transpose(-1, -2)) * scale  # [B, m, c]
    return s if visible is None else s.masked_fill(~visible, -_INF)


def _attend(q: torch.Tensor, chunks: _KeyChunks, scale: float, dv: int) -> tuple[torch.Tensor, ...]:
    """Softmax attention of q [B, m, d] fp32 over the keys of ``chunks`` (V = a key's first dv values).

    One pass, merging the chunks online: a running max, and the sums of exp(score - max) and of
    exp(score - max) * V, rescaled whenever the max grows.  Returns out [B, m, dv] fp32, lse [B, m]
    (natural log) and max_logit [B, m]; a row with nothing visible gets out 0, lse -inf, max -inf.
    """
    run_max = q.new_full(q.shape[:-1], -_INF)
    denom = torch.zeros_like(run_max)
    acc = q.new_zeros(*q.shape[:-1], dv)
    for keys, visible in chunks():
        s = _scores(q, keys, visible, scale)
        new_max = torch.maximum(run_max, s.amax(dim=-1))
        base = torch.where(new_max == -_INF, 0.0, new_max)  # a row with nothing visible yet adds exp(-inf) = 0
        p = torch.exp(s - base.unsqueeze(-1))
        rescale = torch.exp(run_max - base)
        denom = denom * rescale + p.sum(dim=-1)
        acc = acc * rescale.unsqueeze(-1) + p @ keys[..., :dv]
        run_max = new_max
    empty = denom == 0  # else the largest score adds exp(0) = 1
    out = acc / torch.where(empty, 1.0, denom).unsqueeze(-1)
    return out, torch.where(empty, -_INF, run_max + torch.log(denom)), run_max


def dense_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    head_dim_v: int = D_LATENT,
    skip_outside: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense paged decode. Shapes as in ``mla_cute.flash_mla_with_kvcache``.

    Values no check saw read as the kernels read them (``mla_cute.validation``'s rule for values): each length is
    taken within ``[0, block_table.shape[1] * page_block_size]``, and a used block id outside
    ``[0, num_blocks)`` reads keys and values of zeros (zero scores in the softmax), or with ``skip_outside``
    (the FP8 caches, which the sparse kernel reads over every position) its tokens are skipped."""
    b, s_q, h_q, d = q.shape
    num_blocks, page, h_kv = k_cache.shape[:3]
    covered = block_table.shape[1] * page  # tokens a block-table row covers
    group = h_q // h_kv
    out = q.new_zeros(b, s_q, h_q, head_dim_v)
    lse = torch.full((b, h_q, s_q), _INF, dtype=torch.float32, device=q.device)
    # Row r of a KV head's rows [s_q * group] is query token r // group, head r % group of the head's group.
    token = torch.arange(s_q, device=q.device).repeat_interleave(group).unsqueeze(1)  # [rows, 1]
    for i, n in enumerate(cache_seqlens.long().clamp(0, covered).tolist()):
        rows = q[i].float().reshape(s_q, h_kv, group, d).transpose(0, 1).reshape(h_kv, s_q * group, d)

        def chunks(i=i, n=n):
            for start in range(0, n, _CHUNK):
                pos = torch.arange(start, min(start + _CHUNK, n), device=q.device)
                ids = block_table[i, pos // page].long()
                inside = ((ids >= 0) & (ids < num_blocks)).view(-1, 1, 1)
                keys = k_cache[torch.where(inside.view(-1), ids, 0), pos % page]  # [c, h_kv, d]
                keys = torch.where(inside, keys, 0.0)  # a block outside the cache reads zeros (as the TMA does)
                # Bottom-right aligned: query t sees keys [0, n - (s_q - 1 - t)).
                visible = pos < n - (s_q - 1 - token) if causal and s_q > 1 else None
                if skip_outside:
                    seen = inside.view(1, -1).expand(token.shape[0], -1)
                    visible = seen if visible is None else visible & seen
                yield keys.float().transpose(0, 1), visible

        o, l_i, _ = _attend(rows.contiguous(), chunks, softmax_scale, head_dim_v)  # [h_kv, rows, ...]
        out[i] = o.reshape(h_kv, s_q, group, head_dim_v).transpose(0, 1).reshape(s_q, h_q, head_dim_v)
        lse[i] = l_i.reshape(h_kv, s_q, group).permute(0, 2, 1).reshape(h_q, s_q)
    return out, torch.where(lse == -_INF, _INF, lse)


def _apply_sink(out: torch.Tensor, lse: torch.Tensor, attn_sink: Optional[torch.Tensor]) -> torch.Tensor:
    """out [..., h, dv], lse [..., h] natural log: out *= 1 / (1 + exp(sink - lse))."""
    if attn_sink is None:
        return out
    factor = torch.sigmoid(lse - attn_sink.float())  # = exp(lse) / (exp(lse) + exp(sink))
    factor = torch.where(lse == _INF, 0.0, factor)  # nothing attended: out stays 0
    return out * factor.unsqueeze(-1)


def _sparse_attend(
    q: torch.Tensor,
    rows_of: Callable[[torch.Tensor], torch.Tensor],
    idx: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
    head_dim_v: int,
    attn_sink: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [t, h, d]; rows_of(token indices [m]) -> their cache rows [m, d] fp32; idx/valid [t, topk].

    Returns out [t, h, dv] (q dtype, sink applied), lse [t, h] (+inf where nothing is valid) and
    max_logit [t, h].  Query tokens go a few at a time, so at most about ``_CHUNK`` rows are gathered.
    """
    t, h, _ = q.shape
    topk = idx.shape[1]
    out = q.new_empty(t, h, head_dim_v)
    lse = torch.empty(t, h, dtype=torch.float32, device=q.device)
    max_logit = torch.empty_like(lse)
    step = max(1, _CHUNK // topk)
    for a in range(0, t, step):
        ii, vv = idx[a : a + step], valid[a : a + step]

        def chunks(ii=ii, vv=vv):
            for k in range(0, topk, _CHUNK):  # one chunk unless topk > _CHUNK
                ik, vk = ii[:, k : k + _CHUNK], vv[:, k : k + _CHUNK]
                rows = rows_of(torch.where(vk, ik, 0).flatten()).reshape(*ik.shape, -1)  # [step, c, d]
                yield torch.where(vk.unsqueeze(-1), rows, 0.0), vk.unsqueeze(1)  # invalid rows may hold NaN

        o, l_a, m_a = _attend(q[a : a + step].float(), chunks, scale, head_dim_v)
        l_a = torch.where(l_a == -_INF, _INF, l_a)
        out[a : a + step], lse[a : a + step], max_logit[a : a + step] = _apply_sink(o, l_a, attn_sink), l_a, m_a
    return out, lse, max_logit


def _scope(cache, indices, lengths, s_q):
    """One cache's index set as ``_sparse_attend`` reads it: (idx [b * s_q, topk], valid, tokens in the cache), a
    length a request (of ``s_q`` query tokens)."""
    n = cache.shape[0] * cache.shape[1]
    topk = indices.shape[-1]
    idx = indices.reshape(-1, topk).long()
    valid = (idx >= 0) & (idx < n)
    if lengths is not None:
        pos = torch.arange(topk, device=idx.device).unsqueeze(0)
        valid &= pos < lengths.long().repeat_interleave(s_q).unsqueeze(1)
    return idx, valid, n


def sparse_decode_fp8(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    topk_length: Optional[torch.Tensor] = None,
    attn_sink: Optional[torch.Tensor] = None,
    head_dim_v: int = D_LATENT,
    kv_format: Optional[str] = None,
    extra: Optional[tuple] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse decode over a quantized cache (``mla_cute.kv_formats``; 656 bytes: V3.2's).

    q [b, s_q, h_q, d_qk] bf16 (576 for V32, 512 for the others); k_cache [num_blocks, page, 1, bytes per token];
    indices [b, s_q, topk] int32 (block * page + offset; -1 or anything outside the cache is skipped);
    topk_length [b]; attn_sink [h_q]; ``extra``: (extra_k_cache, its format, extra_indices_in_kvcache,
    extra_topk_length), a second cache whose indices join the same softmax (the union of both sets, a repeated
    token counted each time).  Returns out [b, s_q, h_q, 512] bf16, lse [b, h_q, s_q].
    """
    b, s_q, h_q, d = q.shape
    fmt = kv_format or format_of(k_cache)
    idx, valid, n_main = _scope(k_cache, indices, topk_length, s_q)
    caches = [(k_cache, fmt, 0)]
    if extra is not None:
        extra_cache, extra_fmt, extra_indices, extra_lengths = extra
        e_idx, e_valid, _ = _scope(extra_cache, extra_indices, extra_lengths, s_q)
        idx, valid = torch.cat([idx, e_idx + n_main], 1), torch.cat([valid, e_valid], 1)
        caches.append((extra_cache, extra_fmt, n_main))

    def rows_of(tokens: torch.Tensor) -> torch.Tensor:  # dequantize only the rows read
        rows = torch.empty(tokens.numel(), d, dtype=torch.float32, device=tokens.device)
        for cache, f, base in caches:  # the main cache's tokens, then the extra cache's (offset by n_main)
            mine = (tokens < n_main) if base == 0 else (tokens >= n_main)
            if mine.any():
                rows[mine] = gather_rows(cache, tokens[mine] - base, kv_format=f)
        return rows

    out, lse, _ = _sparse_attend(q.reshape(b * s_q, h_q, d), rows_of, idx, valid, softmax_scale, head_dim_v,
                                 attn_sink)
    return out.reshape(b, s_q, h_q, head_dim_v), lse.reshape(b, s_q, h_q).transpose(1, 2).contiguous()


def sparse_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = D_LATENT,
    attn_sink: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse prefill: q [s_q, h_q, d_qk]; kv [s_kv, 1, d_qk] (valid indices: 0 <= index < s_kv), or the paged
    FP8 cache [num_blocks, page, 1, 656] with d_qk 576 (index block * page + offset, valid below num_blocks *
    page; the prefill over the dequantized rows); indices [s_q, 1, topk].  Returns out [s_q, h_q, d_v] (q dtype),
    max_logits and lse [s_q, h_q] float32 (natural log; -inf / +inf when nothing is valid)."""
    s_q, h_q, d = q.shape
    idx, valid, n = _scope(kv, indices, topk_length, 1)  # kv [s_kv, 1, d]: s_kv tokens
    if kv.dim() == 4:
        rows_of = lambda tokens: gather_rows(kv, tokens, "V32")  # noqa: E731
    else:
        rows = kv.reshape(n, d)
        rows_of = lambda tokens: rows[tokens].float()  # noqa: E731
    out, lse, max_logit = _sparse_attend(q, rows_of, idx, valid, sm_scale, d_v, attn_sink)
    return out, max_logit, lse


# ---------------------------------------------------------------- the cache write
def check_slots(slot_mapping: torch.Tensor, k_cache: torch.Tensor) -> None:
    """The slots' values (read on the host): -1 (skip the row) or a token of the cache."""
    given = slot_mapping[slot_mapping != -1]
    if given.numel() == 0:
        return
    tokens = k_cache.shape[0] * k_cache.shape[1]
    lo, hi = torch.stack([given.min(), given.max()]).tolist()
    if lo < 0:
        raise ValueError(f"slot_mapping must hold -1 (skip the row) or slots >= 0, got {lo}")
    if hi >= tokens:
        raise ValueError(f"slot_mapping must name slots below num_blocks * page_block_size = {tokens}, got {hi}")


def write_cache(k_cache: torch.Tensor, new_rows: torch.Tensor, slot_mapping: torch.Tensor, fmt: str) -> None:
    """Rows into their slots (``slot_mapping``: -1 or distinct tokens of the cache), each row's bytes
    ``quantize_kv_cache``'s (a page-blocked token's data row and scale row where the page's layout puts them)."""
    keep = slot_mapping != -1
    slots, rows = slot_mapping[keep].long(), new_rows[keep]
    if slots.numel() == 0:
        return
    page, d = k_cache.shape[1], new_rows.shape[1]
    blk, off = slots // page, slots % page
    raw = _token_bytes(fmt, rows) if fmt != "V32" else (
        quantize_kv_cache(rows.reshape(-1, 1, 1, d), kv_format=fmt).view(torch.uint8).reshape(rows.shape[0], -1))
    if fmt not in PAGE_BLOCKED:
        k_cache.view(torch.uint8)[blk, off, 0] = raw
        return
    data, scale, _ = PAGE_BLOCKED[fmt]
    pages = page_rows(k_cache, data + scale)
    pages[blk.unsqueeze(1), (data * off).unsqueeze(1) + torch.arange(data, device=slots.device)] = raw[:, :data]
    at = data * page + scale * off
    pages[blk.unsqueeze(1), at.unsqueeze(1) + torch.arange(scale, device=slots.device)] = raw[:, data:]


# ---------------------------------------------------------------- the cross-rank merge
def merge(outs: torch.Tensor, lses: torch.Tensor, attn_sink: Optional[torch.Tensor]):
    """``merge_partial_attention`` in torch: lse = log sum_r exp(lse_r), out = sum_r exp(lse_r - lse) out_r in fp32;
    a part with lse +inf weighs nothing, a row with no part gets out 0 and lse +inf; the sink scales the merged rows
    by 1 / (1 + exp(sink - lse)), lse unchanged."""
    h_q = outs.shape[3]
    parts = torch.where(torch.isposinf(lses), -math.inf, lses)  # an empty part weighs nothing
    top = parts.amax(dim=0)
    empty = torch.isneginf(top)
    top = torch.where(empty, 0.0, top)
    weights = torch.exp(parts - top)  # [R, b, h_q, s_q]; exp(-inf) = 0
    total = weights.sum(dim=0)
    lse = torch.where(empty, math.inf, top + torch.log(torch.where(empty, 1.0, total)))
    scale = (weights / torch.where(empty, 1.0, total)).permute(0, 1, 3, 2).unsqueeze(-1)  # [R, b, s_q, h_q, 1]
    out = (outs.float() * scale).sum(dim=0)
    if attn_sink is not None:
        # The sink's share: 1 / (1 + exp(sink - lse)); +inf sink: 0; -inf: 1; empty rows stay 0.
        keep = torch.sigmoid(torch.where(empty, 0.0, lse) - attn_sink.view(1, h_q, 1))  # [b, h_q, s_q]
        out = out * keep.permute(0, 2, 1).unsqueeze(-1)
    return out.to(outs.dtype), lse
