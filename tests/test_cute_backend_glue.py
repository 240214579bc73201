"""The cute backend's host code on the CPU, with the compiled kernels replaced by recorders.

The GPU tests cover the kernels; these check what the Python side hands them: the query-row
view, FlashMLA's output shapes, the workspace, the scale, plan reuse and schedule rules.
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

pytestmark = pytest.mark.compile


@pytest.fixture
def recorder(monkeypatch):
    import mla_cute.kernels.build as build

    calls = {"compile": 0, "steps": [], "scheduler": [], "combine": []}

    def compile_dense_decode(dtype, s_q, h_q, h_kv, causal, page, schedule, options="", *, with_combine=False,
                             fill=False):
        calls["compile"] += 1
        calls["static"] = (dtype, s_q, h_q, h_kv, causal, page, schedule)
        calls.setdefault("fill", []).append(fill)
        calls.setdefault("built", []).append((schedule.kv_evict_first, with_combine))
        calls.setdefault("partials", []).append(schedule.partials_16bit)
        calls.setdefault("schedules", []).append(schedule)

        def step(*args):
            calls["steps"].append(args)
            calls["combine"].append(with_combine)

        return step

    def compile_scheduler(fixed_cost, unsplit_slack=0, even_split_slack=0, fill_parts=0, fill_share=16, options=""):
        policy = (fixed_cost, unsplit_slack, even_split_slack) + ((fill_parts, fill_share) if fill_parts else ())
        return lambda seqlens, sched, splits, max_len: calls["scheduler"].append((*policy, sched.shape, splits.shape))

    monkeypatch.setattr(build, "compile_dense_decode", compile_dense_decode)
    monkeypatch.setattr(build, "compile_scheduler", compile_scheduler)
    return calls


def _inputs(b=3, s_q=2, h_q=12, h_kv=2, page=128):
    q = torch.randn(b, s_q, h_q, 576).to(torch.bfloat16)
    k_cache = torch.randn(8, page, h_kv, 576).to(torch.bfloat16)
    block_table = torch.zeros(b, 2, dtype=torch.int32)
    seqlens = torch.tensor([5, 0, 200][:b], dtype=torch.int32)
    return q, k_cache, block_table, seqlens


def test_arguments_handed_to_the_step(recorder):
    from mla_cute.api import get_mla_metadata
    from mla_cute.backends import cute
    from mla_cute.schedules import DEFAULT_DENSE_SCHEDULE

    sched = dataclasses.replace(DEFAULT_DENSE_SCHEDULE, num_sm_parts=5, split_fixed_cost=3)
    q, k_cache, block_table, seqlens = _inputs()
    meta = get_mla_metadata()[0]
    out, lse = cute.dense_decode(q, k_cache, block_table, seqlens, 0.1, True, meta, True, sched)
    assert out.shape == (3, 2, 12, 512) and out.dtype == torch.bfloat16
    assert lse.shape == (3, 12, 2) and lse.dtype == torch.float32 and lse.is_contiguous()
    # The host does not know these lengths here: the kernel for an unknown plan (normal loads).
    assert recorder["static"] == (torch.bfloat16, 2, 12, 2, True, 128, sched.multicast_for_plan(None).for_plan(None))
    assert recorder["scheduler"] == [(*sched.plan_policy(2 * 12 // 2), (5, 8), (4,))]
    (q_rows, k_arg, bt, sl, records, splits, out_arg, lse_arg, o_acc, lse_acc, scale_log2), = recorder["steps"]
    assert out_arg is out and lse_arg is lse and k_arg is k_cache and bt is block_table and sl is seqlens
    assert records is meta.tile_scheduler_metadata and splits is meta.num_splits
    assert o_acc.shape == (3 + 5, 2, 12, 512) and lse_acc.shape == (3 + 5, 2, 12)
    assert math.isclose(scale_log2, 0.1 * math.log2(math.e), rel_tol=1e-12)
    # Row r of KV head h is query token r // group, head h * group + r % group.
    group = 6
    assert q_rows.shape == (3, 2 * group, 2, 576)
    for r in range(2 * group):
        for h in range(2):
            assert torch.equal(q_rows[:, r, h], q[:, r // group, h * group + r % group])


def test_plan_is_reused_and_keeps_its_schedule(recorder):
    from mla_cute.api import get_mla_metadata
    from mla_cute.backends import cute
    from mla_cute.schedules import DEFAULT_DENSE_SCHEDULE, PREFETCH_DENSE_SCHEDULE

    sched = dataclasses.replace(DEFAULT_DENSE_SCHEDULE, num_sm_parts=4)
    q, k_cache, block_table, seqlens = _inputs(h_kv=1)
    meta = get_mla_metadata()[0]
    cute.dense_decode(q, k_cache, block_table, seqlens, 0.1, False, meta, True, sched, seqlens)
    compiled = recorder["compile"]  # the step with the combine, and the split kernel alone (no split here)
    cute.dense_decode(q, k_cache, block_table, seqlens, 0.1, False, meta, False, sched)
    assert compiled == 2 and recorder["compile"] == 2 and len(recorder["scheduler"]) == 1
    assert len(recorder["steps"]) == 2 and recorder["combine"] == [False, False]
    assert recorder["steps"][0][8] is recorder["steps"][1][8], "the split workspace is allocated once"
    with pytest.raises(ValueError, match="schedule"):
        cute.dense_decode(q, k_cache, block_table, seqlens, 0.1, False, meta, False,
                          dataclasses.replace(PREFETCH_DENSE_SCHEDULE, num_sm_parts=4))


@pytest.mark.parametrize("known", [True, False])
def test_idle_sm_fill_step_takes_both_record_tables(recorder, known):
    """A plan of 4-CTA clusters (forced here) runs the fill's step, which takes the clusters' 30 records and the
    fill's 3 as two views of the metadata's table; the step loaded first, for a plan the host does not know (a
    CUDA graph capture), is the fill's too, so a capture loads nothing."""
    from mla_cute.api import get_mla_metadata
    from mla_cute.backends import cute
    from mla_cute.schedules import DenseDecodeSchedule

    sched = DenseDecodeSchedule(multicast_ctas=4)
    q, k_cache, block_table, seqlens = _inputs(b=2, s_q=2, h_q=128, h_kv=1, page=64)
    meta = get_mla_metadata()[0]
    cute.dense_decode(q, k_cache, block_table, seqlens, 0.1, True, meta, True, sched, seqlens if known else None)
    assert recorder["fill"] == ([True, True] if known else [True])
    assert recorder["scheduler"] == [(5, 16, 16, 3, 11, (33, 8), (3,))]
    step_args = recorder["steps"][0]
    clusters, fill, splits = step_args[4:7]
    table = meta.tile_scheduler_metadata
    assert clusters.shape == (30, 8) and fill.shape == (3, 8) and splits is meta.num_splits
    assert clusters.data_ptr() == table.data_ptr() and fill.data_ptr() == table[30:].data_ptr()


def test_h_kv_1_query_rows_are_a_view():
    from mla_cute.backends.cute import query_rows

    q = torch.randn(2, 3, 16, 576).to(torch.bfloat16)
    rows = query_rows(q, 1)
    assert rows.data_ptr() == q.data_ptr() and rows.shape == (2, 48, 1, 576)


@pytest.mark.parametrize("page,fp8,match", [(32, False, "multiple of 64"), (64, True, "FP8 cache")])
def test_unsupported_configurations_raise(page, fp8, match):
    from mla_cute.backends.cute import check_supported

    cache = torch.zeros(2, page, 1, 656 if fp8 else 576, dtype=torch.uint8 if fp8 else torch.bfloat16)
    with pytest.raises(NotImplementedError, match=match):
        check_supported(cache, fp8)


@pytest.fixture
def sparse_recorder(monkeypatch):
    import mla_cute.kernels.build as build

    calls = {"compile": [], "steps": [], "scheduler": [], "combine": [], "topk_length": []}

    def compile_sparse_decode(s_q, h_q, has_sink, schedule, options="", *, with_combine=False, has_topk_length=False):
        calls["compile"].append((s_q, h_q, has_sink, schedule))
        calls["topk_length"].append(has_topk_length)

        def step(*args):
            calls["steps"].append(args)
            calls["combine"].append(with_combine)

        return step

    def compile_scheduler(fixed_cost, unsplit_slack=0, even_split_slack=0, fill_parts=0, fill_share=16, options=""):
        def run(lengths, sched, splits, max_len):
            calls["scheduler"].append(((fixed_cost, unsplit_slack, even_split_slack), lengths.clone(), sched.shape,
                                       splits.shape))

        return run

    monkeypatch.setattr(build, "compile_sparse_decode", compile_sparse_decode)
    monkeypatch.setattr(build, "compile_scheduler", compile_scheduler)
    return calls


