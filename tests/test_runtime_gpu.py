"""Runtime on the H200: CUDA graphs, schedules passed per call, metadata reuse rules."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gpu_cases import assert_close_flashmla, make_dense_case, make_sparse_case, poison_allocator, refill_cache

pytestmark = pytest.mark.gpu

OUT_ABS, OUT_REL, OUT_COS = 8e-4, 2.01 / 128, 5e-6
LSE_ABS, LSE_REL = 1e-6, 8.01 / 65536


def reference(q, k_cache, block_table, cache_seqlens, causal):
    import mla_cute

    return mla_cute.flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, 512,
                                           mla_cute.get_mla_metadata()[0], causal=causal, backend="reference")


def check(out, lse, ref):
    assert_close_flashmla("out", out, ref[0], OUT_ABS, OUT_REL, OUT_COS)
    assert_close_flashmla("lse", lse, ref[1], LSE_ABS, LSE_REL)


@pytest.mark.parametrize("s_q,h_q,causal,clusters", [(1, 128, False, 2), (2, 64, True, 1), (2, 128, True, 4)])
def test_cuda_graph_replays_with_new_inputs(s_q, h_q, causal, clusters):
    """A whole decode step (scheduler, split, combine) captured once, replayed on new q, cache and lengths.
    A plan made in a capture is one the host does not know, so the resolver takes pairs where the shape allows
    them; ``clusters=4`` forces the split kernel of 4-CTA clusters there (``experiment``), on a part count the
    schedule sets (no idle-SM fill)."""
    import contextlib

    import mla_cute
    from mla_cute.schedules import DenseDecodeSchedule, experiment

    sched = DenseDecodeSchedule(num_sm_parts=16) if clusters == 4 else DenseDecodeSchedule()
    quads = experiment(lambda c: dataclasses.replace(c, cluster_ctas=4, cross_term_first=True))
    b, max_len = 16, 3000
    case = make_dense_case(b, s_q, 0, h_q, 1, lengths=[max_len] * b)
    q, k_cache, block_table, seqlens = case["q"], case["k_cache"], case["block_table"], case["cache_seqlens"]
    graph = torch.cuda.CUDAGraph()
    with quads if clusters == 4 else contextlib.nullcontext():
        # Compile outside the capture (module loading is not capturable).
        mla_cute.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, mla_cute.get_mla_metadata()[0],
                                        causal=causal, schedule=sched)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            meta, _ = mla_cute.get_mla_metadata()
            out, lse = mla_cute.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, meta, causal=causal,
                                                       schedule=sched)
    call = meta._state["dense"].config
    assert call.step == call.capture_step, "a plan made in a capture runs the capture step"
    assert call.step.split.cluster_ctas == clusters and call.step.with_combine
    assert len(meta._state["dense"].records) == 1

    gen = torch.Generator().manual_seed(3)
    for trial in range(4):
        lens = torch.randint(0, max_len + 1, (b,), generator=gen)
        lens[trial % b] = 0
        lens[(trial + 1) % b] = max_len
        seqlens.copy_(lens.to(torch.int32))
        q.copy_((torch.randn(q.shape, generator=gen) / 10).clamp(-1, 1).to(q.dtype))
        refill_cache(k_cache, block_table, lens, gen)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(out, lse, reference(q, k_cache, block_table, seqlens, causal))


def test_schedule_per_call_and_context_manager():
    """A schedule passed per call plans with its own part count and split policy: the custom one's 37
    parts, the default's FlashMLA rule from the SM count (this short plan takes pairs, so no 4-CTA cap and
    no fill parts); the GPU scheduler's records are the host planner's for that count and policy."""
    import mla_cute
    from mla_cute.schedules import DEFAULT_DENSE_SCHEDULE, num_sm_parts_for, plan_splits

    case = make_dense_case(6, 2, 1500, 128, 1, varlen=True)
    _, s_q, h_q, _ = case["q"].shape
    h_kv = case["k_cache"].shape[2]
    ref = reference(**case, causal=True)
    custom = dataclasses.replace(DEFAULT_DENSE_SCHEDULE, split_fixed_cost=2, num_sm_parts=37)
    sms = torch.cuda.get_device_properties(case["q"].device).multi_processor_count
    flashmla_parts = num_sm_parts_for(sms, s_q, h_q, h_kv)
    assert flashmla_parts != 37, "the two schedules' part counts must differ for the check below to tell them apart"
    for sched in (DEFAULT_DENSE_SCHEDULE, custom):
        poison_allocator()
        meta = mla_cute.get_mla_metadata()[0]
        check(*mla_cute.flash_mla_with_kvcache(**case, head_dim_v=512, tile_scheduler_metadata=meta, causal=True,
                                               schedule=sched), ref)
        parts = 37 if sched is custom else flashmla_parts
        assert meta.tile_scheduler_metadata.shape[0] == parts
        records, splits = plan_splits(case["cache_seqlens"].cpu(), parts, 64, *sched.plan_policy(s_q * (h_q // h_kv)))
        assert torch.equal(meta.tile_scheduler_metadata.cpu(), records)
        assert torch.equal(meta.num_splits.cpu(), splits)
        with pytest.raises(ValueError, match="schedule"):
            other = DEFAULT_DENSE_SCHEDULE if sched is custom else custom
            mla_cute.flash_mla_with_kvcache(**case, head_dim_v=512, tile_scheduler_metadata=meta, causal=True,
                                            schedule=other)
    with mla_cute.use_schedule(custom):
        meta = mla_cute.get_mla_metadata()[0]
        check(*mla_cute.flash_mla_with_kvcache(**case, head_dim_v=512, tile_scheduler_metadata=meta, causal=True), ref)
    assert meta.tile_scheduler_metadata.shape[0] == 37, "the context manager's schedule planned the call"


def test_impossible_schedule_rejected_before_compiling(monkeypatch):
    import mla_cute
    import mla_cute.kernels.build as build
    from mla_cute.schedules import DenseDecodeSchedule

    def unexpected(*args, **kwargs):
        raise AssertionError("a kernel was compiled for a schedule that fails its checks")

    monkeypatch.setattr(build, "compile_dense", unexpected)
    monkeypatch.setattr(build, "compile_scheduler", unexpected)
    case = make_dense_case(2, 1, 100, 64, 1)
    with pytest.raises(ValueError, match="idle_sm_fill_share"):
        mla_cute.flash_mla_with_kvcache(**case, head_dim_v=512, tile_scheduler_metadata=mla_cute.get_mla_metadata()[0],
                                        schedule=DenseDecodeSchedule(idle_sm_fill_share=0))


@pytest.mark.parametrize("h_q,h_kv,s_q,causal", [(128, 1, 1, False), (32, 2, 2, True)])
def test_metadata_reused_across_layers_and_steps(h_q, h_kv, s_q, causal, monkeypatch):
    """A decode loop: one metadata object, a cache per layer, new q each call.  After the first call
    the API replays the checked plan; every call must still match the reference."""
    import mla_cute
    import mla_cute.api as api

    checked = []
    real = api.cute.dense_decode
    monkeypatch.setattr(api.cute, "dense_decode", lambda *args: checked.append(1) or real(*args))

    b, layers = 12, 3
    gen = torch.Generator().manual_seed(5)
    base = make_dense_case(b, s_q, 700, h_q, h_kv, varlen=True, gen=gen)
    block_table, seqlens = base["block_table"], base["cache_seqlens"]
    caches = [base["k_cache"]] + [base["k_cache"].clone() for _ in range(layers - 1)]
    for cache in caches[1:]:
        refill_cache(cache, block_table, seqlens.cpu(), gen)
    meta = mla_cute.get_mla_metadata()[0]
    for step in range(2):
        for layer, cache in enumerate(caches):
            q = (torch.randn(base["q"].shape, generator=gen) / 10).clamp(-1, 1).to(base["q"].dtype).cuda()
            poison_allocator()
            out, lse = mla_cute.flash_mla_with_kvcache(q, cache, block_table, seqlens, 512, meta, causal=causal)
            torch.cuda.synchronize()
            check(out, lse, reference(q, cache, block_table, seqlens, causal))
    assert len(checked) == 1, "only the first call takes the checked path"


@pytest.mark.parametrize("b,topk,lengths_and_sink", [(64, 128, False), (8, 256, True)])
def test_sparse_metadata_reused_across_layers_and_steps(b, topk, lengths_and_sink, monkeypatch):
    """A sparse decode loop: one metadata object per step, a cache per layer, new q, indices and sink
    values each call.  After the first call the API replays the checked plan; every call must still
    match the reference.  b = 64, topk 128: the plan splits nothing (no combine); b = 8, topk 256
    with topk_length: it splits."""
    import mla_cute
    import mla_cute.api as api

    checked = []
    real = api.cute.sparse_decode
    monkeypatch.setattr(api.cute, "sparse_decode", lambda *args: checked.append(1) or real(*args))
    s_q, h_q, layers = 2, 128, 3
    gen = torch.Generator().manual_seed(7)
    extra = {}
    if lengths_and_sink:
        extra["topk_length"] = torch.randint(0, topk + 1, (b,), generator=gen).to(torch.int32).cuda()
        extra["attn_sink"] = torch.empty(h_q, device="cuda")
    for step in range(2):
        meta = mla_cute.get_mla_metadata()[0]
        for layer in range(layers):
            case = make_sparse_case(b, s_q, h_q, 1024, topk, 64, seed=100 * step + layer)
            if lengths_and_sink:
                extra["attn_sink"].copy_(torch.randn(h_q, generator=gen))
            poison_allocator()
            out, lse = mla_cute.flash_mla_with_kvcache(
                block_table=None, cache_seqlens=None, head_dim_v=512, tile_scheduler_metadata=meta,
                is_fp8_kvcache=True, backend="cute", **case, **extra)
            torch.cuda.synchronize()
            ref_out, ref_lse = mla_cute.flash_mla_with_kvcache(
                block_table=None, cache_seqlens=None, head_dim_v=512,
                tile_scheduler_metadata=mla_cute.get_mla_metadata()[0], is_fp8_kvcache=True, backend="reference",
                **case, **extra)
            check(out, lse, (ref_out, ref_lse))
    assert len(checked) == 2, "only each step's first call takes the checked path"
