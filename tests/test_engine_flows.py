"""The engines' call flows, argument for argument as they call FlashMLA (vLLM's FlashMLA dense and sparse
backends and its DeepSeek V4 layer; SGLang's FlashMLA and DSA backends), on the reference backend: metadata made
when the engine makes it and shared by the layers of a step, the engines' views and padded heads, ``out=``, plan
buffers refreshed in place.  Each result is compared with the plain call on fresh metadata.  The same flows inside
CUDA graphs on the cute backend are in ``test_engine_gpu.py``."""

import pytest
import torch

import mla_cute
import mla_cute.flash_mla as flash_mla
import mla_cute.flash_mla_tensors as sgl_flash_mla

LAYERS = 3


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _same(got, want):
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_vllm_flashmla_dense_backend():
    """Metadata made once a step by the metadata builder (arguments ignored), shared by the layers; k_cache
    ``[blocks, 64, 576]`` unsqueezed; speculative decode's s_q 2; causal."""
    g = _gen(1)
    num_decodes, s_q, h_q = 3, 2, 16
    kv_cache = torch.randn(12, 64, 576, generator=g).bfloat16()
    block_table = torch.randperm(12, generator=g).to(torch.int32).view(3, 4)
    for step in range(2):
        seq_lens = torch.randint(s_q, 257, (num_decodes,), generator=g, dtype=torch.int32)
        scheduler_metadata, _ = flash_mla.get_mla_metadata(seq_lens, s_q * h_q, 1, is_fp8_kvcache=False)
        for layer in range(LAYERS):
            q = torch.randn(num_decodes, s_q, h_q, 576, generator=g).bfloat16()
            got = flash_mla.flash_mla_with_kvcache(q=q, k_cache=kv_cache.unsqueeze(-2), block_table=block_table,
                                                   cache_seqlens=seq_lens, head_dim_v=512,
                                                   tile_scheduler_metadata=scheduler_metadata, softmax_scale=0.07,
                                                   causal=True, is_fp8_kvcache=False)
            want = mla_cute.flash_mla_with_kvcache(q, kv_cache.unsqueeze(2), block_table, seq_lens, 512,
                                                   mla_cute.get_mla_metadata()[0], softmax_scale=0.07, causal=True)
            _same(got, want)


def _v32_cache(g, blocks=6):
    """vLLM's ``fp8_ds_mla`` cache: ``[blocks, 64, 656]`` bytes."""
    return mla_cute.quantize_kv_cache((torch.randn(blocks, 64, 1, 576, generator=g) * 0.3).bfloat16()).view(
        torch.uint8).squeeze(2)


@pytest.mark.parametrize("mixed", [False, True])
def test_vllm_flashmla_sparse_backend(mixed):
    """V3.2: heads padded with zeros to 64, a dummy block table ``[max_num_seqs, 1]`` and lengths of
    max_model_len, the cache viewed as bytes and unsqueezed; mixed batches as one request of T query tokens."""
    g = _gen(2)
    real_heads, padded, topk, num_decodes, max_num_seqs = 16, 64, 128, 4, 8
    kv_cache = _v32_cache(g)
    dummy_block_table = torch.zeros(max_num_seqs, 1, dtype=torch.int32)
    cache_lens = torch.full((max_num_seqs,), 4096, dtype=torch.int32)
    b, s_q = (1, num_decodes) if mixed else (num_decodes, 1)
    scheduler_metadata, _ = flash_mla.get_mla_metadata(
        cache_seqlens=cache_lens[:b], num_q_tokens_per_head_k=s_q * padded, topk=topk, num_heads_q=padded,
        num_heads_k=1, is_fp8_kvcache=True)
    for layer in range(LAYERS):
        q = torch.zeros(b, s_q, padded, 576).bfloat16()
        q[:, :, :real_heads] = torch.randn(b, s_q, real_heads, 576, generator=g).bfloat16()
        indices = torch.randint(-1, 6 * 64, (b, s_q, topk), generator=g, dtype=torch.int32)
        out, lse = flash_mla.flash_mla_with_kvcache(
            q=q, k_cache=kv_cache.view(torch.uint8).unsqueeze(-2), block_table=dummy_block_table, head_dim_v=512,
            cache_seqlens=cache_lens, tile_scheduler_metadata=scheduler_metadata, is_fp8_kvcache=True,
            indices=indices, softmax_scale=0.05)
        want = mla_cute.flash_mla_with_kvcache(q, kv_cache.unsqueeze(2), None, None, 512,
                                               mla_cute.get_mla_metadata()[0], softmax_scale=0.05,
                                               is_fp8_kvcache=True, indices=indices)
        _same((out, lse), want)
        assert out[:, :, :real_heads].shape == (b, s_q, real_heads, 512)