def _sparse_inputs(b=3, s_q=2, h_q=128, topk=128, page=64):
    from mla_cute.fp8 import quantize_kv_cache

    q = torch.randn(b, s_q, h_q, 576).to(torch.bfloat16)
    k_cache = quantize_kv_cache(torch.randn(4, page, 1, 576).to(torch.bfloat16))
    indices = torch.randint(-1, 4 * page, (b, s_q, topk), dtype=torch.int32)
    return q, k_cache, indices


def test_sparse_arguments_handed_to_the_step(sparse_recorder):
    from mla_cute.api import get_mla_metadata
    from mla_cute.backends import cute
    from mla_cute.schedules import SparseDecodeSchedule

    sched = SparseDecodeSchedule(num_sm_parts=7, split_fixed_cost=2, small_plan_tiles=0, partials_16bit=False)
    q, k_cache, indices = _sparse_inputs()
    topk_length = torch.tensor([0, 70, 500], dtype=torch.int32)
    sink = torch.zeros(128)
    meta = get_mla_metadata()[0]
    out, lse = cute.sparse_decode(q, k_cache, indices, topk_length, sink, 0.25, meta, True, sched)
    assert out.shape == (3, 2, 128, 512) and out.dtype == torch.bfloat16
    assert lse.shape == (3, 128, 2) and lse.dtype == torch.float32
    assert sparse_recorder["compile"] == [(2, 128, True, sched.for_plan(False))]
    assert sparse_recorder["topk_length"] == [True]  # the kernel that reads the lengths
    policy, lengths, sched_shape, splits_shape = sparse_recorder["scheduler"][0]
    assert policy == sched.plan_policy(2 * 128) == (2, 0, 0) and sched_shape == (7, 8) and splits_shape == (4,)
    assert lengths.tolist() == [1, 70, 128]  # clamped to [1, topk] for the planner
    (qq, cache, idx, tl, records, splits, o, l, o_acc, lse_acc, sk, scale) = sparse_recorder["steps"][0]
    assert cache.dtype == torch.int32 and cache.shape == (4, 64, 164)  # 656-byte rows as words
    assert tl is topk_length and sk is not None and math.isclose(scale, 0.25 * math.log2(math.e))
    assert o_acc.shape == (3 + 7, 1, 2 * 128, 512) and lse_acc.shape == (3 + 7, 1, 2 * 128)
    # Without topk_length every request has topk tokens: the kernel built for that takes None and loads
    # no length; attn_sink must then stay absent.
    meta = get_mla_metadata()[0]
    cute.sparse_decode(q, k_cache, indices, None, None, 0.25, meta, True, sched)
    assert sparse_recorder["steps"][1][3] is None
    assert not any(sparse_recorder["topk_length"][1:])
    assert sparse_recorder["scheduler"][1][1].tolist() == [128, 128, 128]  # the planner's lengths
    with pytest.raises(ValueError, match="attn_sink"):
        cute.sparse_decode(q, k_cache, indices, None, sink, 0.25, meta, False, sched)


@pytest.mark.parametrize("lengths,parts,slack,combine", [
    ([5, 0, 2000], 5, 4, True),  # the 32-block request is split over parts
    ([5, 0, 200], 5, 4, False),  # every request fits one part
    ([4096] * 128, 66, 4, False),  # the dense b = 128, 4K, h_q = 128 benchmark row: two requests a part
    ([4096] * 128, 66, 0, False),
    ([8192] * 128, 66, 4, False),  # two whole requests a part cost 3 blocks more than the payload
    ([8192] * 128, 66, 2, True),
    ([8192] * 128, 66, 0, True),  # FlashMLA's plan splits
])
def test_dense_combine_only_when_the_plan_splits(recorder, lengths, parts, slack, combine):
    """A plan that splits no request leaves the combine out: each part writes its outputs itself.  (The even
    plan is off here: at FlashMLA's payload and above it packs whole requests too.)"""
    from mla_cute.api import get_mla_metadata
    from mla_cute.backends import cute
    from mla_cute.schedules import DEFAULT_DENSE_SCHEDULE, plan_splits

    sched = dataclasses.replace(DEFAULT_DENSE_SCHEDULE, num_sm_parts=parts, unsplit_slack=slack, even_split_slack=0)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    _, num_splits = plan_splits(seqlens, parts, 64, *sched.plan_policy(2 * 12))
    assert bool((num_splits.diff() > 1).any()) == combine
    q, k_cache, block_table, _ = _inputs(b=len(lengths), h_kv=1, page=64)
    cute.dense_decode(q, k_cache, block_table, seqlens, 0.1, False, get_mla_metadata()[0], True, sched, seqlens)
    # Without the lengths on the host (a CUDA graph capture reads none) the combine always runs.
    cute.dense_decode(q, k_cache, block_table, seqlens, 0.1, False, get_mla_metadata()[0], True, sched)
    assert recorder["combine"] == [combine, True]


@pytest.mark.parametrize("lengths,parts,combine", [
    ([8192] * 128, 66, False),  # no request too long for a part: the even plan packs two whole requests a part
    ([16384] * 64, 132, True),  # two even pieces a request
])
def test_dense_even_plan_and_the_combine(recorder, lengths, parts, combine):
    """With ``unsplit_slack=0`` the even plan (at FlashMLA's payload and above) still decides the combine."""
    from mla_cute.api import get_mla_metadata
    from mla_cute.backends import cute
    from mla_cute.schedules import DEFAULT_DENSE_SCHEDULE, plan_facts

    sched = dataclasses.replace(DEFAULT_DENSE_SCHEDULE, num_sm_parts=parts, unsplit_slack=0, kv_evict_first=False)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    assert plan_facts(seqlens, parts, 64, *sched.plan_policy(2 * 12))[0] == combine
    assert plan_facts(seqlens, parts, 64, *dataclasses.replace(sched, even_split_slack=0).plan_policy(24))[0]
    q, k_cache, block_table, _ = _inputs(b=len(lengths), h_kv=1, page=64)
    cute.dense_decode(q, k_cache, block_table, seqlens, 0.1, False, get_mla_metadata()[0], True, sched, seqlens)
    assert recorder["combine"] == [combine]
    assert recorder["scheduler"][0][:3] == sched.plan_policy(24)


def test_sparse_combine_only_when_the_plan_splits(sparse_recorder):
    """Without topk_length every length is topk, so the host knows whether the plan splits; with it
    the lengths live on the device and the combine always runs."""
    from mla_cute.api import get_mla_metadata
    from mla_cute.backends import cute
    from mla_cute.schedules import SparseDecodeSchedule

    q, k_cache, indices = _sparse_inputs(b=3, topk=1024)
    for parts, topk_length, combine in ((3, None, False), (2, None, True),
                                        (3, torch.full((3,), 1024, dtype=torch.int32), True)):
        sched = SparseDecodeSchedule(num_sm_parts=parts)
        cute.sparse_decode(q, k_cache, indices, topk_length, None, 0.25, get_mla_metadata()[0], True, sched)
        assert sparse_recorder["combine"][-1] == combine, (parts, topk_length)


@pytest.mark.parametrize("lengths,parts,evict,combine", [
    ([131072], 66, True, True),  # b = 1, 128K: 32 tiles a part, split
    ([65536] * 2, 66, True, True),  # 32 tiles a part
    ([131072] * 2, 66, False, True),  # 63 tiles a part with evict_first_tiles=48
    ([4096] * 128, 66, False, False),  # two whole requests a part: 128 tiles
    ([1024] * 128, 66, True, False),  # two whole requests a part: 32 tiles
])
def test_evict_first_chosen_per_plan(recorder, lengths, parts, evict, combine):
    """``kv_evict_first=None``: the plan's busiest part decides; without the lengths on the host (a CUDA graph
    capture) the loads stay normal; an explicit value holds for every plan."""
    from mla_cute.api import get_mla_metadata
    from mla_cute.backends import cute
    from mla_cute.schedules import DEFAULT_DENSE_SCHEDULE, plan_facts

    sched = dataclasses.replace(DEFAULT_DENSE_SCHEDULE, num_sm_parts=parts, kv_evict_first=None, evict_first_tiles=48,
                                partials_16bit=False)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    split, busiest = plan_facts(seqlens, parts, 64, *sched.plan_policy(2 * 12))
    assert (split, busiest <= 48) == (combine, evict)
    q, k_cache, block_table, _ = _inputs(b=len(lengths), h_kv=1, page=64)
    meta = get_mla_metadata()[0]
    cute.dense_decode(q, k_cache, block_table, seqlens, 0.1, False, meta, True, sched, seqlens)
    assert recorder["built"][-1] == (evict, combine) and recorder["combine"] == [combine]
    assert meta._state["dense"].kernel_schedule == dataclasses.replace(sched, kv_evict_first=evict, multicast_ctas=2)
    assert meta._state["dense"].schedule is sched  # later calls compare the caller's schedule
    # The kernel a capture needs (normal loads, with the combine) was loaded first in any case.
    assert recorder["built"][0] == (False, True)
    cute.dense_decode(q, k_cache, block_table, seqlens, 0.1, False, get_mla_metadata()[0], True, sched)
    assert recorder["built"][-1] == (False, True) and recorder["combine"][-1]
    for fixed in (False, True):
        cute.dense_decode(q, k_cache, block_table, seqlens, 0.1, False, get_mla_metadata()[0], True,
                          dataclasses.replace(sched, kv_evict_first=fixed), seqlens)
        assert recorder["built"][-1][0] == fixed


