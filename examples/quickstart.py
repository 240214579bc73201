"""mla-cute quickstart: one paged MLA decode step, timed and checked against the reference.

b=4 requests, s_q=1, h_q=128 query heads over one latent KV head (576 = 512 + 64 RoPE),
cache lengths 1000-4000 tokens in 64-token pages.  On a Hopper GPU the CuTe kernels run;
on a machine without one, the torch reference backend does (and this script says so).
"""

import time

import torch

import mla_cute


def main():
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    b, s_q, h_q, page = 4, 1, 128, 64
    seqlens = torch.randint(1000, 4001, (b,), dtype=torch.int32)
    blocks = (int(seqlens.max()) + page - 1) // page
    block_table = torch.randperm(b * blocks, dtype=torch.int32).view(b, blocks)
    k_cache = (torch.randn(b * blocks, page, 1, 576) / 10).to(torch.bfloat16)
    q = (torch.randn(b, s_q, h_q, 576) / 10).to(torch.bfloat16)
    q, k_cache, block_table, seqlens = (t.to(device) for t in (q, k_cache, block_table, seqlens))

    try:
        backend = mla_cute.select_backend(q.device)
    except NotImplementedError:  # a GPU that is not Hopper
        backend = "reference"
    if backend == "reference":
        why = "no CUDA GPU" if device == "cpu" else f"{torch.cuda.get_device_name()} is not SM90"
        print(f"backend: reference (pure torch; {why}, so the CuTe kernels are not used)")
    else:
        print(f"backend: cute ({torch.cuda.get_device_name()})")

    meta, _ = mla_cute.get_mla_metadata()

    def step():
        return mla_cute.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, meta, backend=backend)

    out, lse = step()  # first call: compiles (cute) and fills the metadata
    if device == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(20 if device == "cuda" else 3):
        t0 = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times.sort()
    ref_out, ref_lse = mla_cute.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512,
                                                       mla_cute.get_mla_metadata()[0], backend="reference")
    err = (out.float() - ref_out.float()).abs().max().item()
    lse_err = (lse - ref_lse).abs().max().item()
    print(f"out {tuple(out.shape)} {out.dtype}, lse {tuple(lse.shape)} {lse.dtype}")
    print(f"time per call (median, synchronized): {times[len(times) // 2] * 1e6:.0f} us")
    print(f"max abs error vs reference: out {err:.2e}, lse {lse_err:.2e}")


if __name__ == "__main__":
    main()
