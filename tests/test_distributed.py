"""Context-parallel decode (``mla_cute.distributed``): the log-sum-exp merge against one decode over the whole cache,
empty parts and rows, the sink applied once; and the decode over ranks of a gloo process group (spawned
processes, 2 and 4 ranks, uneven shards, a rank holding nothing of a request) on the reference backend."""

from __future__ import annotations

import math

import pytest
import torch
import torch.multiprocessing as mp

import mla_cute
from mla_cute.distributed import merge_partial_attention, shard_pages


def _dense_case(seed=0, s_q=1, h_q=16, lens=(300, 64, 1, 130), page=64):
    gen = torch.Generator().manual_seed(seed)
    b = len(lens)
    blocks = max(-(-n // page) for n in lens)
    nb = b * blocks + 3
    k_cache = (torch.randn(nb, page, 1, 576, generator=gen) * 0.5).bfloat16()
    block_table = torch.randperm(nb, generator=gen)[: b * blocks].view(b, blocks).to(torch.int32)
    q = (torch.randn(b, s_q, h_q, 576, generator=gen) * 0.5).bfloat16()
    return q, k_cache, block_table, torch.tensor(lens, dtype=torch.int32)


def _decode(q, k_cache, block_table, seqlens, **kw):
    return mla_cute.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, mla_cute.get_mla_metadata()[0],
                                           backend="reference", **kw)


def _parts(q, k_cache, block_table, seqlens, world, **kw):
    outs, lses = zip(*(_decode(q, k_cache, *shard_pages(block_table, seqlens, k_cache.shape[1], world, r), **kw)
                       for r in range(world)))
    return torch.stack(outs), torch.stack(lses)


def _close(out, lse, ref_out, ref_lse):
    assert torch.equal(torch.isposinf(lse), torch.isposinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert torch.allclose(lse[finite], ref_lse[finite], atol=1e-5, rtol=1e-6)
    # Each part's out is rounded to bf16 before the merge: within a few bf16 steps of the whole call's.
    assert torch.allclose(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
    assert float((out.float() - ref_out.float()).norm() / ref_out.float().norm()) < 5e-3


@pytest.mark.parametrize("world", [2, 3, 4])
def test_merge_of_shards_is_the_whole_decode(world):
    """Shards of whole pages, uneven (300 tokens over 3 ranks), a request of 1 token (only rank 0 has it)."""
    case = _dense_case(seed=world)
    ref_out, ref_lse = _decode(*case)
    outs, lses = _parts(*case, world)
    assert torch.isposinf(lses[1:, 2]).all()  # the 1-token request: nothing on the other ranks
    out, lse = merge_partial_attention(outs, lses)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    _close(out, lse, ref_out, ref_lse)


def test_sink_is_applied_once_after_the_merge():
    case = _dense_case(seed=5, h_q=8)
    sink = torch.tensor([0.5, -1.0, 3.0, math.inf, -math.inf, 0.0, 2.0, -2.0])
    # Dense decode takes no sink: the whole call's rows with the sink applied as the combine applies it.
    ref_out, ref_lse = _decode(*case)
    keep = torch.sigmoid(ref_lse - sink.view(1, -1, 1)).permute(0, 2, 1).unsqueeze(-1)
    want = (ref_out.float() * keep).bfloat16()
    out, lse = merge_partial_attention(*_parts(*case, 3), attn_sink=sink)
    _close(out, lse, want, ref_lse)
    assert torch.all(out[:, :, 3] == 0)  # a sink of +inf takes every row's weight


def test_merge_of_nothing_is_zero_and_inf():
    outs = torch.randn(3, 2, 1, 4, 512)
    lses = torch.full((3, 2, 4, 1), math.inf)
    lses[1, 0] = 1.5  # request 0: one part attended
    out, lse = merge_partial_attention(outs, lses)
    assert torch.all(out[1] == 0) and torch.isposinf(lse[1]).all()
    assert torch.equal(out[0], outs[1, 0]) and torch.equal(lse[0], lses[1, 0])


def test_merge_names_its_bad_arguments():
    outs, lses = torch.randn(2, 1, 1, 4, 512), torch.zeros(2, 1, 4, 1)
    with pytest.raises(ValueError, match="outs must be"):
        merge_partial_attention(outs[0], lses)
    with pytest.raises(ValueError, match="lses must be"):
        merge_partial_attention(outs, lses.double())
    with pytest.raises(ValueError, match="attn_sink must be"):
        merge_partial_attention(outs, lses, torch.zeros(3))
    with pytest.raises(ValueError, match="at least one part"):
        merge_partial_attention(outs[:0], lses[:0])
    with pytest.raises(ValueError, match="backend must be one of"):
        merge_partial_attention(outs, lses, backend="triton")
    with pytest.raises(ValueError, match="rank must be"):
        shard_pages(torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 64, 2, 2)


def _rank_main(rank, world, path, results):
    import torch.distributed as dist

    from mla_cute.distributed import context_parallel_decode

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        q, k_cache, block_table, seqlens = _dense_case(seed=11, lens=(500, 64, 1, 0, 129))
        table, lens = shard_pages(block_table, seqlens, 64, world, rank)
        meta = mla_cute.get_mla_metadata()[0]
        with torch.inference_mode():
            out, lse = context_parallel_decode(q, k_cache, table, lens, 512, meta, backend="reference")
        results[rank] = (out.clone(), lse.clone())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_decode_over_gloo(world, tmp_path):
    """Every rank returns the whole decode (a request of 0 tokens included), under inference mode."""
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_rank_main, args=(world, str(tmp_path / "rendezvous"), results), nprocs=world, join=True)
    ref_out, ref_lse = _decode(*_dense_case(seed=11, lens=(500, 64, 1, 0, 129)))
    assert sorted(results.keys()) == list(range(world))
    for rank in range(world):
        out, lse = results[rank]
        _close(out, lse, ref_out, ref_lse)


def test_context_parallel_decode_refuses_causal_multi_token_queries(monkeypatch):
    import torch.distributed as dist

    from mla_cute.distributed import context_parallel_decode

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    q, k_cache, block_table, seqlens = _dense_case(s_q=2)
    with pytest.raises(NotImplementedError, match="causal"):
        context_parallel_decode(q, k_cache, block_table, seqlens, 512, mla_cute.get_mla_metadata()[0], causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,parts,sink", [(torch.bfloat16, 3, True), (torch.float16, 1, False),
                                              (torch.float32, 8, True)])
def test_merge_kernel_matches_the_cpu(dtype, parts, sink):
    """The merge kernel (the cute backend) against the torch merge on the CPU: empty parts, a row no part attended
    (out 0, lse +inf), sinks of +-inf among finite ones, a strided outs."""
    g = torch.Generator().manual_seed(parts)
    outs = torch.randn(parts, 4, 2, 64, 512, generator=g).to(dtype)
    lses = torch.randn(parts, 4, 64, 2, generator=g) * 3
    lses[0, 1] = math.inf
    lses[:, 2, 5, 1] = math.inf  # nothing attended anywhere
    attn_sink = torch.randn(64, generator=g) if sink else None
    if sink:
        attn_sink[0], attn_sink[1] = math.inf, -math.inf
    out, lse = merge_partial_attention(outs, lses, attn_sink)
    wide = torch.full((parts, 4, 2, 64, 520), float("nan"), dtype=dtype).cuda()
    wide[..., :512] = outs.cuda()
    g_out, g_lse = merge_partial_attention(wide[..., :512], lses.cuda(), attn_sink.cuda() if sink else None)
    assert g_out.dtype == dtype and torch.isposinf(g_lse[2, 5, 1]) and torch.all(g_out[2, 1, 5] == 0)
    assert torch.allclose(g_lse.cpu(), lse, atol=1e-5, rtol=1e-6)
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3 if dtype == torch.float16 else 1e-5
    assert torch.allclose(g_out.cpu().float(), out.float(), atol=tol, rtol=tol)
    with pytest.raises(NotImplementedError, match="outs: the 'cute' merge"):
        merge_partial_attention(outs[..., :100].cuda(), lses.cuda())


def _nccl_graph_main(rank, path):
    import torch.distributed as dist

    from mla_cute.distributed import context_parallel_decode

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{path}", rank=rank, world_size=1)
    try:
        q, k_cache, block_table, seqlens = (t.cuda() for t in _dense_case(seed=5, h_q=64, lens=(700, 64, 1, 0, 129)))
        with torch.inference_mode():
            # Compiles, and NCCL's first call; the capture plans with a metadata object of its own.
            context_parallel_decode(q, k_cache, block_table, seqlens, 512, mla_cute.get_mla_metadata()[0])
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out, lse = context_parallel_decode(q, k_cache, block_table, seqlens, 512,
                                                   mla_cute.get_mla_metadata()[0])
            gen = torch.Generator(device="cuda").manual_seed(6)
            q.copy_(torch.randn(q.shape, generator=gen, device="cuda") * 0.5)
            k_cache.copy_(torch.randn(k_cache.shape, generator=gen, device="cuda") * 0.5)
            seqlens.copy_(torch.tensor([129, 700, 0, 64, 1]))
            out.fill_(float("nan"))
            graph.replay()
            ref_out, ref_lse = mla_cute.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512,
                                                               mla_cute.get_mla_metadata()[0])
            torch.cuda.synchronize()
        assert torch.equal(torch.isposinf(lse), torch.isposinf(ref_lse)), (
            f"+inf lse rows differ: merged {torch.isposinf(lse).any(dim=(1, 2)).tolist()}, "
            f"whole decode {torch.isposinf(ref_lse).any(dim=(1, 2)).tolist()}; merged lse[:, 0, 0] "
            f"{lse[:, 0, 0].tolist()}, whole {ref_lse[:, 0, 0].tolist()}")
        finite = torch.isfinite(ref_lse)
        assert torch.allclose(lse[finite], ref_lse[finite], atol=1e-5, rtol=1e-6)
        assert torch.allclose(out.float(), ref_out.float(), atol=1e-2, rtol=1e-2)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_context_parallel_decode_over_nccl_in_a_cuda_graph(tmp_path):
    """One NCCL rank (one GPU holds no second): the decode, the all-gather and the merge captured in a CUDA graph
    under inference mode replay with new q, cache and lengths to the whole decode's result."""
    mp.spawn(_nccl_graph_main, args=(str(tmp_path / "rendezvous"),), nprocs=1, join=True)


def test_example_runs():
    import re
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "context_parallel.py"
    proc = subprocess.run([sys.executable, str(script), "--ranks", "2"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    err = float(re.search(r"rel\. error ([0-9.e+-]+)", proc.stdout).group(1))
    assert err < 5e-3, proc.stdout