def test_precompile_loads_both_entries(recorder, sparse_recorder, monkeypatch):
    """Whether a plan needs the combine is known only at its first call, so precompiling loads both."""
    from mla_cute.backends import cute
    from mla_cute.schedules import DEFAULT_DENSE_SCHEDULE, SparseDecodeSchedule

    cute.precompile_dense(torch.bfloat16, 1, 128, 1, False, 64, dataclasses.replace(DEFAULT_DENSE_SCHEDULE,
                                                                                    kv_evict_first=False,
                                                                                    partials_16bit=False))
    assert recorder["built"] == [(False, True), (False, False)]
    # Evict-first loads chosen per plan (the default), and with them 16-bit partials where a schedule asks for
    # them per plan: the kernels a plan can choose, each with and without the combine (16-bit partials only on
    # plans short enough for evict-first loads).
    cute.precompile_dense(torch.bfloat16, 1, 128, 1, False, 64, DEFAULT_DENSE_SCHEDULE)
    kinds = list(zip(recorder["built"][2:], recorder["partials"][2:]))
    assert kinds == [((False, True), False), ((False, False), False), ((True, True), False), ((True, False), False)]
    del recorder["built"][:], recorder["partials"][:]
    cute.precompile_dense(torch.bfloat16, 1, 128, 1, False, 64,
                          dataclasses.replace(DEFAULT_DENSE_SCHEDULE, partials_16bit=None))
    kinds = list(zip(recorder["built"], recorder["partials"]))
    assert kinds == [((False, True), False), ((False, False), False), ((True, True), False), ((True, False), False),
                     ((True, True), True), ((True, False), True)]
    # s_q = 2, h_q = 128 (four M tiles): also the 4-CTA cluster kernels of long plans (normal loads, fp32 partials),
    # as the idle-SM fill's steps, and the scheduler with its fill parts.
    del recorder["built"][:], recorder["partials"][:], recorder["schedules"][:], recorder["fill"][:]
    import mla_cute.kernels.build as build

    policies = []
    monkeypatch.setattr(build, "compile_scheduler", lambda *policy: policies.append(policy))
    cute.precompile_dense(torch.bfloat16, 2, 128, 1, True, 64, DEFAULT_DENSE_SCHEDULE)
    assert len(recorder["built"]) == 6 and recorder["built"][-2:] == [(False, True), (False, False)]
    assert [s.multicast_ctas for s in recorder["schedules"]] == [2] * 4 + [4] * 2
    assert recorder["fill"] == [False] * 4 + [True] * 2
    assert policies == [(5, 16, 16), (5, 16, 16, 3, 11)]
    del recorder["fill"][:]
    cute.precompile_dense(torch.bfloat16, 2, 128, 1, True, 64, dataclasses.replace(DEFAULT_DENSE_SCHEDULE,
                                                                                   idle_sm_fill=False))
    assert recorder["fill"] == [False] * 6
    cute.precompile_sparse(2, 128, False, SparseDecodeSchedule(small_plan_tiles=0))
    assert [x[3].partials_16bit for x in sparse_recorder["compile"]] == [False, False]
    # The small plans' kernels (16-bit partials) too.
    cute.precompile_sparse(2, 128, False, SparseDecodeSchedule())
    assert [x[3].partials_16bit for x in sparse_recorder["compile"][2:]] == [False, False, True, True]
    # With topk_length the lengths live on the device, so every plan keeps the combine: one entry a plan kind.
    cute.precompile_sparse(2, 128, False, SparseDecodeSchedule(), True)
    assert len(sparse_recorder["compile"]) == 8 and sparse_recorder["topk_length"] == [False] * 6 + [True, True]


def test_sparse_cache_layout_the_kernel_cannot_read():
    from mla_cute.backends import cute

    _, k_cache, _ = _sparse_inputs()
    wide = torch.zeros(4, 64, 1, 672, dtype=torch.uint8)[..., :656]  # rows not packed
    with pytest.raises(NotImplementedError, match="packed"):
        cute.check_sparse_supported(wide)
    cute.check_sparse_supported(k_cache)


def test_sparse_schedule_rules():
    import mla_cute
    from mla_cute.api import _resolve_schedule
    from mla_cute.schedules import DenseDecodeSchedule, SparseDecodeSchedule

    with pytest.raises(ValueError, match="crossover"):
        SparseDecodeSchedule(crossover=1).validate()
    with pytest.raises(ValueError, match="leader_follower must be a bool"):
        SparseDecodeSchedule(leader_follower="yes").validate()
    with pytest.raises(ValueError, match="peer_bulk_copy must be a bool"):
        SparseDecodeSchedule(peer_bulk_copy=0).validate()
    with pytest.raises(ValueError, match="fp16_operands must be a bool"):
        SparseDecodeSchedule(fp16_operands=1).validate()
    with pytest.raises(ValueError, match="shared memory"):
        SparseDecodeSchedule(kv_stages=3).validate()
    with pytest.raises(TypeError, match="SparseDecodeSchedule"):
        _resolve_schedule(DenseDecodeSchedule(), SparseDecodeSchedule)
    x = SparseDecodeSchedule(crossover=True)
    with mla_cute.use_schedule(x), mla_cute.use_schedule(DenseDecodeSchedule(seesaw=False, kv_stages=1)):
        assert _resolve_schedule(None, SparseDecodeSchedule) is x
        assert _resolve_schedule(None, DenseDecodeSchedule).kv_stages == 1
    assert _resolve_schedule(None, SparseDecodeSchedule) == SparseDecodeSchedule()


@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_partials_16bit_rule(kind):
    """16-bit partials leave through the staged epilogue, which only the seesaw (dense) and the
    leader-follower consumers (sparse) have; dense: fp32 by default (FlashMLA's precision), sparse: chosen per
    plan by default; None (per plan) resolved to a bool before a build."""
    from mla_cute.schedules import DenseDecodeSchedule, SparseDecodeSchedule

    cls, other = ((DenseDecodeSchedule, {"seesaw": False}) if kind == "dense"
                  else (SparseDecodeSchedule, {"leader_follower": False}))
    assert cls().partials_16bit is (False if kind == "dense" else None)
    cls(partials_16bit=None, **other).validate()
    cls(partials_16bit=True).validate()
    cls(partials_16bit=False, **other).validate()
    cls(**other).validate()
    with pytest.raises(ValueError, match="partials_16bit needs"):
        cls(partials_16bit=True, **other).validate()
    for bad in (0, 1, "yes"):
        with pytest.raises(ValueError, match="partials_16bit must be a bool"):
            cls(partials_16bit=bad).validate()
    assert cls(partials_16bit=False).kernel_key() != cls(partials_16bit=True).kernel_key()
    for arg in ((8, None) if kind == "dense" else (True, False)):
        assert cls(partials_16bit=None, **other).for_plan(arg).partials_16bit is False  # never without the epilogue
    counts = "partials_16bit_tiles" if kind == "dense" else "small_plan_tiles"
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match=f"{counts} must be an int >= 0"):
            cls(**{counts: bad}).validate()


@pytest.mark.parametrize("busiest,partials", [(None, False), (1, True), (32, True), (33, False), (200, False)])
def test_dense_partials_chosen_per_plan(busiest, partials):
    """``partials_16bit=None``: 16-bit where the host knows the plan and its busiest part reads at most
    ``partials_16bit_tiles`` tiles; an explicit value (the default's False) holds for every plan."""
    from mla_cute.schedules import DEFAULT_DENSE_SCHEDULE

    assert DEFAULT_DENSE_SCHEDULE.for_plan(busiest).partials_16bit is False
    per_plan = dataclasses.replace(DEFAULT_DENSE_SCHEDULE, partials_16bit=None)
    assert per_plan.for_plan(busiest).partials_16bit is partials
    for fixed in (False, True):
        sched = dataclasses.replace(DEFAULT_DENSE_SCHEDULE, partials_16bit=fixed)
        assert sched.for_plan(busiest).partials_16bit is fixed