def test_vllm_flashmla_sparse_prefill():
    g = _gen(3)
    num_tokens, h_q, topk = 5, 64, 96
    kv = torch.randn(300, 576, generator=g).bfloat16()
    q = torch.randn(num_tokens, h_q, 576, generator=g).bfloat16()
    topk_indices = torch.randint(-1, 300, (num_tokens, topk), generator=g, dtype=torch.int32)
    got = flash_mla.flash_mla_sparse_fwd(q, kv.view(-1, 1, 576), topk_indices.view(num_tokens, 1, -1), 0.06)[0]
    want = mla_cute.flash_mla_sparse_fwd(q, kv.unsqueeze(1), topk_indices.unsqueeze(1), 0.06)[0]
    assert torch.equal(got, want)


def _v4_cache(g, blocks, page):
    """A V4 cache as vLLM holds it: ``[blocks, page, 584]`` bytes (page-blocked), unsqueezed for the call."""
    return mla_cute.quantize_kv_cache((torch.randn(blocks, page, 1, 512, generator=g) * 0.3).bfloat16(),
                                      "V4").view(torch.uint8).squeeze(2)


@pytest.mark.parametrize("swa_only", [False, True])
def test_vllm_deepseek_v4_layer(swa_only):
    """One metadata object a layer type a step, shared by its layers; q ``[T, 1, 64, 512]``; the window cache
    (page 64) and the compressed one (page 256) as bytes, unsqueezed; the sink padded with -inf; ``out`` a view of
    the layer's output."""
    g = _gen(4)
    T, heads, window, topk = 4, 64, 128, 64
    swa_cache, kv_cache = _v4_cache(g, 4, 64), _v4_cache(g, 2, 256)
    attn_sink = torch.full((heads,), float("-inf"))
    attn_sink[:40] = torch.randn(40, generator=g)
    tile_metadata = flash_mla.get_mla_metadata()[0]
    for layer in range(LAYERS):
        q = torch.randn(T, heads, 512, generator=g).bfloat16()
        swa_indices = torch.randint(-1, 4 * 64, (T, 1, window), generator=g, dtype=torch.int32)
        swa_lens = torch.tensor([window, 3, 0, 77], dtype=torch.int32)
        topk_indices = None if swa_only else torch.randint(-1, 2 * 256, (T, 1, topk), generator=g, dtype=torch.int32)
        topk_lens = None if swa_only else torch.tensor([topk, 1, 20, 0], dtype=torch.int32)
        output = torch.full((T, heads, 512), float("nan")).bfloat16()
        got = flash_mla.flash_mla_with_kvcache(
            q=q.unsqueeze(1), k_cache=swa_cache.unsqueeze(-2), block_table=None, head_dim_v=512,
            tile_scheduler_metadata=tile_metadata, cache_seqlens=None, is_fp8_kvcache=True, indices=swa_indices,
            topk_length=swa_lens, softmax_scale=0.04, attn_sink=attn_sink,
            extra_k_cache=kv_cache.unsqueeze(-2) if not swa_only else None, extra_indices_in_kvcache=topk_indices,
            extra_topk_length=topk_lens, out=output.unsqueeze(1))
        assert got[0].data_ptr() == output.data_ptr()
        extra = {} if swa_only else dict(extra_k_cache=kv_cache.unsqueeze(2), extra_indices_in_kvcache=topk_indices,
                                         extra_topk_length=topk_lens)
        want = mla_cute.flash_mla_with_kvcache(q.unsqueeze(1), swa_cache.unsqueeze(2), None, None, 512,
                                               mla_cute.get_mla_metadata()[0], softmax_scale=0.04,
                                               indices=swa_indices, topk_length=swa_lens, attn_sink=attn_sink,
                                               **extra)
        assert torch.equal(output, want[0].squeeze(1)) and torch.equal(got[1], want[1])


def test_vllm_deepseek_v4_prefill():
    """``flash_mla_sparse_fwd`` over the gathered bf16 rows, d_qk 512, with the sink, lengths and ``out`` a slice
    of the layer's output."""
    g = _gen(5)
    tokens, heads, topk = 6, 64, 80
    kv = torch.randn(200, 512, generator=g).bfloat16()
    q = torch.randn(tokens, heads, 512, generator=g).bfloat16()
    combined = torch.randint(-1, 200, (tokens, topk), generator=g, dtype=torch.int32)
    lens = torch.tensor([80, 1, 0, 40, 79, 3], dtype=torch.int32)
    sink = torch.randn(heads, generator=g)
    output = torch.full((tokens + 2, heads, 512), float("nan")).bfloat16()
    s, e = 1, 1 + tokens
    got = flash_mla.flash_mla_sparse_fwd(q=q, kv=kv.view(-1, 1, q.shape[-1]), indices=combined.unsqueeze(1),
                                         sm_scale=0.05, attn_sink=sink, topk_length=lens, out=output[s:e])
    want = mla_cute.flash_mla_sparse_fwd(q, kv.unsqueeze(1), combined.unsqueeze(1), 0.05, attn_sink=sink,
                                         topk_length=lens)
    assert got[0].data_ptr() == output[s:e].data_ptr() and torch.equal(output[s:e], want[0])
    assert output[0].isnan().all() and output[e:].isnan().all()


