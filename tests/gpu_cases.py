"""Building FlashMLA-style test inputs and comparing against the reference (shared by GPU tests and benchmarks)."""

from __future__ import annotations

import math

import torch

SENTINEL_BLOCK = 2147480000  # FlashMLA's value for unused block-table entries


def make_dense_case(b, s_q, s_k, h_q, h_kv, *, varlen=False, page=64, dtype=torch.bfloat16, zero_half=False,
                    device="cuda", gen=None, lengths=None, scale=0.1):
    """Random paged decode inputs as FlashMLA's tests make them (normal / 10, clamped to [-1, 1]), with
    its poison: NaN past each length, sentinel ids in unused block-table entries."""
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
    cache = (torch.randn(num_blocks, page, h_kv, 576, generator=gen) * scale).clamp(-1, 1).to(dtype)
    flat = cache.view(num_blocks * page, h_kv, 576)
    poison = torch.ones(num_blocks * page, dtype=torch.bool)
    for i in range(b):
        for t in range(0, int(lens[i]), page):
            blk = int(block_table[i, t // page])
            n = min(page, int(lens[i]) - t)
            poison[blk * page: blk * page + n] = False
    flat[poison] = float("nan")
    q = (torch.randn(b, s_q, h_q, 576, generator=gen) * scale).clamp(-1, 1).to(dtype)
    return dict(
        q=q.to(device), k_cache=cache.to(device), block_table=block_table.to(device),
        cache_seqlens=lens.to(torch.int32).to(device),
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
