"""Dense decode with head_dim 512 (a K head without a RoPE part: q and the 16-bit cache hold 512 features, V is the
whole row) on the reference backend against a float64 oracle, and its argument rules; the cute backend refuses it
by name (its kernel reads 576-feature rows)."""

import math

import pytest
import torch

from mla_cute import flash_mla_with_kvcache, get_mla_metadata


def _case(b=3, s_q=2, h_q=8, h_kv=2, d=512, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(4 * b, 64, h_kv, d, generator=g) * 0.5).to(dtype)
    q = (torch.randn(b, s_q, h_q, d, generator=g) * 0.5).to(dtype)
    table = torch.randperm(4 * b, generator=g).to(torch.int32).view(b, 4)
    lengths = torch.tensor([200, 0, 256, 1][:b], dtype=torch.int32)
    return q, k, table, lengths


def _oracle(q, k, table, lengths, scale, causal):
    """float64 attention, FlashMLA's rules: bottom-right causal mask, out 0 and lse +inf where nothing is seen."""
    b, s_q, h_q, d = q.shape
    h_kv = k.shape[2]
    group = h_q // h_kv
    out = torch.zeros(b, s_q, h_q, 512, dtype=torch.float64)
    lse = torch.full((b, h_q, s_q), math.inf, dtype=torch.float64)
    for i in range(b):
        n = int(lengths[i])
        if n == 0:
            continue
        keys = torch.stack([k[int(table[i, t // 64]), t % 64] for t in range(n)]).double()  # [n, h_kv, d]
        for t in range(s_q):
            seen = n - (s_q - 1 - t) if causal else n
            if seen <= 0:
                continue
            for h in range(h_q):
                kh = keys[:seen, h // group]
                s = (kh @ q[i, t, h].double()) * scale
                p = torch.softmax(s, 0)
                out[i, t, h] = p @ kh[:, :512]
                lse[i, h, t] = torch.logsumexp(s, 0)
    return out, lse


@pytest.mark.parametrize("s_q,causal,h_q,h_kv,dtype", [(1, False, 16, 1, torch.bfloat16),
                                                       (2, True, 8, 2, torch.float16),
                                                       (3, True, 6, 3, torch.bfloat16)])
def test_dense_512_matches_float64_oracle(s_q, causal, h_q, h_kv, dtype):
    q, k, table, lengths = _case(s_q=s_q, h_q=h_q, h_kv=h_kv, dtype=dtype)
    out, lse = flash_mla_with_kvcache(q, k, table, lengths, 512, get_mla_metadata()[0], causal=causal)
    ref_out, ref_lse = _oracle(q, k, table, lengths, 512 ** -0.5, causal)  # default scale: q's head_dim
    assert out.dtype == dtype and out.shape == (3, s_q, h_q, 512)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-3, rtol=1e-2)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-5)
    assert torch.isinf(lse[1]).all() and (out[1] == 0).all()


def test_dense_512_default_scale_is_its_head_dim():
    q, k, table, lengths = _case()
    meta = get_mla_metadata()[0]
    out, lse = flash_mla_with_kvcache(q, k, table, lengths, 512, meta, causal=True)
    given, given_lse = flash_mla_with_kvcache(q, k, table, lengths, 512, meta, softmax_scale=512 ** -0.5,
                                              causal=True)
    other, _ = flash_mla_with_kvcache(q, k, table, lengths, 512, get_mla_metadata()[0],
                                      softmax_scale=576 ** -0.5, causal=True)
    assert torch.equal(out, given) and torch.equal(lse, given_lse)
    assert not torch.equal(out, other)


@pytest.mark.parametrize("q_d,k_d,match", [(512, 576, "k_cache must have q's head_dim 512"),
                                          (576, 512, "k_cache must have q's head_dim 576"),
                                          (448, 448, "q must have head_dim 576 .* or 512")])
def test_dense_head_dims_must_agree(q_d, k_d, match):
    q, k, table, lengths = _case(d=max(q_d, k_d))
    with pytest.raises(ValueError, match=match):
        flash_mla_with_kvcache(q[..., :q_d], k[..., :k_d].contiguous(), table, lengths, 512, get_mla_metadata()[0])


def test_dense_512_refused_with_the_fp8_flag():
    q, k, table, lengths = _case(h_kv=1, h_q=4)
    with pytest.raises(ValueError, match="q must have head_dim 576 with is_fp8_kvcache=True"):
        flash_mla_with_kvcache(q, k, table, lengths, 512, get_mla_metadata()[0], is_fp8_kvcache=True)


def test_metadata_of_one_head_dim_refused_for_another():
    q, k, table, lengths = _case()
    meta = get_mla_metadata()[0]
    flash_mla_with_kvcache(q, k, table, lengths, 512, meta)
    q576 = torch.cat([q, q[..., :64]], -1)
    k576 = torch.cat([k, k[..., :64]], -1)
    with pytest.raises(ValueError, match="head_dim: 512 -> 576"):
        flash_mla_with_kvcache(q576, k576, table, lengths, 512, meta)
    with pytest.raises(ValueError, match="dtype: torch.bfloat16 -> torch.float16"):
        flash_mla_with_kvcache(q.half(), k.half(), table, lengths, 512, meta)


def test_cute_backend_refuses_512_by_name(monkeypatch):
    import mla_cute.api as api

    monkeypatch.setattr(api, "select_backend", lambda device, backend=None: "cute")
    q, k, table, lengths = _case()
    meta = get_mla_metadata()[0]
    with pytest.raises(NotImplementedError, match="q and k_cache: the 'cute' dense kernel reads rows of 576 features"):
        flash_mla_with_kvcache(q, k, table, lengths, 512, meta)
    assert not meta.have_initialized
