"""The cache writer kernel (``write_kv_cache`` on the cute backend) against the quantizers, byte for byte: every
format, row dtype and slot dtype; rows at the formats' edges (NaN, inf, zeros, the e4m3 and e2m1 limits, ties);
slots shuffled, skipped (-1) or outside the cache (not written); the bytes it must not touch kept; a CUDA graph
replay; inference mode."""

from __future__ import annotations

import pytest
import torch

import mla_cute
from mla_cute.kv_formats import BYTES_PER_TOKEN, HEAD_DIM, PAGE_BLOCKED, page_bytes

pytestmark = pytest.mark.gpu

FORMATS = ["V32", "V32_NO_ROPE", "V4", "V41", "V41_PAGED", "V41_FP4"]


def _edge_rows(n: int, d: int, g: torch.Generator) -> torch.Tensor:
    """fp32 rows [n, d]: random values of tile-varying magnitude, then rows at the formats' edges."""
    mag = torch.pow(2.0, torch.randint(-20, 12, (n, d // 16, 1), generator=g).float())
    x = (torch.randn(n, d // 16, 16, generator=g) * mag).reshape(n, d)
    if n < 12:
        return x
    x[0] = 0.0
    x[1, 3], x[1, 200] = float("nan"), -float("nan")
    x[1, d - 3], x[1, d - 2] = float("nan"), -float("nan")  # V32's and V4's RoPE columns: bf16 0x7FFF
    x[2, 40], x[2, 300], x[2, 500] = float("inf"), -float("inf"), -0.0
    x[3] = 448.0 * torch.pow(2.0, torch.randint(-16, 8, (d,), generator=g).float())  # exact powers of two
    x[4] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * (d // 8)) * torch.where(
        torch.arange(d) % 3 == 0, -1.0, 1.0)  # e2m1 ties at scale 1 (amax 6)
    x[5] = torch.randn(d, generator=g) * 1e-30  # below every scale
    x[6] = torch.randn(d, generator=g) * 1e4  # past e4m3 at scale 1
    x[7, : d // 2] = 3000.0  # fp4 scales clamp at 448
    x[8] = 448.0 * (1 + torch.randint(-3, 4, (d,), generator=g).float() * 2.0**-20)  # near a power of two
    return x


def _pages(cache: torch.Tensor, fmt: str) -> torch.Tensor:
    """All bytes of every page (a page-blocked format's padding included)."""
    raw = cache.view(torch.uint8)
    width = page_bytes(fmt, raw.shape[1]) if fmt in PAGE_BLOCKED else BYTES_PER_TOKEN[fmt] * raw.shape[1]
    return torch.as_strided(raw, (raw.shape[0], width), (raw.stride(0), 1), raw.storage_offset())


def _cache(fmt, nb, page, g):
    x = (torch.randn(nb, page, 1, HEAD_DIM[fmt], generator=g) * 3).bfloat16().cuda()
    return mla_cute.quantize_kv_cache(x, kv_format=fmt)


def _same_cache(cache, fmt):
    """A copy of ``cache`` with its page stride (``clone`` of a page-blocked view would pack it)."""
    other = mla_cute.quantize_kv_cache(torch.zeros(cache.shape[0], cache.shape[1], 1, HEAD_DIM[fmt],
                                                   dtype=torch.bfloat16, device="cuda"), kv_format=fmt)
    _pages(other, fmt).copy_(_pages(cache, fmt))
    return other


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype,slot_dtype", [(torch.bfloat16, torch.int32), (torch.float16, torch.int64),
                                              (torch.float32, torch.int32)])
def test_writer_writes_the_quantizers_bytes(fmt, dtype, slot_dtype):
    g = torch.Generator().manual_seed(hash((fmt, str(dtype))) % 2**31)
    nb, page, n = (7, 64, 300) if fmt != "V4" else (12, 32, 300)  # V4 with a page of 32
    kv = fmt if fmt in ("V32_NO_ROPE", "V41_PAGED") else None
    cache = _cache(fmt, nb, page, g)
    want = _same_cache(cache, fmt)
    rows = _edge_rows(n, HEAD_DIM[fmt], g).to(dtype)
    slots = torch.randperm(nb * page, generator=g)[:n]
    slots[10:20] = -1
    slots[20], slots[21], slots[22] = nb * page, nb * page + 5, -7  # outside the cache: the kernel skips them
    live = (slots >= 0) & (slots < nb * page)
    mla_cute.write_kv_cache(want, rows.cuda(), torch.where(live, slots, -1).cuda().to(slot_dtype), kv_format=kv,
                            backend="reference")
    mla_cute.write_kv_cache(cache, rows.cuda(), slots.cuda().to(slot_dtype), kv_format=kv)
    # Every byte of every page as the torch writer leaves it (other slots and a page's padding untouched).
    assert torch.equal(_pages(cache, fmt), _pages(want, fmt))
    # The quantizer on the CPU gives the same bytes for the rows written.
    cpu = _token_view(_pages(mla_cute.quantize_kv_cache(rows.reshape(n, 1, 1, -1), kv_format=fmt), fmt), fmt, 1)
    got = _token_view(_pages(cache, fmt), fmt, page)
    assert torch.equal(got[slots[live].cuda()].cpu(), cpu[live])


def _token_view(pages: torch.Tensor, fmt: str, page: int) -> torch.Tensor:
    """Each token's bytes [num_blocks * page, bytes per token] (a page-blocked token's data row, then scale row)."""
    nb = pages.shape[0]
    bpt = BYTES_PER_TOKEN[fmt]
    if fmt not in PAGE_BLOCKED:
        return pages[:, : bpt * page].reshape(nb * page, bpt)
    data, scale, _ = PAGE_BLOCKED[fmt]
    rows = pages[:, : data * page].reshape(nb, page, data)
    scales = pages[:, data * page: (data + scale) * page].reshape(nb, page, scale)
    return torch.cat([rows, scales], dim=-1).reshape(nb * page, data + scale)


@pytest.mark.parametrize("fmt", FORMATS)
def test_writer_duplicate_slots_keep_the_last_row_whole(fmt):
    """512 rows aimed at 16 slots, shuffled, 30 runs: each slot holds the bytes of its last row in slot_mapping
    order (as the reference backend and a sequential write leave it), never one row's data with another's scales,
    the same on every run."""
    g = torch.Generator().manual_seed(hash(fmt) % 2**31)
    nb, page = 4, 64
    kv = fmt if fmt in ("V32_NO_ROPE", "V41_PAGED") else None
    cache = _cache(fmt, nb, page, g)
    base = _same_cache(cache, fmt)
    targets = torch.randperm(nb * page, generator=g)[:16]
    for run in range(30):
        slots = targets[torch.randint(16, (512,), generator=g)]
        rows = (torch.randn(512, HEAD_DIM[fmt], generator=g) * 3).bfloat16()
        got, want = _same_cache(base, fmt), _same_cache(base, fmt)
        mla_cute.write_kv_cache(got, rows.cuda(), slots.cuda(), kv_format=kv)
        mla_cute.write_kv_cache(want, rows.cuda(), slots.cuda(), kv_format=kv, backend="reference")
        assert torch.equal(_pages(got, fmt), _pages(want, fmt)), f"run {run}"
        last = {int(s): i for i, s in enumerate(slots.tolist())}
        cpu = _token_view(_pages(mla_cute.quantize_kv_cache(rows.reshape(512, 1, 1, -1), kv_format=fmt), fmt), fmt, 1)
        tokens = _token_view(_pages(got, fmt), fmt, page)
        for s, i in last.items():
            assert torch.equal(tokens[s].cpu(), cpu[i]), f"run {run}, slot {s}"


def test_writer_keeps_other_slots_and_skips_the_rest():
    g = torch.Generator().manual_seed(3)
    fmt, nb, page = "V4", 5, 64
    cache = _cache(fmt, nb, page, g)
    before = _token_view(_pages(cache, fmt).clone(), fmt, page)
    slots = torch.tensor([-1, nb * page, 2**31 - 1, 17], dtype=torch.int32, device="cuda")
    rows = torch.randn(4, 512, generator=g).bfloat16().cuda()
    mla_cute.write_kv_cache(cache, rows, slots)
    after = _token_view(_pages(cache, fmt), fmt, page)
    changed = (after != before).any(dim=1).nonzero().flatten().tolist()
    assert changed == [17]


def test_writer_in_a_cuda_graph_and_under_inference_mode():
    g = torch.Generator().manual_seed(4)
    fmt, nb, page, n = "V41", 6, 64, 64
    cache = _cache(fmt, nb, page, g)
    rows = torch.empty(n, 512, dtype=torch.bfloat16, device="cuda")
    slots = torch.empty(n, dtype=torch.int64, device="cuda")
    rows.copy_(torch.randn(n, 512, generator=g))
    slots.copy_(torch.randperm(nb * page, generator=g)[:n])
    mla_cute.write_kv_cache(cache, rows, slots)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph):
        mla_cute.write_kv_cache(cache, rows, slots)
    for step in range(3):
        new_rows = torch.randn(n, 512, generator=g).bfloat16()
        new_slots = torch.randperm(nb * page, generator=g)[:n]
        rows.copy_(new_rows)
        slots.copy_(new_slots)
        graph.replay()
        torch.cuda.synchronize()
        got = _token_view(_pages(cache, fmt), fmt, page)[new_slots.cuda()].cpu()
        want = mla_cute.quantize_kv_cache(new_rows.reshape(n, 1, 1, 512), kv_format=fmt).view(torch.uint8)
        assert torch.equal(got, want.reshape(n, -1)), step


def test_writer_takes_strided_rows_and_rejects_unaligned_caches():
    g = torch.Generator().manual_seed(5)
    fmt, nb, page = "V32", 3, 64
    cache = _cache(fmt, nb, page, g)
    wide = torch.randn(8, 600, generator=g).bfloat16().cuda()
    rows = wide[:, 1:577]  # unit last stride, a misaligned base: copied
    slots = torch.arange(8, dtype=torch.int32, device="cuda") * 3
    mla_cute.write_kv_cache(cache, rows, slots)
    got = cache.view(torch.uint8).reshape(nb * page, -1)[slots.long()]
    want = mla_cute.quantize_kv_cache(rows.reshape(8, 1, 1, 576), kv_format=fmt).view(torch.uint8).reshape(8, -1)
    assert torch.equal(got, want)
    buf = torch.zeros(nb * page * 656 + 4, dtype=torch.uint8, device="cuda")
    shifted = buf[4:].view(nb, page, 1, 656)
    with pytest.raises(NotImplementedError, match="k_cache: the 'cute' cache writer needs a 16-byte aligned"):
        mla_cute.write_kv_cache(shifted, rows, slots)