def test_dense_plan_takes_the_partials_of_its_kernel(recorder):
    """The workspace holds the dtype of the kernel the plan chose (16-bit partials per plan): 16-bit at b = 1,
    128K (32 tiles a part), fp32 on a plan the host does not know (a capture's) and on a long one."""
    from mla_cute.api import get_mla_metadata
    from mla_cute.backends import cute
    from mla_cute.schedules import DEFAULT_DENSE_SCHEDULE

    sched = dataclasses.replace(DEFAULT_DENSE_SCHEDULE, num_sm_parts=66, partials_16bit=None)
    for lengths, dtype in (([131072], torch.bfloat16), ([131072] * 2, torch.float32)):
        seqlens = torch.tensor(lengths, dtype=torch.int32)
        q, k_cache, block_table, _ = _inputs(b=len(lengths), h_kv=1, page=64)
        meta = get_mla_metadata()[0]
        cute.dense_decode(q, k_cache, block_table, seqlens, 0.1, False, meta, True, sched, seqlens)
        plan = meta._state["dense"]
        assert plan.o_accum.dtype == dtype and plan.kernel_schedule.partials_16bit is (dtype == torch.bfloat16)
        assert recorder["partials"][-1] is (dtype == torch.bfloat16)
        meta = get_mla_metadata()[0]
        cute.dense_decode(q, k_cache, block_table, seqlens, 0.1, False, meta, True, sched)  # lengths not on the host
        assert meta._state["dense"].o_accum.dtype == torch.float32


@pytest.mark.parametrize("b,s_q,h_q,topk,parts,small", [
    (2, 2, 128, 2048, 33, True),  # 3 tiles a part with the fixed cost of 5
    (4, 2, 128, 2048, 33, False),  # 5
    (1, 1, 64, 8192, 132, True),  # 2
    (128, 2, 128, 2048, 33, False),
    (3, 2, 128, 128, 7, True),
    (2, 1, 64, 2048, 132, False),  # one tile a part: nothing to gain
])
def test_sparse_small_plan(sparse_recorder, b, s_q, h_q, topk, parts, small):
    """A small plan (a shape fact) is planned with ``small_plan_fixed_cost`` and, with ``partials_16bit=None``,
    writes 16-bit partials; the workspace holds them."""
    from mla_cute.api import get_mla_metadata
    from mla_cute.backends import cute
    from mla_cute.schedules import SparseDecodeSchedule

    sched = SparseDecodeSchedule(num_sm_parts=parts)
    assert sched.small_plan(b, topk, parts) is small
    q, k_cache, indices = _sparse_inputs(b=b, s_q=s_q, h_q=h_q, topk=topk)
    meta = get_mla_metadata()[0]
    cute.sparse_decode(q, k_cache, indices, None, None, 0.25, meta, True, sched)
    plan = meta._state["sparse"]
    assert plan.schedule is sched and plan.kernel_schedule == sched.for_plan(small)
    assert sparse_recorder["compile"][-1][3].partials_16bit is small
    assert sparse_recorder["scheduler"][-1][0][0] == (1 if small else 5)
    assert plan.o_accum.dtype == (torch.bfloat16 if small else torch.float32)
    # Explicit partials and small plans turned off.
    for kwargs, fixed_cost, dtype in (({"partials_16bit": False}, 1 if small else 5, torch.float32),
                                      ({"small_plan_tiles": 0}, 5, torch.float32),
                                      ({"partials_16bit": True, "small_plan_tiles": 0}, 5, torch.bfloat16)):
        meta = get_mla_metadata()[0]
        cute.sparse_decode(q, k_cache, indices, None, None, 0.25, meta, True,
                           SparseDecodeSchedule(num_sm_parts=parts, **kwargs))
        assert sparse_recorder["scheduler"][-1][0][0] == fixed_cost
        assert meta._state["sparse"].o_accum.dtype == dtype


@pytest.mark.parametrize("field", ["combine_chunked_batch", "combine_spread_partials"])
@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_combine_field_rules(kind, field):
    from mla_cute.schedules import DenseDecodeSchedule, SparseDecodeSchedule

    cls = DenseDecodeSchedule if kind == "dense" else SparseDecodeSchedule
    for good in (0, 1, 4, 1000):
        cls(**{field: good}).validate()
    for bad in (-1, True, 4.0, "4", None):
        with pytest.raises(ValueError, match=f"{field} must be an int >= 0"):
            cls(**{field: bad}).validate()
    assert cls().kernel_key() != cls(**{field: 0}).kernel_key()


@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_combine_pdl_rule(kind):
    """The combine's programmatic dependent launch: a bool, on by default, part of the kernel key."""
    from mla_cute.schedules import DenseDecodeSchedule, SparseDecodeSchedule

    cls = DenseDecodeSchedule if kind == "dense" else SparseDecodeSchedule
    assert cls().combine_pdl is True
    cls(combine_pdl=False).validate()
    for bad in (None, 1, "yes"):
        with pytest.raises(ValueError, match="combine_pdl must be a bool"):
            cls(combine_pdl=bad).validate()
    assert cls().kernel_key() != cls(combine_pdl=False).kernel_key()


@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_split_policy_rules(kind):
    """The planner's fields: ints >= 0 (``num_sm_parts`` >= 1 or None); the slack for whole requests grows
    with the query rows (one unit per 64) and acts on the host plan only, not on the kernel."""
    from mla_cute.schedules import DenseDecodeSchedule, SparseDecodeSchedule

    cls = DenseDecodeSchedule if kind == "dense" else SparseDecodeSchedule
    assert cls().unsplit_slack == cls().even_split_slack == (4 if kind == "dense" else 0)
    for name in ("split_fixed_cost", "unsplit_slack", "even_split_slack"):
        cls(**{name: 0}).validate()
        for bad in (-1, True, 2.0, "3", None):
            with pytest.raises(ValueError, match=f"{name} must be an int >= 0"):
                cls(**{name: bad}).validate()
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="num_sm_parts must be None or an int >= 1"):
            cls(num_sm_parts=bad).validate()
    sched = cls(unsplit_slack=3)
    assert [sched.plan_policy(rows)[1] for rows in (1, 16, 64, 65, 128, 256)] == [3, 3, 3, 6, 6, 12]
    assert cls(unsplit_slack=0).plan_policy(256)[1] == 0
    assert cls(split_fixed_cost=2, unsplit_slack=3, even_split_slack=1).plan_policy(130) == (2, 9, 3)
    assert sched.kernel_key() == cls(unsplit_slack=0, even_split_slack=7).kernel_key()


def test_evict_first_per_plan_rules():
    from mla_cute.schedules import DEFAULT_DENSE_SCHEDULE, SERIAL_DENSE_SCHEDULE, DenseDecodeSchedule

    assert DEFAULT_DENSE_SCHEDULE.kv_evict_first is None  # chosen per plan
    assert SERIAL_DENSE_SCHEDULE.kv_evict_first is False  # the first schedule stays as it was measured
    per_plan = DenseDecodeSchedule(kv_evict_first=None, evict_first_tiles=40)
    per_plan.validate()
    assert per_plan.for_plan(None).kv_evict_first is False
    assert per_plan.for_plan(40).kv_evict_first is True and per_plan.for_plan(41).kv_evict_first is False
    for fixed in (False, True):
        assert DenseDecodeSchedule(kv_evict_first=fixed).for_plan(1).kv_evict_first is fixed
    for bad in (-1, True, 8.0, None):
        with pytest.raises(ValueError, match="evict_first_tiles must be an int >= 0"):
            DenseDecodeSchedule(kv_evict_first=None, evict_first_tiles=bad).validate()
    with pytest.raises(ValueError, match="kv_evict_first must be a bool"):
        DenseDecodeSchedule(kv_evict_first=1).validate()


def test_producer_halves_rule():
    """Producer halves need the bulk hand-over and the leader-follower consumers; by default they are chosen for
    plans that are not small, resolved to a bool before a build, and part of the kernel key."""
    from mla_cute.schedules import SparseDecodeSchedule

    assert SparseDecodeSchedule().producer_halves is None
    assert SparseDecodeSchedule().for_plan(False).producer_halves is True
    assert SparseDecodeSchedule().for_plan(True).producer_halves is False
    for small in (False, True):
        assert SparseDecodeSchedule(producer_halves=True).for_plan(small).producer_halves is True
        assert SparseDecodeSchedule(producer_halves=False).for_plan(small).producer_halves is False
        for other in ({"peer_bulk_copy": False}, {"leader_follower": False}):
            SparseDecodeSchedule(**other).validate()  # None: never chosen without them
            assert SparseDecodeSchedule(**other).for_plan(small).producer_halves is False
    for other in ({"peer_bulk_copy": False}, {"leader_follower": False}):
        with pytest.raises(ValueError, match="producer_halves needs"):
            SparseDecodeSchedule(producer_halves=True, **other).validate()
    for bad in (0, 1, "yes"):
        with pytest.raises(ValueError, match="producer_halves must be a bool"):
            SparseDecodeSchedule(producer_halves=bad).validate()
    off, on = SparseDecodeSchedule(producer_halves=False), SparseDecodeSchedule(producer_halves=True)
    assert off.kernel_key() != on.kernel_key()


