"""Building FlashMLA-style test inputs and comparing against the reference (shared by GPU tests and benchmarks)."""

from __future__ import annotations

import math

import torch

SENTINEL_BLOCK = 2147480000  # FlashMLA's value for unused block-table entries


def make_dense_case(b, s_q, s_k, h_q, h_kv, *, varlen=False, page=64, dtype=torch.bfloat16, zero_half=False,
                    device="cuda", gen=None, lengths=None, scale=0.1, d_qk=576):
    """Random paged decode inputs as FlashMLA's tests make them (normal / 10, clamped to [-1, 1]), with
    its poison: NaN past each length, sentinel ids in unused block-table entries.  ``d_qk``: q's and the
    cache's head_dim (576, or 512 without a RoPE part)."""
    gen = gen or torch.Generator(device="cpu").manual_seed(0)
    if lengths is None:
        if varlen:
            lens = torch.normal(float(s_k), s_k / 2, (b,), generator=gen).clamp_min(s_q).round().long()
        else:
            lens = torch.full((b,), s_k, dtype=torch.long)
        if zero_half:
            lens[torch.randperm(b, generator=gen)[: b // 2]] = 0
    else:
        lens = torch.as_tensor(lengths, dtype=torch.long)
    max_blocks = max(1, math.ceil(int(lens.max()) / page))
    num_blocks = b * max_blocks + 3
    perm = torch.randperm(num_blocks, generator=gen)[: b * max_blocks].reshape(b, max_blocks).to(torch.int32)
    block_table = torch.full((b, max_blocks), SENTINEL_BLOCK, dtype=torch.int32)
    for i in range(b):
        used = math.ceil(int(lens[i]) / page)
        block_table[i, :used] = perm[i, :used]
    poison = torch.ones(num_blocks * page, dtype=torch.bool)
    for i in range(b):
        for t in range(0, int(lens[i]), page):
            blk = int(block_table[i, t // page])
            n = min(page, int(lens[i]) - t)
            poison[blk * page: blk * page + n] = False
    # The values are drawn on the target device (seeded from ``gen``): drawn on the host, the
    # largest grid cases (a 10 GB cache) took most of a GPU test run.
    dev_gen = torch.Generator(device=device).manual_seed(int(torch.randint(2**62, (1,), generator=gen)))
    cache = (torch.randn(num_blocks, page, h_kv, d_qk, generator=dev_gen, device=device) * scale).clamp(-1, 1)
    cache = cache.to(dtype)
    cache.view(num_blocks * page, h_kv, d_qk)[poison.to(device)] = float("nan")
    q = (torch.randn(b, s_q, h_q, d_qk, generator=dev_gen, device=device) * scale).clamp(-1, 1).to(dtype)
    return dict(
        q=q, k_cache=cache, block_table=block_table.to(device), cache_seqlens=lens.to(torch.int32).to(device),
    )


def cos_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    denom = (a * a).sum() + (b * b).sum()
    if denom == 0:
        return 0.0
    return float(1 - 2 * (a * b).sum() / denom)


def assert_close_flashmla(name, got, ref, abs_tol, rel_tol, cos_tol=None):
    """FlashMLA's check: same inf/NaN positions, each element within abs OR rel, small cosine diff."""
    got, ref = got.float(), ref.float()
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert torch.equal(torch.isnan(got), torch.isnan(ref)), f"{name}: NaN positions differ"
    assert torch.equal(torch.isposinf(got), torch.isposinf(ref)), f"{name}: +inf positions differ"
    assert torch.equal(torch.isneginf(got), torch.isneginf(ref)), f"{name}: -inf positions differ"
    fin = torch.isfinite(ref)
    g, r = got[fin], ref[fin]
    err = (g - r).abs()
    bad = (err > abs_tol) & (err > rel_tol * r.abs())
    if bad.any():
        i = int(bad.nonzero()[0])
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {g.numel()} elements out of tolerance; first: got {float(g[i])}, "
            f"ref {float(r[i])} (abs {abs_tol}, rel {rel_tol}); max abs err {float(err.max())}"
        )
    if cos_tol is not None:
        cd = cos_diff(g, r)
        assert cd < cos_tol, f"{name}: cosine diff {cd} >= {cos_tol}"


def poison_allocator(nbytes: int = 1 << 28) -> None:
    """Fill freed cached device memory with NaN, so outputs a kernel fails to write show up as NaN."""
    junk = torch.full((nbytes // 4,), float("nan"), dtype=torch.float32, device="cuda")
    del junk


def refill_cache(k_cache, block_table, lens, gen=None, scale=0.1):
    """New random cache contents, NaN in every row past each request's length (in place)."""
    gen = gen or torch.Generator().manual_seed(1)
    nb, page, h_kv, d = k_cache.shape
    fresh = (torch.randn(nb, page, h_kv, d, generator=gen) * scale).clamp(-1, 1)
    flat = fresh.view(nb * page, h_kv, d)
    keep = torch.zeros(nb * page, dtype=torch.bool)
    bt = block_table.cpu()
    for i, n in enumerate(lens.tolist()):
        for t in range(0, n, page):
            blk = int(bt[i, t // page])
            keep[blk * page: blk * page + min(page, n - t)] = True
    flat[~keep] = float("nan")
    k_cache.copy_(fresh.to(k_cache.dtype))


def magnitude_abs_tol(ref_out, base: float) -> float:
    """Absolute tolerance for outputs in the hundreds, where one bf16 step is 1 or 2: 2^-6 of the
    largest output (each element is then within it or within the relative tolerance)."""
    return max(base, float(ref_out.float().abs().max()) * 2**-6)


def make_sparse_case(b, s_q, h_q, s_k, topk, page, *, invalid_frac=0.1, out_of_range=False, topk_length=None,
                     attn_sink=None, seed=0, growing=False, kv_scale=1.0, q_scale=1.0, kv_format="V32", device="cuda"):
    """A sparse FP8 decode case as FlashMLA's tests build it: each request owns ceil(s_k / page) randomly
    placed blocks of a 656-byte FP8 cache; each query picks topk of its request's s_k tokens (distinct
    while topk <= s_k, -1 beyond that), a fraction set to -1; ``out_of_range`` replaces another
    fraction with values outside the cache (never read).  ``growing``: cache row r scaled by
    2^(10 r / rows), q by 10, and each query's indices in ascending order, so its scores grow along
    the topk order by hundreds in log2 units.  ``kv_scale`` / ``q_scale`` multiply the cache before its
    quantization and q (to reach the ends of a kernel's exact ranges).  ``kv_format``: the cache's format
    (``mla_cute.kv_formats``; q's head dimension is the format's), given to the call unless V32."""
    from mla_cute.kv_formats import HEAD_DIM, quantize_kv_cache

    d = HEAD_DIM[kv_format]
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = math.ceil(s_k / page)
    nb = b * blocks_per_req + 1
    cache16 = (torch.randn(nb, page, 1, d, generator=gen) * 0.1).clamp(-1, 1)
    if growing:
        cache16 = cache16 * torch.pow(2.0, torch.linspace(0, 10, nb * page)).view(nb, page, 1, 1)
    cache16 = (cache16 * kv_scale).to(torch.bfloat16)
    # On the device: V4's pages are padded to 576-byte multiples, a layout a copy to the device would not keep.
    k_cache = quantize_kv_cache(cache16 if kv_format == "V32" else cache16.to(device), kv_format)
    perm = torch.randperm(nb, generator=gen)[: b * blocks_per_req].view(b, blocks_per_req)
    idx = torch.full((b, s_q, topk), -1, dtype=torch.int64)
    n = min(topk, s_k)
    for i in range(b):
        for s in range(s_q):
            pos = torch.randperm(s_k, generator=gen)[:n]
            idx[i, s, :n] = perm[i, pos // page] * page + pos % page
    drop = torch.rand(idx.shape, generator=gen) < invalid_frac
    idx[drop] = -1
    if out_of_range:
        bad = torch.rand(idx.shape, generator=gen) < 0.2
        high = torch.randint(nb * page, 2**31 - 1, idx.shape, generator=gen)
        low = torch.randint(-(2**31), -1, idx.shape, generator=gen)
        idx[bad] = torch.where(torch.rand(idx.shape, generator=gen) < 0.5, high, low)[bad]
    q = (torch.randn(b, s_q, h_q, d, generator=gen) * 0.1).clamp(-1, 1)
    q = q * q_scale
    if growing:
        q = q * 10
        idx = idx.sort(dim=-1).values
    case = dict(q=q.to(torch.bfloat16).to(device), k_cache=k_cache.to(device), indices=idx.to(torch.int32).to(device))
    if kv_format != "V32":
        case["kv_format"] = kv_format
    if topk_length is not None:
        case["topk_length"] = torch.as_tensor(topk_length, dtype=torch.int32).to(device)
    if attn_sink is not None:
        case["attn_sink"] = torch.as_tensor(attn_sink, dtype=torch.float32).to(device)
    return case


def make_prefill_case(s_q, s_kv, topk, h_q, d_qk=576, *, all_invalid=False, invalid_frac=0.1, with_sink=False,
                      with_topk_length=False, seed=0, device="cuda"):
    """A sparse prefill case as FlashMLA's tests build it: q and kv normal bf16; each query picks min(topk, s_kv)
    distinct rows of kv (-1 beyond that, so with topk > s_kv whole 64-index blocks hold nothing valid), a
    fraction replaced by invalid values (-1, negative, s_kv and past it); ``all_invalid``: every index
    invalid.  ``with_topk_length``: lengths drawn from [0, topk] (the first query's 0, the last's topk + 5);
    ``with_sink``: sinks normal, the first +inf and the second -inf."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(s_q, h_q, d_qk, generator=gen, device=device).to(torch.bfloat16)
    kv = torch.randn(s_kv, 1, d_qk, generator=gen, device=device).to(torch.bfloat16)
    n = min(topk, s_kv)
    idx = torch.full((s_q, topk), -1, dtype=torch.int64, device=device)
    idx[:, :n] = torch.rand(s_q, s_kv, generator=gen, device=device).argsort(dim=1)[:, :n]
    pool = torch.tensor([-1, -7, -(2**31), s_kv, s_kv + 3, 2**31 - 1], device=device)
    bad = torch.rand(s_q, topk, generator=gen, device=device) < (1.0 if all_invalid else invalid_frac)
    pick = torch.randint(len(pool), (s_q, topk), generator=gen, device=device)
    idx = torch.where(bad, pool[pick], idx)
    case = dict(q=q, kv=kv, indices=idx.to(torch.int32).view(s_q, 1, topk), sm_scale=d_qk ** -0.5)
    if with_topk_length:
        lens = torch.randint(0, topk + 1, (s_q,), generator=gen, device=device)
        lens[0] = 0
        lens[-1] = topk + 5
        case["topk_length"] = lens.to(torch.int32)
    if with_sink:
        sink = torch.randn(h_q, generator=gen, device=device)
        sink[0] = float("inf")
        if h_q > 1:
            sink[1] = -float("inf")
        case["attn_sink"] = sink
    return case


def make_prefill_fp8_case(s_q, s_kv, topk, h_q, *, page=64, all_invalid=False, invalid_frac=0.1, with_sink=False,
                          with_topk_length=False, seed=0, device="cuda"):
    """A sparse prefill case over the paged FP8 cache: ``make_prefill_case``'s q, indices, sink and lengths (d_qk
    576), its kv quantized into a 656-byte cache whose ceil(s_kv / page) blocks are randomly placed among one
    more, an index naming block * page + offset; invalid indices are -1, negative, or at and past the cache's
    end (num_blocks * page).  Unused rows of the cache hold NaN bytes (never read)."""
    from mla_cute.fp8 import quantize_kv_cache

    case = make_prefill_case(s_q, s_kv, topk, h_q, 576, all_invalid=all_invalid, invalid_frac=invalid_frac,
                             with_sink=with_sink, with_topk_length=with_topk_length, seed=seed, device=device)
    gen = torch.Generator().manual_seed(seed + 1)
    blocks = math.ceil(s_kv / page)
    nb = blocks + 1
    perm = torch.randperm(nb, generator=gen)[:blocks].to(device)
    rows = torch.full((nb * page, 1, 576), float("nan"), dtype=torch.bfloat16, device=device)
    tok = torch.arange(s_kv, device=device)
    where = perm[tok // page] * page + tok % page
    rows[where] = case.pop("kv")
    k_cache = quantize_kv_cache(rows.view(nb, page, 1, 576).cpu()).to(device)
    idx = case["indices"].long()
    valid = (idx >= 0) & (idx < s_kv)
    mapped = where[idx.clamp(0, s_kv - 1)]
    end = nb * page
    # The bf16 case's out-of-range values (s_kv and past it) move past the cache's end.
    high = torch.where(idx >= s_kv, end + (idx - s_kv).clamp(max=2**31 - 1 - end), idx)
    case["indices"] = torch.where(valid, mapped, high).to(torch.int32)
    case["kv"] = k_cache
    return case


# Sparse prefill tolerances (``test_sparse_prefill_gpu``'s docstring says why): out by the cosine rule and within rel
# 3.01/128 or abs max(8e-4, 2^-7 of the largest output); lse and max_logits within 1e-5 relative or absolute.
PREFILL_OUT_ABS, PREFILL_OUT_REL, PREFILL_OUT_COS = 8e-4, 3.01 / 128, 1e-5
PREFILL_STAT_ABS, PREFILL_STAT_REL = 1e-5, 1e-5


def check_prefill(case, *, sample=None):
    """The cute prefill against the reference on ``case`` (outputs poisoned first); ``sample``: compare these query
    tokens only (a long prompt).  Returns the cute call's (sampled) out, max_logits, lse."""
    import mla_cute

    poison_allocator()
    out, max_logits, lse = mla_cute.flash_mla_sparse_fwd(**case, backend="cute")
    torch.cuda.synchronize()
    ref_case = dict(case)
    if sample is not None:
        ref_case["q"], ref_case["indices"] = case["q"][sample], case["indices"][sample]
        if "topk_length" in case:
            ref_case["topk_length"] = case["topk_length"][sample]
        out, max_logits, lse = out[sample], max_logits[sample], lse[sample]
    ref_out, ref_max, ref_lse = mla_cute.flash_mla_sparse_fwd(**ref_case, backend="reference")
    assert out.dtype == torch.bfloat16 and out.shape == ref_out.shape
    assert max_logits.shape == lse.shape == ref_lse.shape
    out_abs = max(PREFILL_OUT_ABS, 2**-7 * float(ref_out.float().abs().max()))
    assert_close_flashmla("out", out, ref_out, out_abs, PREFILL_OUT_REL, PREFILL_OUT_COS)
    assert_close_flashmla("lse", lse, ref_lse, PREFILL_STAT_ABS, PREFILL_STAT_REL)
    assert_close_flashmla("max_logits", max_logits, ref_max, PREFILL_STAT_ABS, PREFILL_STAT_REL)
    return out, max_logits, lse


def replayed_in_graph(fn):
    """``fn()``'s outputs from a CUDA graph captured under ``torch.inference_mode()`` and replayed once."""
    with torch.inference_mode():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = fn()
        graph.replay()
        torch.cuda.synchronize()
    return got