def test_sglang_flashmla_dense_backend():
    """SGLang's FlashMLA backend: plan buffers made at the largest batch with lengths of ones, a fresh plan copied
    in before each step (``num_splits`` sliced to the batch); causal; s_q 1."""
    g = _gen(6)
    max_bs, h_q = 8, 16
    kv = torch.randn(40, 64, 1, 576, generator=g).bfloat16()
    mla_buf, splits_buf = sgl_flash_mla.get_mla_metadata(torch.ones(max_bs, dtype=torch.int32), 1 * h_q, 1)
    for bs in (8, 2, 5):
        seq_lens = torch.randint(1, 300, (bs,), generator=g, dtype=torch.int32)
        block_kv_indices = torch.randperm(40, generator=g)[: bs * 5].to(torch.int32).view(bs, 5)
        mla_metadata, num_splits = sgl_flash_mla.get_mla_metadata(seq_lens.to(torch.int32), 1 * h_q, 1)
        mla_buf.copy_(mla_metadata)
        splits_buf[: bs + 1].copy_(num_splits)
        for layer in range(LAYERS):
            q = torch.randn(bs, 1, h_q, 576, generator=g).bfloat16()
            got = sgl_flash_mla.flash_mla_with_kvcache(
                q=q.view(bs, -1, h_q, 576), k_cache=kv.view(-1, 64, 1, 576), block_table=block_kv_indices,
                cache_seqlens=seq_lens.to(torch.int32), head_dim_v=512, tile_scheduler_metadata=mla_buf,
                num_splits=splits_buf[: bs + 1], softmax_scale=0.07, causal=True)
            want = mla_cute.flash_mla_with_kvcache(q, kv, block_kv_indices, seq_lens, 512,
                                                   mla_cute.get_mla_metadata()[0], softmax_scale=0.07, causal=True)
            _same(got, want)


def test_sglang_dsa_flashmla_kv_decode():
    """SGLang's DSA backend (``flashmla_kv``): sgl-kernel's tensor metadata over one entry a token (lengths
    clipped to topk), buffers from the largest token count, ``num_splits`` sliced; a ``[T, 0]`` block table; the
    cache viewed ``[-1, 64, 1, 656]``."""
    g = _gen(7)
    max_tokens, h_q, topk = 8, 16, 128
    kv_cache = _v32_cache(g)
    buf_meta, buf_splits = sgl_flash_mla.get_mla_metadata(
        cache_seqlens=torch.ones(max_tokens, dtype=torch.int32), num_q_tokens_per_head_k=1 * h_q // 1,
        num_heads_k=1, num_heads_q=h_q, is_fp8_kvcache=True, topk=topk)
    for n in (8, 3):
        cache_seqlens = torch.randint(1, 500, (n,), generator=g, dtype=torch.int32).clamp(max=topk)
        meta, splits = sgl_flash_mla.get_mla_metadata(
            cache_seqlens=cache_seqlens, num_q_tokens_per_head_k=1 * h_q // 1, num_heads_k=1, num_heads_q=h_q,
            is_fp8_kvcache=True, topk=topk)
        buf_meta.copy_(meta)
        buf_splits[: n + 1].copy_(splits)
        for layer in range(LAYERS):
            q_all = torch.randn(n, h_q, 576, generator=g).bfloat16()
            indices = torch.randint(-1, 6 * 64, (n, topk), generator=g, dtype=torch.int32).unsqueeze(1)
            got = sgl_flash_mla.flash_mla_with_kvcache(
                q=q_all.view(-1, 1, h_q, 576), k_cache=kv_cache.view(-1, 64, 1, 656), cache_seqlens=cache_seqlens,
                head_dim_v=512, tile_scheduler_metadata=buf_meta, num_splits=buf_splits[: n + 1],
                softmax_scale=0.05, indices=indices, block_table=torch.empty((n, 0), dtype=torch.int32),
                is_fp8_kvcache=True)
            want = mla_cute.flash_mla_with_kvcache(q_all.unsqueeze(1), kv_cache.unsqueeze(2), None, None, 512,
                                                   mla_cute.get_mla_metadata()[0], softmax_scale=0.05,
                                                   is_fp8_kvcache=True, indices=indices)
            _same(got, want)