def test_sparse_consumer_split_is_a_schedule_field():
    """The leader-follower consumer is the default; the serial one compiles to another kernel."""
    from mla_cute.schedules import DEFAULT_SPARSE_SCHEDULE, SERIAL_SPARSE_SCHEDULE, SparseDecodeSchedule

    assert DEFAULT_SPARSE_SCHEDULE.leader_follower and DEFAULT_SPARSE_SCHEDULE.crossover
    assert not SERIAL_SPARSE_SCHEDULE.leader_follower and SERIAL_SPARSE_SCHEDULE.crossover
    assert DEFAULT_SPARSE_SCHEDULE.kernel_key() != SERIAL_SPARSE_SCHEDULE.kernel_key()
    assert DEFAULT_SPARSE_SCHEDULE.peer_bulk_copy
    assert SparseDecodeSchedule(peer_bulk_copy=False).kernel_key() != DEFAULT_SPARSE_SCHEDULE.kernel_key()
    assert DEFAULT_SPARSE_SCHEDULE.fp16_operands
    assert SparseDecodeSchedule(fp16_operands=False).kernel_key() != DEFAULT_SPARSE_SCHEDULE.kernel_key()
    SparseDecodeSchedule(crossover=False, leader_follower=False).validate()


def test_dense_schedule_rules():
    """The seesaw is the default; the serial kernel's options are rejected on it, with the way out."""
    import dataclasses

    from mla_cute.schedules import (DEFAULT_DENSE_SCHEDULE, SEESAW_DENSE_SCHEDULE, SERIAL_DENSE_SCHEDULE,
                                    DenseDecodeSchedule)

    assert DenseDecodeSchedule() == DEFAULT_DENSE_SCHEDULE == SEESAW_DENSE_SCHEDULE
    assert DEFAULT_DENSE_SCHEDULE.seesaw and not SERIAL_DENSE_SCHEDULE.seesaw
    assert DEFAULT_DENSE_SCHEDULE.kernel_key() != SERIAL_DENSE_SCHEDULE.kernel_key()
    for bad, what in ((dict(kv_stages=3), "kv_stages == 2"), (dict(kv_stages=1), "kv_stages == 2"),
                      (dict(qk_prefetch=True), "qk_prefetch")):
        with pytest.raises(ValueError, match=what) as err:
            DenseDecodeSchedule(**bad).validate()
        assert "seesaw=False" in str(err.value)
        if bad != dict(kv_stages=3):  # the serial kernel takes these
            dataclasses.replace(SERIAL_DENSE_SCHEDULE, **bad).validate()
    with pytest.raises(ValueError, match="shared memory"):
        DenseDecodeSchedule(seesaw=False, kv_stages=3).validate()
    with pytest.raises(ValueError, match="seesaw must be a bool"):
        DenseDecodeSchedule(seesaw=1).validate()
    # The cross-term-first order: with one M tile or tile multicast unless set; a seesaw option.
    assert DEFAULT_DENSE_SCHEDULE.cross_term_first_for(1, False) and DEFAULT_DENSE_SCHEDULE.cross_term_first_for(2, True)
    assert not DEFAULT_DENSE_SCHEDULE.cross_term_first_for(2, False)
    for forced in (True, False):
        sched = DenseDecodeSchedule(cross_term_first=forced)
        sched.validate()
        for m_tiles, multicast in ((1, False), (2, True), (4, False)):
            assert sched.cross_term_first_for(m_tiles, multicast) is forced
        assert sched.kernel_key() != DEFAULT_DENSE_SCHEDULE.kernel_key()
    with pytest.raises(ValueError, match="cross_term_first must be a bool"):
        DenseDecodeSchedule(cross_term_first=1).validate()
    with pytest.raises(ValueError, match="seesaw=True"):
        DenseDecodeSchedule(seesaw=False, cross_term_first=True).validate()
    DenseDecodeSchedule(seesaw=False, cross_term_first=False).validate()
    # Tile multicast: by default with 128 query heads a KV head (or a multiple); pairs M tiles that see
    # the same tiles.
    assert DEFAULT_DENSE_SCHEDULE.tile_multicast_for(2, 128, False) and DEFAULT_DENSE_SCHEDULE.tile_multicast_for(4, 128, True)
    assert not DEFAULT_DENSE_SCHEDULE.tile_multicast_for(2, 64, False)
    assert not DEFAULT_DENSE_SCHEDULE.tile_multicast_for(1, 64, False)
    assert not DenseDecodeSchedule(tile_multicast=False).tile_multicast_for(2, 128, False)
    paired = DenseDecodeSchedule(tile_multicast=True)
    paired.validate()
    assert paired.kernel_key() != DEFAULT_DENSE_SCHEDULE.kernel_key()
    assert paired.tile_multicast_for(2, 128, True) and paired.tile_multicast_for(4, 256, True)
    assert paired.tile_multicast_for(2, 64, False)  # s_q = 2 without causality: the same tiles
    for m_tiles, group, causal in ((1, 64, False), (3, 64, False), (2, 64, True)):
        with pytest.raises(ValueError, match="tile_multicast"):
            paired.tile_multicast_for(m_tiles, group, causal)
    with pytest.raises(ValueError, match="tile_multicast must be a bool"):
        DenseDecodeSchedule(tile_multicast=1).validate()
    with pytest.raises(ValueError, match="seesaw=True"):
        DenseDecodeSchedule(seesaw=False, tile_multicast=True).validate()
    # The load warpgroup: on with the seesaw unless set; a seesaw option.
    assert DEFAULT_DENSE_SCHEDULE.load_warpgroup_on() and not SERIAL_DENSE_SCHEDULE.load_warpgroup_on()
    assert DenseDecodeSchedule(load_warpgroup=True).kernel_key() == DEFAULT_DENSE_SCHEDULE.kernel_key()
    own_warps = DenseDecodeSchedule(load_warpgroup=False)
    own_warps.validate()
    assert not own_warps.load_warpgroup_on() and own_warps.kernel_key() != DEFAULT_DENSE_SCHEDULE.kernel_key()
    with pytest.raises(ValueError, match="load_warpgroup must be a bool"):
        DenseDecodeSchedule(load_warpgroup=1).validate()
    with pytest.raises(ValueError, match="seesaw=True"):
        DenseDecodeSchedule(seesaw=False, load_warpgroup=True).validate()
    DenseDecodeSchedule(seesaw=False, load_warpgroup=False).validate()
    # Q, two 64 x 576 tiles, one P and the row buffers fit a Hopper CTA.
    assert 225 * 1024 < SEESAW_DENSE_SCHEDULE.smem_bytes() <= 232448


def test_quad_multicast_schedule_and_part_count():
    """``multicast_ctas=4``: four M tiles a cluster where a KV head has a multiple of four (else pairs), only
    with the load warpgroup; the plan then has at most as many parts as 4-CTA clusters run at once."""
    from mla_cute.backend import HOPPER_CLUSTER_SLOTS, dense_num_parts
    from mla_cute.schedules import DEFAULT_DENSE_SCHEDULE, DenseDecodeSchedule

    quad = DenseDecodeSchedule(multicast_ctas=4)
    quad.validate()
    assert quad.kernel_key() != DEFAULT_DENSE_SCHEDULE.kernel_key()
    for bad in (1, 3, 8, 4.0, "4", True):
        with pytest.raises(ValueError, match="multicast_ctas must be 2, 4 or None"):
            DenseDecodeSchedule(multicast_ctas=bad).validate()
    with pytest.raises(ValueError, match="multicast_ctas=4 needs the load warpgroup"):
        DenseDecodeSchedule(multicast_ctas=4, load_warpgroup=False).validate()
    # (m_tiles, group, causal) -> CTAs a cluster: default / quad.
    cases = {(4, 128, True): (2, 4), (8, 128, True): (2, 4), (4, 256, False): (2, 4), (2, 128, False): (2, 2),
             (6, 128, True): (2, 2), (4, 64, False): (1, 1), (1, 64, False): (1, 1)}
    for (m_tiles, group, causal), expected in cases.items():
        assert (DEFAULT_DENSE_SCHEDULE.cluster_ctas_for(m_tiles, group, causal),
                quad.cluster_ctas_for(m_tiles, group, causal)) == expected
    assert DenseDecodeSchedule(multicast_ctas=4, tile_multicast=False).cluster_ctas_for(4, 128, True) == 1
    # 4-CTA clusters leave SMs idle: 30 clusters of four on an H200 against 33 parts of FlashMLA's rule.
    cpu = torch.device("cpu")
    assert HOPPER_CLUSTER_SLOTS[4] == 30
    assert dense_num_parts(cpu, DEFAULT_DENSE_SCHEDULE, 2, 128, 1, True) == 33
    assert dense_num_parts(cpu, quad, 2, 128, 1, True) == 30
    assert dense_num_parts(cpu, quad, 4, 128, 1, True) == 15  # two clusters a part
    assert dense_num_parts(cpu, quad, 2, 256, 2, True) == 15  # one cluster a KV head
    assert dense_num_parts(cpu, quad, 1, 128, 1, False) == 66  # pairs
    assert dense_num_parts(cpu, DenseDecodeSchedule(multicast_ctas=4, num_sm_parts=12), 2, 128, 1, True) == 12



