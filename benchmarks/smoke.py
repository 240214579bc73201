"""Quick end-to-end check on the GPU: one small case per feature, errors printed (not a benchmark)."""

import sys
import time

import torch

sys.path.insert(0, "tests")
import mla_cute  # noqa: E402
from gpu_cases import make_dense_case, poison_allocator  # noqa: E402


def check(name, b, s_q, s_k, h_q, h_kv, causal=False, varlen=False, dtype=torch.bfloat16):
    case = make_dense_case(b, s_q, s_k, h_q, h_kv, varlen=varlen, dtype=dtype)
    ref_o, ref_l = mla_cute.flash_mla_with_kvcache(**case, head_dim_v=512, tile_scheduler_metadata=mla_cute.get_mla_metadata()[0],
                                                    causal=causal, backend="reference")
    meta = mla_cute.get_mla_metadata()[0]
    t = time.time()
    poison_allocator()
    o, lse = mla_cute.flash_mla_with_kvcache(**case, head_dim_v=512, tile_scheduler_metadata=meta, causal=causal, backend="cute")
    torch.cuda.synchronize()
    fin = torch.isfinite(ref_o)
    err = (o.float() - ref_o.float())[fin].abs().max().item() if fin.any() else 0.0
    lerr = (lse - ref_l)[torch.isfinite(ref_l)].abs().max().item() if torch.isfinite(ref_l).any() else 0.0
    nan_o = torch.isnan(o).sum().item()
    inf_match = torch.equal(torch.isinf(lse), torch.isinf(ref_l))
    print(f"{name:28s} out max err {err:.3e} lse max err {lerr:.3e} NaN in out {nan_o} inf match {inf_match} "
          f"({time.time() - t:.1f}s incl. compile) splits {meta.num_splits[-1].item()}", flush=True)


if __name__ == "__main__":
    check("b2 sq1 sk140 h128", 2, 1, 140, 128, 1)
    check("b64 sq1 sk4096 h128 varlen", 64, 1, 4096, 128, 1, varlen=True)
    check("b2 sq2 sk140 h64 causal", 2, 2, 140, 64, 1, causal=True)
    check("b6 sq4 sk4096 h128 hkv2 c", 6, 4, 4096, 128, 2, causal=True, varlen=True)
    check("b2 sq1 sk20 h3 hkv3", 2, 1, 20, 3, 3)
    check("b1 sq1 sk131072 h128", 1, 1, 131072, 128, 1)
    check("fp16 b4 sq1 sk1000 h16", 4, 1, 1000, 16, 1, dtype=torch.float16)
