"""mla-cute quickstart: one paged MLA decode step, timed and checked.

b=4 requests, s_q=1, h_q=128 query heads over one latent KV head (576 = 512 + 64 RoPE),
cache lengths 1000-4000 tokens in 64-token pages.  On a Hopper GPU the CuTe kernels run and
are checked against the torch reference backend; on a machine without one the reference
backend runs (and this script says so) and is checked against a float64 computation here.
"""

import time

import torch

import mla_cute


def float64_decode(q, k_cache, block_table, seqlens, scale):
    """The same decode step in float64, written apart from the backends: per request, gather the
    request's tokens through the block table and take a plain softmax over them (s_q = 1: no mask)."""
    b, s_q, h_q, d = q.shape
    page = k_cache.shape[1]
    out = torch.empty(b, s_q, h_q, 512, dtype=torch.float64)
    lse = torch.empty(b, h_q, s_q, dtype=torch.float64)
    for i, n in enumerate(seqlens.tolist()):
        blocks = block_table[i, : (n + page - 1) // page].long().cpu()
        kv = k_cache.cpu()[blocks].reshape(-1, d)[:n].double()  # [n, 576]
        scores = q[i].cpu().double().reshape(s_q * h_q, d) @ kv.T * scale  # [s_q * h_q, n]
        out[i] = (torch.softmax(scores, dim=-1) @ kv[:, :512]).reshape(s_q, h_q, 512)
        lse[i] = torch.logsumexp(scores, dim=-1).reshape(s_q, h_q).T
    return out, lse


def readable_time(seconds: float) -> str:
    """1.23 s, 45.6 ms or 789 us, by magnitude."""
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


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
        print(f"backend: reference (pure torch, fp32 math; {why}, so the CuTe kernels are not used)")
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

    if backend == "cute":
        compared = "the cute kernel against the reference backend (fp32 torch, same GPU)"
        ref_out, ref_lse = mla_cute.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512,
                                                           mla_cute.get_mla_metadata()[0], backend="reference")
    else:
        compared = "the reference backend against a float64 computation in this script"
        ref_out, ref_lse = float64_decode(q, k_cache, block_table, seqlens, 576**-0.5)
    err = (out.double().cpu() - ref_out.double().cpu()).abs().max().item()
    lse_err = (lse.double().cpu() - ref_lse.double().cpu()).abs().max().item()
    print(f"out {tuple(out.shape)} {out.dtype}, lse {tuple(lse.shape)} {lse.dtype}")
    sync = ", synchronized" if device == "cuda" else ""
    print(f"time per call (median of {len(times)}{sync}): {readable_time(times[len(times) // 2])}")
    print(f"checked {compared}")
    largest = ref_out.abs().max().item()
    print(f"max abs error: out {err:.2e} (|out| up to {largest:.2e}, rounded to {out.dtype}), lse {lse_err:.2e}")


if __name__ == "__main__":
    main()
