"""Split-KV planner: how the KV blocks of a decode batch are spread over SM parts.

This pure-torch function is the specification of the GPU scheduler kernel
(``mla_cute.kernels.scheduler``): both must produce identical records.

Cost model (FlashMLA's): a request of ``n`` KV blocks costs ``n + fixed_cost``;
every part gets a payload of ``ceil(total / num_parts) + fixed_cost`` and takes
requests greedily in order, splitting the request that does not fit.  A request
of length 0 still counts as one block (its part writes the empty result).

Whole requests (``unsplit_slack`` > 0, ours): a split costs more than its pieces'
fixed costs, since the split kernel writes fp32 partials and the combine kernel
reads them back after the split kernel.  So when the requests can be packed whole,
in order, into the parts with no part costing more than ``payload + unsplit_slack``,
the plan packs them whole at the smallest capacity that fits (found by bisection),
and nothing is split.  With ``unsplit_slack`` = 0 the plan is FlashMLA's.

Even pieces (``even_split_slack`` > 0, ours; tried when no whole plan is taken): FlashMLA's plan
cuts a request wherever a part's payload ends, so most parts hold the end of one request and
the start of the next, at uneven lengths.  The even plan cuts each request that does not fit
a part whole into equal pieces (``ceil(blocks / (capacity - fixed_cost))`` of them), each
alone on its part; requests that fit are packed whole, in order, as above.  So no part holds
a request boundary next to a piece.  It takes the smallest capacity, from FlashMLA's payload
up, at which this fits the parts, if that is at most ``payload + even_split_slack``; else
FlashMLA's plan.  (With no request too long for a part, the even plan is a plan of whole
requests, at FlashMLA's payload or above.)

Fill parts (``fill_parts`` > 0, ours): the last ``fill_parts`` parts run on CTAs slower than the
others (pairs on the SMs a plan of 4-CTA clusters leaves idle), so each takes ``fill_share``
sixteenths of another part's blocks: with weight ``W = 16 * (num_parts - fill_parts) + fill_share
* fill_parts``, a part's blocks are ``c = ceil(16 * total / W)`` and a fill part's
``ceil(c * fill_share / 16)``, each plus ``fixed_cost``, walked as FlashMLA's plan (no whole or even
plan: both slacks are ignored).  With ``fill_share`` 16 it is FlashMLA's plan.

One record per part, 8 x int32 (``RECORD_FIELDS``):
  begin_req, end_req (inclusive), begin_block, end_block (exclusive, in the
  end request), begin_split_idx (split index of begin_req handled by this part),
  is_first_req_split, is_last_req_split, pad.
A part with begin_req > end_req has no work.
``num_splits`` is the prefix sum over requests of their split counts ([b + 1]).

Batch-invariant plans (``invariant_plan``, ours): a request's pieces are a function of its own length only, so
its result is bit-identical whatever batch it is in.  A request of ``t`` tiles is cut into ``m = clamp(ceil(t /
piece_blocks), 1, max_pieces)`` pieces, piece ``k`` the tiles ``[k * t // m, (k + 1) * t // m)``, each alone on
a part of its own; the plan has ``b * pieces_bound`` parts (request ``r``'s piece ``k`` is part ``r *
pieces_bound + k``; parts past a request's pieces are idle).  Torch operations on the lengths' device, no host
read: a CUDA graph captures them and every replay plans the lengths it finds.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch  # imported where used: a kernel build (``mla_cute.kernels.build``'s processes) imports no torch

RECORD_FIELDS = (
    "begin_req",
    "end_req",
    "begin_block",
    "end_block",
    "begin_split_idx",
    "is_first_req_split",
    "is_last_req_split",
    "pad",
)
RECORD_SIZE = len(RECORD_FIELDS)
# ``fill_share`` is in sixteenths of a part's blocks.
FILL_SHARE_ONE = 16


def m_tiles_for(s_q: int, h_q: int, h_kv: int, block_m: int = 64) -> int:
    """A KV head's query rows (s_q positions of its h_q / h_kv heads) in ``block_m``-row M tiles."""
    return math.ceil(s_q * (h_q // h_kv) / block_m)


def num_sm_parts_for(num_sms: int, s_q: int, h_q: int, h_kv: int, block_m: int = 64) -> int:
    """FlashMLA's part count: one CTA per SM, each KV head's query rows in ceil(rows/64) tiles."""
    return max(num_sms // h_kv // m_tiles_for(s_q, h_q, h_kv, block_m), 1)


def sparse_num_sm_parts_for(num_sms: int, s_q: int, h_q: int, heads_per_cta: int = 64) -> int:
    """FlashMLA's part count for sparse decode: one CTA per SM, each query token's heads in 64-head tiles."""
    return max(num_sms // s_q // max(h_q // heads_per_cta, 1), 1)


def split_policy(schedule, rows: int) -> tuple[int, int, int]:
    """A schedule's planner arguments for requests (a KV head's) of ``rows`` query rows: (``fixed_cost``,
    ``unsplit_slack``, ``even_split_slack``) in blocks, the slacks counted per 64-row M tile, so that
    ``plan_splits(lengths, parts, 64, *split_policy(schedule, rows))``."""
    tiles = -(-rows // 64)
    return schedule.split_fixed_cost, schedule.unsplit_slack * tiles, schedule.even_split_slack * tiles


def scheduler_lengths(kind: str, lens, max_len: int, extra=None, extra_max: int = 0) -> torch.Tensor:
    """The lengths the GPU scheduler plans over (``SchedulerConfig.lengths`` ``kind``, ``kernels/scheduler.py``),
    from the tensors it reads, on the host: "dense" ``lens`` within [0, max_len]; "topk" within [1, max_len];
    "two_caches" the main tokens (within [0, max_len]) in whole 64-token tiles plus ``extra`` within [0,
    extra_max], at least 1."""
    return served_lengths(kind, lens.detach().cpu(), max_len, None if extra is None else extra.detach().cpu(),
                          extra_max)


def served_lengths(kind: str, lens, max_len: int, extra=None, extra_max: int = 0) -> torch.Tensor:
    """``scheduler_lengths`` on the lengths' own device (int64): torch operations, no host read."""
    lens = lens.long()
    if kind == "dense":
        return lens.clamp(0, max_len)
    if kind == "topk":
        return lens.clamp(1, max_len)
    if kind != "two_caches":
        raise ValueError(f"kind must be 'dense', 'topk' or 'two_caches', got {kind!r}")
    main = (lens.clamp(0, max_len) + 63) // 64 * 64
    return (main + extra.long().clamp(0, extra_max)).clamp(min=1)


def sparse_lengths(topk: int, topk_length, b: int) -> torch.Tensor:
    """Per-request work of sparse decode in tokens: ``topk_length`` (or ``topk``), at least 1 so every
    request gets a part that writes its (possibly empty) result, as FlashMLA's scheduler does."""
    import torch

    lens = torch.full((b,), topk, dtype=torch.int64) if topk_length is None else topk_length.detach().cpu().long()
    return lens.clamp(1, topk)


def invariant_pieces(tiles: int, piece_blocks: int, max_pieces: int) -> int:
    """The pieces of a request of ``tiles`` 64-token tiles in a batch-invariant plan (``invariant_plan``)."""
    return min(max(-(-tiles // piece_blocks), 1), max_pieces)


def call_invariant_plan(schedule, kind: str, lens, max_len: int, extra=None, extra_max: int = 0
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """A call's batch-invariant plan (``invariant_plan``): ``lens`` (and ``extra``) read as the kernel serves them
    (``served_lengths`` ``kind``), the pieces bound the longest request the shapes allow (``max_len`` tokens, over
    two caches its whole tiles and ``extra_max``), the piece size and count the ``schedule``'s.  The partials it
    needs: one a record."""
    most = max_len if kind != "two_caches" else -(-max_len // 64) * 64 + extra_max
    blocks, pieces = schedule.invariant_piece_blocks, schedule.invariant_max_pieces
    return invariant_plan(served_lengths(kind, lens, max_len, extra, extra_max), blocks, pieces,
                          invariant_pieces(-(-most // 64), blocks, pieces))


def invariant_plan(lengths: torch.Tensor, piece_blocks: int, max_pieces: int, pieces_bound: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch-invariant plan (module docstring) over ``lengths``, int ``[b]`` tokens as the kernel serves them
    (``served_lengths``): records int32 ``[b * pieces_bound, 8]`` and ``num_splits`` int32 ``[b + 1]`` on the
    lengths' device.  ``pieces_bound`` (at most ``max_pieces``) must be at least the pieces of every request
    the call can hold (a shape fact: its longest request's)."""
    import torch

    if not 1 <= pieces_bound <= max_pieces or piece_blocks < 1:
        raise ValueError(f"invariant_plan needs 1 <= pieces_bound ({pieces_bound}) <= max_pieces ({max_pieces}) "
                         f"and piece_blocks ({piece_blocks}) >= 1")
    b, device = lengths.shape[0], lengths.device
    tiles = (lengths.long().clamp(min=0) + 63) // 64
    pieces = ((tiles + piece_blocks - 1) // piece_blocks).clamp(1, pieces_bound)[:, None]  # [b, 1]
    k = torch.arange(pieces_bound, device=device)[None, :]  # [1, bound]
    used = k < pieces
    req = torch.arange(b, device=device)[:, None].expand(b, pieces_bound)
    split = (pieces > 1) & used
    zero = torch.zeros_like(used, dtype=torch.long)
    records = torch.stack([
        torch.where(used, req, b), torch.where(used, req, b - 1),  # an idle part: begin_req > end_req
        torch.where(used, k * tiles[:, None] // pieces, 0), torch.where(used, (k + 1) * tiles[:, None] // pieces, 0),
        torch.where(used, k, 0), split.long(), split.long(), zero,
    ], dim=-1)
    num_splits = torch.zeros(b + 1, dtype=torch.long, device=device)
    num_splits[1:] = torch.cumsum(pieces[:, 0], 0)
    return records.view(b * pieces_bound, RECORD_SIZE).int(), num_splits.int()


# A record's end block that never cuts its last request (``whole_token_plan``).
WHOLE_REQUEST_END = 1 << 30


def whole_token_plan(num_tokens: int, num_parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Records and split counts (``plan_splits``' format) of a plan that serves every request whole: part p
    takes the contiguous share ``[p * n // num_parts, (p + 1) * n // num_parts)`` of the ``n = num_tokens``
    requests (idle when the share is empty), each request one split.  Prefill from the FP8 cache serves a
    query token as a request this way: no split, so no combine, and each token's max_logits comes from the
    part that wrote its rows.  The plan needs no lengths (a shape fact, the same on every call)."""
    if num_tokens < 1 or num_parts < 1:
        raise ValueError(f"whole_token_plan needs num_tokens and num_parts >= 1, got {num_tokens}, {num_parts}")
    import torch

    records = torch.zeros(num_parts, RECORD_SIZE, dtype=torch.int32)
    part = torch.arange(num_parts, dtype=torch.int64)
    records[:, 0] = part * num_tokens // num_parts
    records[:, 1] = (part + 1) * num_tokens // num_parts - 1
    records[:, 3] = WHOLE_REQUEST_END
    return records, torch.arange(num_tokens + 1, dtype=torch.int32)


def plan_splits(
    seqlens: torch.Tensor,
    num_parts: int,
    block_n: int = 64,
    fixed_cost: int = 5,
    unsplit_slack: int = 0,
    even_split_slack: int = 0,
    fill_parts: int = 0,
    fill_share: int = FILL_SHARE_ONE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plan the split-KV work.

    Args:
        seqlens: int tensor ``[b]``, KV length of each request (>= 0).
        num_parts: number of SM parts (CTAs per (KV head, M tile)), >= 1.
        block_n: tokens per KV block.
        fixed_cost: fixed cost of a request (or of each piece of a split request), in blocks.
        unsplit_slack: how many blocks more than the payload a part may cost in a plan that splits
            nothing (see the module docstring); 0: FlashMLA's plan.
        even_split_slack: how many blocks more than the payload a part may cost in a plan of even pieces
            (see the module docstring); 0: not tried.
        fill_parts: the last ``fill_parts`` parts (fewer than ``num_parts``) run on slower CTAs (see the module
            docstring): each takes ``fill_share`` sixteenths (1 to 16) of another part's blocks; both slacks
            are then ignored.

    Returns:
        (records int32 ``[num_parts, 8]``, num_splits int32 ``[b + 1]``), on the CPU.
    """
    lens = _host_lengths(seqlens, num_parts, block_n, fixed_cost, unsplit_slack, even_split_slack)
    _check_fill(num_parts, fill_parts, fill_share)
    records, num_splits, _ = _walk(lens, num_parts, block_n, fixed_cost, unsplit_slack, even_split_slack,
                                   fill_parts, fill_share)
    import torch

    return torch.tensor(records, dtype=torch.int32).view(num_parts, RECORD_SIZE), torch.tensor(num_splits, dtype=torch.int32)


def plan_has_split(seqlens: torch.Tensor, num_parts: int, block_n: int = 64, fixed_cost: int = 5,
                   unsplit_slack: int = 0, even_split_slack: int = 0, fill_parts: int = 0,
                   fill_share: int = FILL_SHARE_ONE) -> bool:
    """Whether ``plan_splits`` (hence the scheduler kernel) splits a request over parts, so a combine must
    merge partials.  Without a split every request's output comes from one part, which writes it."""
    return plan_facts(seqlens, num_parts, block_n, fixed_cost, unsplit_slack, even_split_slack, fill_parts,
                      fill_share)[0]


def plan_facts(seqlens: torch.Tensor, num_parts: int, block_n: int = 64, fixed_cost: int = 5,
               unsplit_slack: int = 0, even_split_slack: int = 0, fill_parts: int = 0,
               fill_share: int = FILL_SHARE_ONE) -> tuple[bool, int]:
    """(``plan_has_split``, the most KV blocks any one part of ``plan_splits``'s plan reads), from one walk."""
    lens = _host_lengths(seqlens, num_parts, block_n, fixed_cost, unsplit_slack, even_split_slack)
    _check_fill(num_parts, fill_parts, fill_share)
    _, num_splits, busiest = _walk(lens, num_parts, block_n, fixed_cost, unsplit_slack, even_split_slack,
                                   fill_parts, fill_share)
    return any(b - a > 1 for a, b in zip(num_splits, num_splits[1:])), busiest


def _host_lengths(seqlens: torch.Tensor, num_parts: int, block_n: int, fixed_cost: int, unsplit_slack: int,
                  even_split_slack: int) -> list:
    """The lengths as Python ints, after checking the planner's arguments."""
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    if block_n < 1:
        raise ValueError(f"block_n must be >= 1, got {block_n}")
    if fixed_cost < 0:
        raise ValueError(f"fixed_cost must be >= 0, got {fixed_cost}")
    if unsplit_slack < 0:
        raise ValueError(f"unsplit_slack must be >= 0, got {unsplit_slack}")
    if even_split_slack < 0:
        raise ValueError(f"even_split_slack must be >= 0, got {even_split_slack}")
    import torch

    lens = [int(x) for x in seqlens.detach().to("cpu", torch.int64).tolist()]
    if not lens:
        raise ValueError("seqlens must hold at least one request")
    if min(lens) < 0:
        raise ValueError(f"seqlens must be >= 0, got min {min(lens)}")
    return lens


def _check_fill(num_parts: int, fill_parts: int, fill_share: int) -> None:
    if type(fill_parts) is not int or not 0 <= fill_parts < num_parts:
        raise ValueError(f"fill_parts must be an int from 0 to num_parts - 1 ({num_parts - 1}), got {fill_parts!r}")
    if type(fill_share) is not int or not 1 <= fill_share <= FILL_SHARE_ONE:
        raise ValueError(f"fill_share must be an int from 1 to {FILL_SHARE_ONE}, got {fill_share!r}")


def _num_blocks(lens: list, block_n: int) -> list:
    """Blocks per request; length 0 still has block 0 (its part writes the empty result)."""
    return [max(n - 1, 0) // block_n + 1 for n in lens]


def _parts_whole(costs: list, capacity: int) -> int:
    """How many parts the requests take when packed whole, in order, at most ``capacity`` a part
    (each cost at most ``capacity``)."""
    parts, fill = 1, 0
    for c in costs:
        if fill + c > capacity:
            parts, fill = parts + 1, c
        else:
            fill += c
    return parts


def _whole_capacity(costs: list, num_parts: int, payload: int, unsplit_slack: int):
    """The smallest capacity that packs every request whole into ``num_parts`` parts, if it is at most
    ``payload + unsplit_slack``; else None (the plan splits)."""
    lo = max(max(costs), -(-sum(costs) // num_parts))
    hi = payload + unsplit_slack
    if lo > hi or _parts_whole(costs, hi) > num_parts:
        return None
    return _smallest(lo, hi, lambda capacity: _parts_whole(costs, capacity) <= num_parts)


def _parts_even(num_blocks: list, capacity: int, fixed_cost: int) -> int:
    """How many parts the even plan at ``capacity`` (> ``fixed_cost``) takes: requests that fit packed whole,
    in order; each other one cut into equal pieces, one part each.  (At a capacity no request exceeds, the
    count of ``_parts_whole``; both stay, as the scheduler kernel's two loops they specify.)"""
    parts, fill = 0, 0
    for nb in num_blocks:
        c = nb + fixed_cost
        if c <= capacity:
            if fill + c > capacity:
                parts, fill = parts + 1, c
            else:
                fill += c
        else:
            parts += (fill > 0) + -(-nb // (capacity - fixed_cost))
            fill = 0
    return parts + (fill > 0)


def _even_capacity(num_blocks: list, num_parts: int, fixed_cost: int, payload: int, even_split_slack: int):
    """The smallest capacity from ``payload`` to ``payload + even_split_slack`` at which the even plan fits
    ``num_parts`` parts; None if none does."""
    hi = payload + even_split_slack
    if _parts_even(num_blocks, hi, fixed_cost) > num_parts:
        return None
    return _smallest(payload, hi, lambda capacity: _parts_even(num_blocks, capacity, fixed_cost) <= num_parts)


def _smallest(lo: int, hi: int, fits) -> int:
    """Bisection: the smallest capacity in [lo, hi] that ``fits`` (``hi`` does)."""
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _walk(lens: list, num_parts: int, block_n: int, fixed_cost: int, unsplit_slack: int,
          even_split_slack: int, fill_parts: int = 0, fill_share: int = FILL_SHARE_ONE) -> tuple[list, list, int]:
    """The greedy walk: (one record per part as a list, the prefix sums of the split counts, the most blocks
    one part reads).  Plain Python lists: the runtime runs it on a plan's first call, and a tensor per part
    cost about 10 us each."""
    b = len(lens)
    num_blocks = _num_blocks(lens, block_n)
    last_block = [nb - 1 for nb in num_blocks]
    costs = [nb + fixed_cost for nb in num_blocks]
    payload = -(-sum(costs) // num_parts) + fixed_cost
    fill_payload = payload
    if fill_parts:
        # The last ``fill_parts`` parts run on slower CTAs: each gets ``fill_share`` / 16 of a part's blocks.
        weight = FILL_SHARE_ONE * (num_parts - fill_parts) + fill_share * fill_parts
        blocks = -(-sum(costs) * FILL_SHARE_ONE // weight)
        payload = blocks + fixed_cost
        fill_payload = -(-blocks * fill_share // FILL_SHARE_ONE) + fixed_cost
    whole = even = None
    if unsplit_slack > 0 and not fill_parts:
        whole = _whole_capacity(costs, num_parts, payload, unsplit_slack)
    if whole is None and even_split_slack > 0 and not fill_parts:
        even = _even_capacity(num_blocks, num_parts, fixed_cost, payload, even_split_slack)
    # In both plans a request that does not fit the rest of a part starts the next one; only the even plan
    # cuts requests (those that fit no part whole), into ``pieces[r]`` equal pieces.
    pieces = [1] * b
    if whole is not None:
        payload = whole
    elif even is not None:
        payload = even
        pieces = [-(-nb // (even - fixed_cost)) if nb + fixed_cost > even else 1 for nb in num_blocks]

    records = []
    num_splits = [0] * (b + 1)
    req, block, split_idx, cum, busiest = 0, 0, 0, 0, 0
    for part in range(num_parts):
        begin_req, begin_block, begin_split = req, block, split_idx
        first_split = block != 0
        capacity = payload if part < num_parts - fill_parts else fill_payload
        remain = capacity
        while req < b:
            left = num_blocks[req] - block
            if pieces[req] > 1:  # an even piece: alone on a part
                if remain == payload:
                    end = (split_idx + 1) * num_blocks[req] // pieces[req]
                    remain -= end - block + fixed_cost
                    if end == num_blocks[req]:
                        cum += split_idx + 1
                        num_splits[req + 1] = cum
                        req, block, split_idx = req + 1, 0, 0
                    else:
                        block, split_idx = end, split_idx + 1
                break
            if remain >= left + fixed_cost:
                cum += split_idx + 1
                num_splits[req + 1] = cum
                remain -= left + fixed_cost
                req, block, split_idx = req + 1, 0, 0
            else:
                if whole is None and even is None and remain - fixed_cost > 0:
                    block += remain - fixed_cost
                    split_idx += 1
                    remain = 0  # the piece takes the rest of the payload: its blocks and its fixed cost
                break
        taken = (req - begin_req) + (block > 0)
        busiest = max(busiest, capacity - remain - fixed_cost * taken)
        if block > 0:
            end_req, end_block = req, block
        else:
            end_req = req - 1
            end_block = 0 if lens[end_req] == 0 else last_block[end_req] + 1
        last_split = end_block != last_block[end_req] + 1 and lens[end_req] != 0
        if begin_req == end_req:
            first_split = last_split = first_split or last_split
        records.append([begin_req, end_req, begin_block, end_block, begin_split, int(first_split), int(last_split), 0])
    if not (req == b and block == 0 and split_idx == 0):
        raise AssertionError("planner did not place every block (internal error)")
    return records, num_splits, busiest