def test_cluster_slots_without_the_kernels(monkeypatch):
    """A GPU other than SM90 (the reference backend plans for it as for an H200) is not asked: the driver query
    loads an sm_90a kernel, which such a GPU cannot run."""
    from mla_cute import backend

    def no_query(*args):
        raise AssertionError("the driver was asked")

    monkeypatch.setattr(backend, "_query_cluster_slots", no_query)
    monkeypatch.setattr(backend, "is_sm90", lambda device: False)
    gpu = torch.device("cuda", 0)
    assert [backend.cluster_slots(gpu, c, 226 * 1024, 384) for c in (1, 2, 4)] == [132, 66, 30]

def test_quad_multicast_chosen_per_plan():
    """``multicast_ctas=None`` (the default): 4-CTA clusters where the plan over their parts gives the busiest
    part at least ``quad_multicast_tiles`` tiles, pairs otherwise and for a plan the host does not know."""
    from mla_cute.backend import dense_plan_schedule
    from mla_cute.schedules import plan_facts
    from mla_cute.schedules import DEFAULT_DENSE_SCHEDULE, DenseDecodeSchedule

    default = DEFAULT_DENSE_SCHEDULE
    assert default.multicast_ctas is None and default.quad_multicast_tiles == 290
    assert default.kernel_key() == DenseDecodeSchedule(multicast_ctas=2).kernel_key()
    picks = {None: 2, 0: 2, 289: 2, 290: 4, 10_000: 4}
    for busiest, ctas in picks.items():
        assert default.multicast_for_plan(busiest).multicast_ctas == ctas
    assert DenseDecodeSchedule(load_warpgroup=False).multicast_for_plan(10_000).multicast_ctas == 2
    for fixed in (2, 4):
        assert DenseDecodeSchedule(multicast_ctas=fixed).multicast_for_plan(0).multicast_ctas == fixed
    with pytest.raises(ValueError, match="quad_multicast_tiles must be an int >= 0"):
        DenseDecodeSchedule(quad_multicast_tiles=-1).validate()
    cpu = torch.device("cpu")

    def pick(s_q, h_q, lengths, schedule=default):
        plan = dense_plan_schedule(cpu, schedule, s_q, h_q, 1, s_q > 1, lengths)
        # The facts are those of the plan chosen (its parts, fill parts included), for the kernel's other
        # per-plan choices.
        assert plan.policy[:3] == schedule.plan_policy(s_q * h_q)
        assert plan.facts == (None if lengths is None else plan_facts(lengths, plan.parts, 64, *plan.policy))
        return plan.schedule.multicast_ctas, plan.parts, plan.fill_parts

    # b = 128, s_q = 2: 8K gives a part 546 tiles over 30 clusters (and three fill parts), 4608 307, 4K 273.
    assert pick(2, 128, torch.full((128,), 8192)) == (4, 33, 3)
    assert pick(2, 128, torch.full((128,), 8192), dataclasses.replace(default, idle_sm_fill=False)) == (4, 30, 0)
    assert pick(2, 128, torch.full((128,), 4608)) == (4, 33, 3)
    assert pick(2, 128, torch.full((128,), 4096)) == (2, 33, 0)
    assert pick(2, 128, None) == (2, 33, 0)
    assert pick(1, 128, torch.full((128,), 32768)) == (2, 66, 0)  # two M tiles: pairs only
    assert pick(2, 64, torch.full((128,), 32768)) == (2, 66, 0)  # no multicast at 64 heads
    assert pick(2, 128, torch.full((128,), 8192), dataclasses.replace(default, quad_multicast_tiles=600)) == (2, 33, 0)
    # Forced 4-CTA clusters take the fill without the lengths too (the scheduler kernel plans it).
    assert pick(2, 128, None, DenseDecodeSchedule(multicast_ctas=4)) == (4, 33, 3)


def test_idle_sm_fill_parts(monkeypatch):
    """``dense_fill_parts``: pairs on the SMs a plan of 4-CTA clusters leaves, a part being a pair for each KV
    head and two M tiles; none without 4-CTA clusters, with ``num_sm_parts``, ``idle_sm_fill=False``, or where
    the device holds fewer pairs than half its SMs."""
    from mla_cute import backend
    from mla_cute.backend import dense_fill_parts, dense_plan_schedule
    from mla_cute.schedules import DenseDecodeSchedule

    cpu = torch.device("cpu")
    quad = DenseDecodeSchedule(multicast_ctas=4)
    assert dense_fill_parts(cpu, quad, 2, 128, 1, True, 30) == 3  # 12 idle SMs, 4 a part
    assert dense_fill_parts(cpu, quad, 2, 128, 1, True, 29) == 4
    assert dense_fill_parts(cpu, quad, 4, 128, 1, True, 15) == 1  # 8 M tiles: two clusters a part, 8 SMs a fill part
    assert dense_fill_parts(cpu, quad, 1, 256, 1, False, 30) == 3
    assert dense_fill_parts(cpu, quad, 2, 256, 2, True, 15) == 1
    assert dense_fill_parts(cpu, DenseDecodeSchedule(), 2, 128, 1, True, 33) == 0  # pairs
    assert dense_fill_parts(cpu, quad, 1, 128, 1, False, 66) == 0  # two M tiles: pairs
    assert dense_fill_parts(cpu, dataclasses.replace(quad, idle_sm_fill=False), 2, 128, 1, True, 30) == 0
    assert dense_fill_parts(cpu, dataclasses.replace(quad, num_sm_parts=30), 2, 128, 1, True, 30) == 0
    plan = dense_plan_schedule(cpu, dataclasses.replace(quad, idle_sm_fill_share=9), 2, 128, 1, True)
    assert (plan.parts, plan.fill_parts, plan.policy) == (33, 3, (5, 16, 16, 3, 9))
    # A GPC of an odd SM count: the driver counts fewer pairs than half the SMs.
    monkeypatch.setattr(backend, "cluster_slots", lambda device, ctas, smem, threads: {2: 65, 4: 30}[ctas])
    assert dense_fill_parts(cpu, quad, 2, 128, 1, True, 30) == 0
    for bad in (0, 17, 11.0, True):
        with pytest.raises(ValueError, match="idle_sm_fill_share must be an int from 1 to 16"):
            DenseDecodeSchedule(idle_sm_fill_share=bad).validate()
    with pytest.raises(ValueError, match="idle_sm_fill must be a bool"):
        DenseDecodeSchedule(idle_sm_fill=1).validate()


def test_precompile_sparse_configs(monkeypatch):
    import mla_cute
    from mla_cute.backends import cute
    from mla_cute.schedules import SparseDecodeSchedule

    seen = []
    monkeypatch.setattr(cute, "precompile_sparse", lambda *a: seen.append(a))
    x = SparseDecodeSchedule(crossover=True)
    assert mla_cute.precompile([dict(sparse=True, s_q=2, h_q=128, attn_sink=True)], schedule=x) == 1
    assert seen == [(2, 128, True, x, False)]
    assert mla_cute.precompile([dict(sparse=True, s_q=1, h_q=64, topk_length=True)], schedule=x) == 1
    assert seen[-1] == (1, 64, False, x, True)
    with pytest.raises(ValueError, match="unknown keys"):
        mla_cute.precompile([dict(sparse=True, s_q=2, h_q=128, causal=True)])
    with pytest.raises(ValueError, match="h_q must be an int"):
        mla_cute.precompile([dict(sparse=True, s_q=2, h_q=0)])


