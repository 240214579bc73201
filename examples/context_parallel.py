"""Decode over a cache split across ranks (context parallelism), checked against one decode over the whole cache.

    python examples/context_parallel.py [--ranks 2]

Each rank holds whole pages of every request (``mla_cute.distributed.shard_pages``), decodes its shard and the
ranks merge by log-sum-exp (``context_parallel_decode``: one all-gather of out and lse).  With as many GPUs as
ranks it runs over NCCL with the cute kernels; otherwise over gloo on the CPU with the reference backend.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import mla_cute
from mla_cute.distributed import context_parallel_decode, shard_pages


def make_case(device):
    """4 requests of 64-token pages, lengths 300-4000 (one of 50 tokens: only the first rank has any of it)."""
    gen = torch.Generator().manual_seed(0)
    lens = torch.tensor([4000, 50, 1300, 300], dtype=torch.int32)
    blocks = int(-(-lens.max() // 64))
    nb = len(lens) * blocks
    k_cache = (torch.randn(nb, 64, 1, 576, generator=gen) * 0.5).bfloat16()
    block_table = torch.randperm(nb, generator=gen).view(len(lens), blocks).to(torch.int32)
    q = (torch.randn(len(lens), 1, 128, 576, generator=gen) * 0.5).bfloat16()
    return [t.to(device) for t in (q, k_cache, block_table, lens)]


def run_rank(rank, ranks, path, gpus):
    device = torch.device("cuda", rank) if gpus else torch.device("cpu")
    if gpus:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if gpus else "gloo", init_method=f"file://{path}", rank=rank, world_size=ranks)
    q, k_cache, block_table, lens = make_case(device)
    table, shard_lens = shard_pages(block_table, lens, 64, ranks, rank)
    out, lse = context_parallel_decode(q, k_cache, table, shard_lens, 512, mla_cute.get_mla_metadata()[0])
    if rank == 0:
        whole, whole_lse = mla_cute.flash_mla_with_kvcache(q, k_cache, block_table, lens, 512,
                                                           mla_cute.get_mla_metadata()[0])
        err = float((out.float() - whole.float()).norm() / whole.float().norm())
        print(f"{ranks} ranks over {'NCCL' if gpus else 'gloo'}: tokens a rank {shard_lens.tolist()} (rank 0); "
              f"merged out vs one decode: rel. error {err:.1e}, "
              f"max |lse diff| {float((lse - whole_lse).abs().max()):.1e}")
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args()
    gpus = torch.cuda.is_available() and torch.cuda.device_count() >= args.ranks
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(run_rank, args=(args.ranks, os.path.join(tmp, "rendezvous"), gpus), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
