"""Dense decode over the per-tensor FP8 cache (FlashMLA's Hopper FP8 kernel's format: k_cache float8_e4m3fn
``[.., 576]`` with ``descale_k``, q float8_e4m3fn with ``descale_q`` or bf16; out bf16) on the reference backend,
against a float64 oracle of the true values, and its argument rules."""

import math

import pytest
import torch

import mla_cute
from mla_cute import flash_mla_with_kvcache, get_mla_decoding_metadata, get_mla_metadata

E4M3 = torch.float8_e4m3fn


def _case(b=3, s_q=2, h_q=16, h_kv=1, fp8_q=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(4 * b, 64, h_kv, 576, generator=g) * 2).to(E4M3)
    q = (torch.randn(b, s_q, h_q, 576, generator=g) * 2)
    q = q.to(E4M3) if fp8_q else q.bfloat16()
    table = torch.randperm(4 * b, generator=g).to(torch.int32).view(b, 4)
    lengths = torch.tensor([200, 1, 256][:b], dtype=torch.int32)
    dq = torch.tensor([0.37], dtype=torch.float32) if fp8_q else None
    return q, k, table, lengths, dq, torch.tensor([0.021], dtype=torch.float32)


def _oracle(q, k, table, lengths, dq, dk, scale, causal):
    """Attention in float64 over the true values (stored x descale), FlashMLA's rules: bottom-right causal mask,
    out 0 and lse +inf where nothing is attended."""
    b, s_q, h_q, _ = q.shape
    h_kv = k.shape[2]
    qt = q.double() * (dq.double() if dq is not None else 1.0)
    kt = k.double() * dk.double()
    out = torch.zeros(b, s_q, h_q, 512, dtype=torch.float64)
    lse = torch.full((b, h_q, s_q), math.inf, dtype=torch.float64)
    for i in range(b):
        n = int(lengths[i])
        keys = torch.stack([kt[int(table[i, t // 64]), t % 64] for t in range(n)]) if n else None  # [n, h_kv, 576]
        for t in range(s_q):
            seen = n - (s_q - 1 - t) if causal else n
            if seen <= 0:
                continue
            for h in range(h_q):
                kv = keys[:seen, h // (h_q // h_kv)]
                s = kv @ qt[i, t, h] * scale
                lse[i, h, t] = torch.logsumexp(s, 0)
                out[i, t, h] = torch.softmax(s, 0) @ kv[:, :512]
    return out, lse


@pytest.mark.parametrize("fp8_q,h_kv,causal", [(True, 1, True), (False, 1, False), (True, 2, True)])
def test_per_tensor_fp8_is_attention_over_the_true_values(fp8_q, h_kv, causal):
    q, k, table, lengths, dq, dk = _case(h_kv=h_kv, fp8_q=fp8_q)
    out, lse = flash_mla_with_kvcache(q, k, table, lengths, 512, get_mla_metadata()[0], None, 0.05, causal, True,
                                      descale_q=dq, descale_k=dk)
    want_out, want_lse = _oracle(q, k, table, lengths, dq, dk, 0.05, causal)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert torch.allclose(out.double(), want_out, atol=2e-2, rtol=1e-2)
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert torch.allclose(lse.double()[finite], want_lse[finite], atol=1e-4, rtol=1e-5)


def test_per_tensor_fp8_over_a_given_plan_and_into_out():
    q, k, table, lengths, dq, dk = _case()
    plan, splits = get_mla_decoding_metadata(lengths, 2 * 16, 1, 16, True)
    out = torch.full((3, 2, 16, 512), float("nan"), dtype=torch.bfloat16)
    got = flash_mla_with_kvcache(q, k, table, lengths, 512, plan, splits, None, False, True, descale_q=dq,
                                 descale_k=dk, out=out)
    want = flash_mla_with_kvcache(q, k, table, lengths, 512, get_mla_metadata()[0], None, None, False, True,
                                  descale_q=dq, descale_k=dk)
    assert got[0] is out and torch.equal(out, want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("change,error,match", [
    (dict(descale_k=None), TypeError, "descale_k must be a float32 tensor"),
    (dict(descale_q=None), TypeError, "descale_q must be a float32 tensor"),
    (dict(descale_k=torch.tensor([0.5], dtype=torch.float64)), ValueError, r"descale_k must be a float32 tensor \[1\]"),
    (dict(descale_q=torch.tensor(0.5)), ValueError, r"descale_q must be a float32 tensor \[1\]"),
    (dict(q=lambda a: a["q"].float()), TypeError, "q must have dtype"),
    (dict(is_fp8_kvcache=False), TypeError, "q must be torch.bfloat16 or torch.float16 with a 16-bit cache"),
    (dict(out=lambda a: torch.empty(3, 2, 16, 512, dtype=E4M3)), ValueError, "out must be"),
])
def test_per_tensor_fp8_arguments_are_checked(change, error, match):
    q, k, table, lengths, dq, dk = _case()
    args = dict(q=q, k_cache=k, block_table=table, cache_seqlens=lengths, head_dim_v=512,
                tile_scheduler_metadata=get_mla_metadata()[0], is_fp8_kvcache=True, descale_q=dq, descale_k=dk)
    args.update({key: (val(args) if callable(val) else val) for key, val in change.items()})
    with pytest.raises(error, match=match):
        flash_mla_with_kvcache(**args)


def test_descales_belong_to_the_per_tensor_cache_only():
    q, k, table, lengths, dq, dk = _case(fp8_q=False)
    with pytest.raises(ValueError, match="descale_q applies to a float8_e4m3fn q"):
        flash_mla_with_kvcache(q, k, table, lengths, 512, get_mla_metadata()[0], is_fp8_kvcache=True,
                               descale_q=dk, descale_k=dk)
    bf16_cache = k.float().bfloat16()
    with pytest.raises(ValueError, match="descale_k applies to dense decode over the per-tensor FP8 cache"):
        flash_mla_with_kvcache(q, bf16_cache, table, lengths, 512, get_mla_metadata()[0], descale_k=dk)
    v32 = mla_cute.quantize_kv_cache(torch.randn(12, 64, 1, 576).bfloat16())
    with pytest.raises(ValueError, match="descale_k applies to dense decode over the per-tensor FP8 cache"):
        flash_mla_with_kvcache(q, v32, table, lengths, 512, get_mla_metadata()[0], is_fp8_kvcache=True,
                               descale_k=dk)