def test_misaligned_contiguous_q_is_copied_to_aligned_storage(recorder, sparse_recorder):
    """A contiguous q whose base is off 16 bytes (a view one element in) reaches the kernels as an
    aligned copy: TMA cannot read it in place, and ``contiguous()`` would hand it back unchanged."""
    from mla_cute.api import get_mla_metadata
    from mla_cute.backends import cute
    from mla_cute.schedules import DEFAULT_DENSE_SCHEDULE, SparseDecodeSchedule

    b, s_q, h_q = 3, 2, 16
    flat = torch.randn(b * s_q * h_q * 576 + 8).to(torch.bfloat16)
    q = flat[1:1 + b * s_q * h_q * 576].view(b, s_q, h_q, 576)
    assert q.is_contiguous() and q.data_ptr() % 16 != 0
    _, k_cache, block_table, seqlens = _inputs(b=3, s_q=s_q, h_q=h_q, h_kv=1)
    cute.dense_decode(q, k_cache, block_table, seqlens, 0.1, False, get_mla_metadata()[0], True,
                      DEFAULT_DENSE_SCHEDULE)
    handed = recorder["steps"][0][0]
    assert handed.data_ptr() % 16 == 0 and torch.equal(handed.view(b, s_q, h_q, 576), q)
    _, fp8, indices = _sparse_inputs(b=b, s_q=s_q, h_q=h_q)
    cute.sparse_decode(q, fp8, indices, None, None, 0.1, get_mla_metadata()[0], True, SparseDecodeSchedule())
    handed = sparse_recorder["steps"][0][0]
    assert handed.data_ptr() % 16 == 0 and torch.equal(handed, q)


# ------------------------------------------------------- replay of a checked dense call
def _on_cute(monkeypatch, calls, check: str):
    """The public API routed to the cute backend on CPU tensors, counting the calls of the full path's
    ``validation.<check>`` in ``calls["checks"]``."""
    import mla_cute.api as api

    monkeypatch.setattr(api, "select_backend",
                        lambda device, backend=None: backend or os.environ.get("MLA_CUTE_BACKEND") or "cute")
    real = getattr(api.V, check)
    calls["checks"] = 0

    def counted(*args):
        calls["checks"] += 1
        return real(*args)

    monkeypatch.setattr(api.V, check, counted)
    return calls


@pytest.fixture
def api_on_cute(recorder, monkeypatch):
    return _on_cute(monkeypatch, recorder, "check_dense")


def _call(q, k_cache, block_table, seqlens, meta, **kw):
    import mla_cute

    return mla_cute.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, meta, **kw)


@pytest.mark.parametrize("h_kv", [1, 2])
def test_replay_skips_the_checks_of_an_identical_call(api_on_cute, h_kv):
    from mla_cute.api import get_mla_metadata

    q, k_cache, block_table, seqlens = _inputs(h_kv=h_kv)
    meta = get_mla_metadata()[0]
    _call(q, k_cache, block_table, seqlens, meta, causal=True)
    q2 = torch.randn_like(q)  # another tensor with the same facts: a new decode step
    out, lse = _call(q2, k_cache, block_table, seqlens, meta, causal=True, softmax_scale=0.25)
    _call(q2, k_cache, block_table, seqlens, meta, causal=True, softmax_scale=1)
    assert api_on_cute["checks"] == 1, "later calls replay"
    first, second, third = api_on_cute["steps"]
    assert third[10] == math.log2(math.e)
    assert second[6] is out and second[7] is lse and out.shape == (3, 2, 12, 512) and lse.shape == (3, 12, 2)
    assert all(a is b for a, b in zip(first[1:6] + first[8:10], second[1:6] + second[8:10]))
    assert math.isclose(second[10], 0.25 * math.log2(math.e), rel_tol=1e-12)
    assert torch.equal(second[0], cute_rows(q2, h_kv)), "the replay hands over q2's rows"


def cute_rows(q, h_kv):
    from mla_cute.backends.cute import query_rows

    return query_rows(q, h_kv)


def _changes(q, k_cache, block_table, seqlens):
    """Calls that differ from the checked one in one fact each: all must take the checked path."""
    wide = torch.randn(q.shape[:-1] + (640,)).to(q.dtype)[..., :576]  # other strides
    wide.copy_(q)
    raw = torch.empty(q.numel() * 2 + 8, dtype=torch.uint8)  # same strides, base off 16 bytes
    shifted = raw[8:8 + q.numel() * 2].view(q.dtype).view(q.shape)
    shifted.copy_(q)
    return {
        "q strides": dict(q=wide),
        "q alignment": dict(q=shifted),
        "k_cache blocks": dict(k_cache=torch.cat([k_cache, k_cache[:1]])),
        "block_table width": dict(block_table=torch.zeros(3, 3, dtype=torch.int32)),
        "lengths tensor": dict(seqlens=seqlens.clone()),
    }


@pytest.mark.parametrize("change", ["q strides", "q alignment", "k_cache blocks", "block_table width",
                                    "lengths tensor"])
def test_replay_takes_the_checked_path_when_a_fact_differs(api_on_cute, change):
    from mla_cute.api import get_mla_metadata

    base = dict(zip(("q", "k_cache", "block_table", "seqlens"), _inputs(h_kv=1)))
    meta = get_mla_metadata()[0]
    _call(**base, meta=meta)
    args = {**base, **_changes(**base)[change]}
    _call(**args, meta=meta)
    assert api_on_cute["checks"] == 2
    q_rows = api_on_cute["steps"][-1][0]
    assert torch.equal(q_rows, cute_rows(args["q"], 1)) and q_rows.data_ptr() % 16 == 0
    _call(**args, meta=meta)  # the new facts replay from now on
    assert api_on_cute["checks"] == 2 and len(api_on_cute["steps"]) == 3


@pytest.mark.parametrize("bad,error,match", [
    (dict(softmax_scale=-1.0), ValueError, "softmax_scale"),
    (dict(causal=1), TypeError, "causal"),
    (dict(q="q"), TypeError, "q must be a torch.Tensor"),
    (dict(num_splits=4), ValueError, "num_splits"),
    (dict(schedule="seesaw"), TypeError, "schedule"),
    (dict(schedule=""), TypeError, "schedule"),
])
def test_replay_never_hides_an_error(api_on_cute, bad, error, match):
    from mla_cute.api import get_mla_metadata

    q, k_cache, block_table, seqlens = _inputs(h_kv=1)
    meta = get_mla_metadata()[0]
    _call(q, k_cache, block_table, seqlens, meta)
    args = dict(q=q, k_cache=k_cache, block_table=block_table, seqlens=seqlens)
    args.update({k: v for k, v in bad.items() if k in args})
    with pytest.raises(error, match=match):
        _call(**args, meta=meta, **{k: v for k, v in bad.items() if k not in args})


def test_replay_sees_lengths_written_in_place_and_other_schedules(api_on_cute):
    import mla_cute
    from mla_cute.api import get_mla_metadata
    from mla_cute.schedules import SERIAL_DENSE_SCHEDULE

    q, k_cache, block_table, seqlens = _inputs(h_kv=1)
    meta = get_mla_metadata()[0]
    _call(q, k_cache, block_table, seqlens, meta)
    with pytest.raises(ValueError, match="schedule"):
        _call(q, k_cache, block_table, seqlens, meta, schedule=SERIAL_DENSE_SCHEDULE)
    with mla_cute.use_schedule(SERIAL_DENSE_SCHEDULE), pytest.raises(ValueError, match="schedule"):
        _call(q, k_cache, block_table, seqlens, meta)
    seqlens[0] += 1
    with pytest.raises(ValueError, match="cache_seqlens/topk_length values"):
        _call(q, k_cache, block_table, seqlens, meta)


def test_replay_follows_the_backend_variable(api_on_cute, monkeypatch):
    from mla_cute.api import get_mla_metadata

    q, k_cache, block_table, seqlens = _inputs(h_kv=1)
    meta = get_mla_metadata()[0]
    _call(q, k_cache, block_table, seqlens, meta)
    _call(q, k_cache, block_table, seqlens, meta, backend="cute")
    assert api_on_cute["checks"] == 1 and len(api_on_cute["steps"]) == 2
    monkeypatch.setenv("MLA_CUTE_BACKEND", "reference")
    _call(q, k_cache, block_table, seqlens, meta)
    assert api_on_cute["checks"] == 2 and len(api_on_cute["steps"]) == 2, "the reference ran the third call"
    _call(q, k_cache, block_table, seqlens, meta, backend="cute")  # the argument overrides the variable
    assert api_on_cute["checks"] == 2 and len(api_on_cute["steps"]) == 3


# ------------------------------------------------------ replay of a checked sparse call
@pytest.fixture
def sparse_api_on_cute(sparse_recorder, monkeypatch):
    return _on_cute(monkeypatch, sparse_recorder, "check_sparse_decode")


def _sparse_call(q, k_cache, indices, meta, **kw):
    import mla_cute

    return mla_cute.flash_mla_with_kvcache(q, k_cache, None, None, 512, meta, is_fp8_kvcache=True, indices=indices,
                                           **kw)


