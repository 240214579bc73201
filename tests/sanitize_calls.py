"""One representative call of every kernel, small, with adversarial values, for compute-sanitizer (run by hand on
a Hopper GPU, from the project root):

    compute-sanitizer --tool memcheck  --error-exitcode 99 python tests/sanitize_calls.py
    compute-sanitizer --tool racecheck --error-exitcode 99 python tests/sanitize_calls.py
    compute-sanitizer --tool synccheck --error-exitcode 99 python tests/sanitize_calls.py

(without ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``: memcheck then flags bulk copies across the
allocator's mappings).  ``python tests/sanitize_calls.py NAME...`` runs some of them; ``--list`` names them.  Each
call runs once after its kernels were built (compile outside the sanitizer first with a plain run: the disk cache
keeps them).  Kernels: the dense split kernel (pairs, grouped heads), the scheduler and the
combine; the sparse decode kernel per cache format, with one and two caches; sparse prefill over bf16 rows (d_qk
576 and 512) and over the paged FP8 cache; the cache writer per format; the merge.  Every call's outputs are
checked for NaN (none is expected: the inputs' NaN lie only where no call reads)."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_cases import make_dense_case, make_prefill_case, make_prefill_fp8_case, make_sparse_case  # noqa: E402

import mla_cute  # noqa: E402
from mla_cute.kv_formats import HEAD_DIM  # noqa: E402


def _dense(s_q, h_q, h_kv, **kw):
    case = make_dense_case(4, s_q, 700, h_q, h_kv, varlen=True, **kw)
    meta, _ = mla_cute.get_mla_metadata()
    mla_cute.flash_mla_with_kvcache(**case, head_dim_v=512, tile_scheduler_metadata=meta, causal=s_q > 1)
    # A used entry outside the cache, written after the first call's checks (the next call replays the plan): the
    # kernel reads it as zero keys.
    case["block_table"][0, 0] = 2147480000
    return mla_cute.flash_mla_with_kvcache(**case, head_dim_v=512, tile_scheduler_metadata=meta, causal=s_q > 1)


def _sparse(fmt, extra=None):
    case = make_sparse_case(3, 2, 64, 300, 192, 64, out_of_range=True, topk_length=[192, 5, 0],
                            attn_sink=[0.5] * 64, kv_format=fmt)
    if extra is not None:
        other = make_sparse_case(3, 2, 64, 200, 128, 32, out_of_range=True, kv_format=extra, seed=1)
        case.update(extra_k_cache=other["k_cache"], extra_indices_in_kvcache=other["indices"],
                    extra_topk_length=torch.tensor([0, 128, 77], dtype=torch.int32, device="cuda"))
    meta, _ = mla_cute.get_mla_metadata()
    return mla_cute.flash_mla_with_kvcache(block_table=None, cache_seqlens=None, head_dim_v=512,
                                           tile_scheduler_metadata=meta, is_fp8_kvcache=True, **case)


def _prefill(d_qk):
    return mla_cute.flash_mla_sparse_fwd(**make_prefill_case(70, 500, 128, 64, d_qk, with_sink=True,
                                                             with_topk_length=True))


def _prefill_fp8():
    return mla_cute.flash_mla_sparse_fwd(**make_prefill_fp8_case(70, 500, 128, 64, with_sink=True,
                                                                 with_topk_length=True))


def _write(fmt):
    nb, page = 3, 64
    rows16 = torch.randn(nb, page, 1, HEAD_DIM[fmt], device="cuda").bfloat16()
    cache = mla_cute.quantize_kv_cache(rows16, kv_format=fmt)
    slots = torch.tensor([5, -1, 5, nb * page, -7, 130, 2**31 - 1, 0], dtype=torch.int64, device="cuda")
    rows = torch.randn(slots.shape[0], HEAD_DIM[fmt], device="cuda").bfloat16()
    mla_cute.write_kv_cache(cache, rows, slots, kv_format=fmt if fmt in ("V32_NO_ROPE", "V41_PAGED") else None)
    return (mla_cute.dequantize_kv_cache(cache, kv_format=fmt if fmt in ("V32_NO_ROPE", "V41_PAGED") else None),)


def _merge():
    outs = torch.randn(3, 2, 2, 16, 512, device="cuda").bfloat16()
    lses = torch.randn(3, 2, 16, 2, device="cuda")
    lses[0, 0] = float("inf")  # a part that attended to nothing
    return mla_cute.merge_partial_attention(outs, lses, torch.randn(16, device="cuda"))


CALLS = {
    "dense_pairs": lambda: _dense(1, 128, 1),
    "dense_grouped_causal": lambda: _dense(2, 64, 2),
    "dense_fp16_odd_heads": lambda: _dense(3, 9, 3, dtype=torch.float16),
    **{f"sparse_{fmt}": (lambda fmt=fmt: _sparse(fmt)) for fmt in ("V32", "V32_NO_ROPE", "V4", "V41", "V41_PAGED")},
    "sparse_V4_extra_V4": lambda: _sparse("V4", "V4"),
    "sparse_V41_extra_V41_FP4": lambda: _sparse("V41", "V41_FP4"),
    "prefill_576": lambda: _prefill(576),
    "prefill_512": lambda: _prefill(512),
    "prefill_fp8_cache": _prefill_fp8,
    **{f"write_{fmt}": (lambda fmt=fmt: _write(fmt)) for fmt in ("V32", "V32_NO_ROPE", "V4", "V41", "V41_PAGED",
                                                                   "V41_FP4")},
    "merge": _merge,
}


def main(names) -> int:
    if names == ["--list"]:
        print("\n".join(CALLS))
        return 0
    unknown = [n for n in names if n not in CALLS]
    if unknown:
        raise SystemExit(f"unknown calls {unknown}; --list names them")
    bad = []
    for name in names or CALLS:
        results = CALLS[name]()
        torch.cuda.synchronize()
        nan = sum(int(t.isnan().sum()) for t in results if isinstance(t, torch.Tensor) and t.is_floating_point())
        print(f"{name}: {'ok' if nan == 0 else f'{nan} NaN'}", flush=True)
        if nan:
            bad.append(name)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