@pytest.mark.parametrize("with_lengths_and_sink", [False, True])
def test_sparse_replay_skips_the_checks_of_an_identical_call(sparse_api_on_cute, with_lengths_and_sink):
    from mla_cute.api import get_mla_metadata

    q, k_cache, indices = _sparse_inputs()
    kw = dict(topk_length=torch.tensor([0, 70, 128], dtype=torch.int32), attn_sink=torch.zeros(128)) \
        if with_lengths_and_sink else {}
    meta = get_mla_metadata()[0]
    _sparse_call(q, k_cache, indices, meta, **kw)
    q2, indices2 = torch.randn_like(q), torch.randint_like(indices, -1, 256)  # a new step: same facts
    if with_lengths_and_sink:
        kw["attn_sink"] = torch.ones(128)  # the sink's values are read on every call
    out, lse = _sparse_call(q2, k_cache, indices2, meta, softmax_scale=0.25, **kw)
    assert sparse_api_on_cute["checks"] == 1, "the second call replays"
    first, second = sparse_api_on_cute["steps"]
    assert second[0] is q2 and second[2] is indices2 and second[6] is out and second[7] is lse
    assert all(a is b for a, b in zip(first[3:6] + first[8:10], second[3:6] + second[8:10]))
    assert torch.equal(first[1], second[1]) and second[1].dtype == torch.int32
    assert math.isclose(second[11], 0.25 * math.log2(math.e), rel_tol=1e-12)
    assert (second[10] is kw["attn_sink"]) if with_lengths_and_sink else second[10] is None


def _sparse_changes(q, k_cache, indices):
    """Sparse calls that differ from the checked one in one fact each: all must take the checked path."""
    wide = torch.randn(q.shape[:-1] + (640,)).to(q.dtype)[..., :576]
    wide.copy_(q)
    raw = torch.empty(q.numel() * 2 + 8, dtype=torch.uint8)
    shifted = raw[8:8 + q.numel() * 2].view(q.dtype).view(q.shape)
    shifted.copy_(q)
    strided = torch.empty(indices.shape[:-1] + (2 * indices.shape[-1],), dtype=indices.dtype)[..., ::2]
    strided.copy_(indices)
    return {
        "q strides": dict(q=wide),
        "q alignment": dict(q=shifted),
        "k_cache blocks": dict(k_cache=torch.cat([k_cache, k_cache[:1]])),
        "indices strides": dict(indices=strided),
    }


@pytest.mark.parametrize("change", ["q strides", "q alignment", "k_cache blocks", "indices strides"])
def test_sparse_replay_takes_the_checked_path_when_a_fact_differs(sparse_api_on_cute, change):
    from mla_cute.api import get_mla_metadata

    base = dict(zip(("q", "k_cache", "indices"), _sparse_inputs()))
    meta = get_mla_metadata()[0]
    _sparse_call(**base, meta=meta)
    args = {**base, **_sparse_changes(**base)[change]}
    _sparse_call(**args, meta=meta)
    assert sparse_api_on_cute["checks"] == 2
    step = sparse_api_on_cute["steps"][-1]
    assert step[0].data_ptr() % 16 == 0 and step[2].stride(-1) == 1
    _sparse_call(**args, meta=meta)  # the new facts replay from now on
    assert sparse_api_on_cute["checks"] == 2 and len(sparse_api_on_cute["steps"]) == 3


@pytest.mark.parametrize("bad,error,match", [
    (dict(softmax_scale=-1.0), ValueError, "softmax_scale"),
    (dict(causal=1), TypeError, "causal"),
    (dict(causal=True), ValueError, "causal must be False"),
    (dict(q="q"), TypeError, "q must be a torch.Tensor"),
    (dict(indices="i"), TypeError, "indices must be a torch.Tensor"),
    (dict(is_fp8_kvcache=False), ValueError, "is_fp8_kvcache"),
    (dict(head_dim_v=256), ValueError, "head_dim_v"),
    (dict(attn_sink=torch.zeros(128)), ValueError, "attn_sink must be given on every call"),
    (dict(topk_length=torch.full((3,), 128, dtype=torch.int32)), ValueError, "topk_length must be given on every"),
    (dict(schedule="default"), TypeError, "schedule"),
    (dict(num_splits=4), ValueError, "num_splits"),
])
def test_sparse_replay_never_hides_an_error(sparse_api_on_cute, bad, error, match):
    import mla_cute
    from mla_cute.api import get_mla_metadata

    q, k_cache, indices = _sparse_inputs()
    meta = get_mla_metadata()[0]
    _sparse_call(q, k_cache, indices, meta)
    args = dict(q=q, k_cache=k_cache, indices=indices, is_fp8_kvcache=True, head_dim_v=512)
    args.update(bad)
    with pytest.raises(error, match=match):
        mla_cute.flash_mla_with_kvcache(args.pop("q"), args.pop("k_cache"), None, None, args.pop("head_dim_v"), meta,
                                        **args)


def test_sparse_replay_sees_lengths_written_in_place_schedules_and_the_backend(sparse_api_on_cute, monkeypatch):
    import mla_cute
    from mla_cute.api import get_mla_metadata
    from mla_cute.schedules import SERIAL_SPARSE_SCHEDULE

    q, k_cache, indices = _sparse_inputs()
    lengths = torch.tensor([0, 70, 128], dtype=torch.int32)
    meta = get_mla_metadata()[0]
    _sparse_call(q, k_cache, indices, meta, topk_length=lengths)
    with pytest.raises(ValueError, match="schedule"):
        _sparse_call(q, k_cache, indices, meta, topk_length=lengths, schedule=SERIAL_SPARSE_SCHEDULE)
    with mla_cute.use_schedule(SERIAL_SPARSE_SCHEDULE), pytest.raises(ValueError, match="schedule"):
        _sparse_call(q, k_cache, indices, meta, topk_length=lengths)
    monkeypatch.setenv("MLA_CUTE_BACKEND", "reference")
    steps = len(sparse_api_on_cute["steps"])
    _sparse_call(q, k_cache, indices, meta, topk_length=lengths)
    assert len(sparse_api_on_cute["steps"]) == steps, "the reference ran the call"
    monkeypatch.delenv("MLA_CUTE_BACKEND")
    with pytest.raises(ValueError, match=r"topk_length must be given on every call .* \(first call: given\)"):
        _sparse_call(q, k_cache, indices, meta)
    lengths[1] += 1
    with pytest.raises(ValueError, match="cache_seqlens/topk_length values"):
        _sparse_call(q, k_cache, indices, meta, topk_length=lengths)


# ------------------------------------------------------ inference engines' modes
@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_dense_call_reuse_and_replay_under_inference_mode(api_on_cute, mode):
    """Tensors made under ``torch.inference_mode()`` (no version counter): the first call checks, a reuse with
    the same lengths tensor replays, another lengths tensor with other values is still caught."""
    from mla_cute.api import get_mla_metadata

    with getattr(torch, mode)():
        q, k_cache, block_table, seqlens = _inputs(h_kv=1)
        meta = get_mla_metadata()[0]
        _call(q, k_cache, block_table, seqlens, meta, causal=True)
        _call(torch.randn_like(q), k_cache, block_table, seqlens, meta, causal=True)
        assert api_on_cute["checks"] == 1 and len(api_on_cute["steps"]) == 2, "the second call replays"
        other = seqlens.clone()
        other[0] += 1
        with pytest.raises(ValueError, match="cache_seqlens/topk_length values"):
            _call(q, k_cache, block_table, other, meta, causal=True)
        same = seqlens.clone()  # another tensor with equal values: checked, then replayed
        _call(q, k_cache, block_table, same, meta, causal=True)
        _call(q, k_cache, block_table, same, meta, causal=True)
    assert api_on_cute["checks"] == 3 and len(api_on_cute["steps"]) == 4


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_sparse_call_reuse_and_replay_under_inference_mode(sparse_api_on_cute, mode):
    from mla_cute.api import get_mla_metadata

    with getattr(torch, mode)():
        q, k_cache, indices = _sparse_inputs()
        lengths = torch.tensor([0, 70, 128], dtype=torch.int32)
        meta = get_mla_metadata()[0]
        _sparse_call(q, k_cache, indices, meta, topk_length=lengths)
        _sparse_call(torch.randn_like(q), k_cache, indices, meta, topk_length=lengths)
        assert sparse_api_on_cute["checks"] == 1 and len(sparse_api_on_cute["steps"]) == 2
        other = lengths.clone()
        other[1] -= 1
        with pytest.raises(ValueError, match="cache_seqlens/topk_length values"):
            _sparse_call(q, k_cache, indices, meta, topk_length=other)
