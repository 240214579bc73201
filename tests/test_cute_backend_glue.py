"""The cute backend's host code on the CPU, with the compiled kernels replaced by recorders.

The GPU tests cover the kernels; these check what the Python side hands them: the query-row
view, FlashMLA's output shapes, the workspace, the scale, plan reuse, the kernel configs it
compiles and the schedule fields' rules.  (The resolvers' rules: test_resolve.py.)
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
    """``compile_dense`` and ``compile_scheduler`` replaced: ``compiled`` holds the step configs in the order
    they were asked for, ``schedulers`` the scheduler configs, ``scheduler`` one entry a scheduler run, and
    ``steps`` / ``combine`` the arguments and the config's ``with_combine`` of each step run."""
    import mla_cute.kernels.build as build

    calls = {"compiled": [], "steps": [], "schedulers": [], "scheduler": [], "combine": []}

    def compile_dense(step, options=""):
        calls["compiled"].append(step)

        def run(*args):
            calls["steps"].append(args)
            calls["combine"].append(step.with_combine)

        return run

    def compile_scheduler(config, options=""):
        calls["schedulers"].append(config)
        def run(seqlens, extra, sched, splits, max_len, extra_max):
            assert extra is None and extra_max == 0 and config.lengths == "dense"
            calls["scheduler"].append((config, sched.shape, splits.shape))

        return run

    monkeypatch.setattr(build, "compile_dense", compile_dense)
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
    from mla_cute.schedules import (DEFAULT_DENSE_SCHEDULE, CombineConfig, DenseSplitConfig, DenseStepConfig,
                                    SchedulerConfig)

    sched = dataclasses.replace(DEFAULT_DENSE_SCHEDULE, num_sm_parts=5, split_fixed_cost=3)
    q, k_cache, block_table, seqlens = _inputs()
    meta = get_mla_metadata()[0]
    out, lse = cute.dense_decode(q, k_cache, block_table, seqlens, 0.1, True, meta, True, sched)
    assert out.shape == (3, 2, 12, 512) and out.dtype == torch.bfloat16
    assert lse.shape == (3, 12, 2) and lse.dtype == torch.float32 and lse.is_contiguous()
    # The host does not know these lengths here: the step of an unknown plan (normal loads, the combine); six
    # heads a KV head, one M tile: no cluster, the cross term first.
    split = DenseSplitConfig("bfloat16", 2, 6, 2, True, 128, cluster_ctas=1, cross_term_first=True,
                             evict_first=False)
    assert recorder["compiled"] == [DenseStepConfig(split, CombineConfig("bfloat16", 6, 2, False, 4, 48), True)]
    assert meta._state["dense"].config.step == recorder["compiled"][0]
    # Asked for with the steps (built at once when cold), then run for the plan.
    assert recorder["schedulers"] == [SchedulerConfig(3, 4, 4)] * 2 and sched.plan_policy(2 * 12 // 2) == (3, 4, 4)
    assert recorder["scheduler"] == [(SchedulerConfig(3, 4, 4), (5, 8), (4,))]
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
    from mla_cute.schedules import DEFAULT_DENSE_SCHEDULE

    sched = dataclasses.replace(DEFAULT_DENSE_SCHEDULE, num_sm_parts=4)
    q, k_cache, block_table, seqlens = _inputs(h_kv=1)
    meta = get_mla_metadata()[0]
    cute.dense_decode(q, k_cache, block_table, seqlens, 0.1, False, meta, True, sched, seqlens)
    # The step with the combine (for a capture), then the split kernel alone (no split here).
    assert [step.with_combine for step in recorder["compiled"]] == [True, False]
    # Three short requests: evict-first loads.
    assert recorder["compiled"][1].split == dataclasses.replace(recorder["compiled"][0].split, evict_first=True)
    cute.dense_decode(q, k_cache, block_table, seqlens, 0.1, False, meta, False, sched)
    assert len(recorder["compiled"]) == 2 and len(recorder["scheduler"]) == 1
    assert len(recorder["steps"]) == 2 and recorder["combine"] == [False, False]
    assert recorder["steps"][0][8] is recorder["steps"][1][8], "the split workspace is allocated once"
    with pytest.raises(ValueError, match="schedule"):
        cute.dense_decode(q, k_cache, block_table, seqlens, 0.1, False, meta, False,
                          dataclasses.replace(sched, split_fixed_cost=3))


@pytest.mark.parametrize("known", [True, False])
def test_idle_sm_fill_step_takes_both_record_tables(recorder, known):
    """A plan of 4-CTA clusters (every plan the host knows, here) runs the fill's step, which takes the clusters'
    30 records and the fill's 3 as two views of the metadata's table.  The step loaded first, for a plan the
    host does not know (a CUDA graph capture), is of pairs over one table."""
    from mla_cute.api import get_mla_metadata
    from mla_cute.backends import cute
    from mla_cute.schedules import DenseDecodeSchedule, SchedulerConfig

    sched = DenseDecodeSchedule(quad_multicast_tiles=0)
    q, k_cache, block_table, seqlens = _inputs(b=2, s_q=2, h_q=128, h_kv=1, page=64)
    meta = get_mla_metadata()[0]
    cute.dense_decode(q, k_cache, block_table, seqlens, 0.1, True, meta, True, sched, seqlens if known else None)
    capture = recorder["compiled"][0]
    assert (capture.split.cluster_ctas, capture.fill, capture.with_combine) == (2, False, True)
    table = meta.tile_scheduler_metadata
    step_args = recorder["steps"][0]
    if known:
        (step,) = recorder["compiled"][1:]
        # Two short requests: no split, evict-first loads.
        assert (step.split.cluster_ctas, step.fill, step.with_combine, step.split.evict_first) == (4, True, False, True)
        assert recorder["scheduler"] == [(SchedulerConfig(5, 16, 16, 3, 11), (33, 8), (3,))]
        clusters, fill, splits = step_args[4:7]
        assert clusters.shape == (30, 8) and fill.shape == (3, 8) and splits is meta.num_splits
        assert clusters.data_ptr() == table.data_ptr() and fill.data_ptr() == table[30:].data_ptr()
    else:
        assert len(recorder["compiled"]) == 1
        assert recorder["scheduler"] == [(SchedulerConfig(5, 16, 16), (33, 8), (3,))]
        records, splits = step_args[4:6]
        assert records is table and splits is meta.num_splits and len(step_args) == 11


def test_h_kv_1_query_rows_are_a_view():
    from mla_cute.backends.cute import query_rows

    q = torch.randn(2, 3, 16, 576).to(torch.bfloat16)
    rows = query_rows(q, 1)
    assert rows.data_ptr() == q.data_ptr() and rows.shape == (2, 48, 1, 576)


@pytest.mark.parametrize("page,fp8,match", [(32, False, "multiple of 64"), (64, True, "per-tensor FP8 cache")])
def test_unsupported_configurations_raise(page, fp8, match):
    from mla_cute.backends.cute import check_supported

    cache = torch.zeros(2, page, 1, 576, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
    with pytest.raises(NotImplementedError, match=match):
        check_supported(cache, fp8)


def test_the_656_byte_cache_runs_on_a_plan_of_its_own():
    """Dense decode over the 656-byte cache takes the sparse kernel with a metadata object; a plan given as tensors
    (a dense plan) is refused by name."""
    from mla_cute.backends.cute import check_supported

    cache = torch.zeros(2, 64, 1, 656, dtype=torch.uint8)
    check_supported(cache, True)
    with pytest.raises(NotImplementedError, match="pass a FlashMLASchedMeta"):
        check_supported(cache, True, planned=False)


@pytest.fixture
def sparse_recorder(monkeypatch):
    """``compile_sparse`` and ``compile_scheduler`` replaced: ``compiled`` holds the step configs asked for,
    ``scheduler`` (config, the lengths it plans over, records' shape, splits' shape) of each scheduler run."""
    import mla_cute.kernels.build as build
    from mla_cute.schedules.planner import scheduler_lengths

    calls = {"compiled": [], "steps": [], "schedulers": [], "scheduler": [], "combine": []}

    def compile_sparse(step, options=""):
        calls["compiled"].append(step)

        def run(*args):
            calls["steps"].append(args)
            calls["combine"].append(step.with_combine)

        return run

    def compile_scheduler(config, options=""):
        calls["schedulers"].append(config)

        def run(lengths, extra, sched, splits, max_len, extra_max):
            assert (extra is not None) == (config.lengths == "two_caches")
            planned = scheduler_lengths(config.lengths, lengths, max_len, extra, extra_max)
            calls["scheduler"].append((config, planned, sched.shape, splits.shape))

        return run

    monkeypatch.setattr(build, "compile_sparse", compile_sparse)
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
    from mla_cute.schedules import (CombineConfig, SchedulerConfig, SparseDecodeSchedule, SparseSplitConfig,
                                    SparseStepConfig)

    sched = SparseDecodeSchedule(num_sm_parts=7, split_fixed_cost=2, small_plan_tiles=0)
    q, k_cache, indices = _sparse_inputs()
    topk_length = torch.tensor([0, 70, 500], dtype=torch.int32)
    sink = torch.zeros(128)
    meta = get_mla_metadata()[0]
    out, lse = cute.sparse_decode(q, k_cache, indices, topk_length, sink, 0.25, meta, True, sched)
    assert out.shape == (3, 2, 128, 512) and out.dtype == torch.bfloat16
    assert lse.shape == (3, 128, 2) and lse.dtype == torch.float32
    # Two head tiles: the crossover with producer halves; the kernel that reads the lengths, with the combine.
    split = SparseSplitConfig(2, 128, True, True, crossover=True, producer_halves=True, partials_16bit=False)
    assert sparse_recorder["compiled"] == [SparseStepConfig(split, CombineConfig("bfloat16", 128, 2, True, 4, 48),
                                                            True)]
    config, lengths, sched_shape, splits_shape = sparse_recorder["scheduler"][0]
    assert config == SchedulerConfig(*sched.plan_policy(2 * 128), lengths="topk") == SchedulerConfig(2, 0, 0, lengths="topk")
    assert sched_shape == (7, 8) and splits_shape == (4,)
    assert lengths.tolist() == [1, 70, 128]  # clamped to [1, topk] for the planner
    (qq, cache, idx, tl, x_cache, x_idx, x_len, records, splits, o, l, o_acc, lse_acc, sk, top,
     scale) = sparse_recorder["steps"][0]
    assert top is None  # decode writes no max_logits
    assert x_cache is None and x_idx is None and x_len is None  # one cache
    assert cache.dtype == torch.int32 and cache.shape == (4, 64, 164)  # 656-byte rows as words
    assert tl is topk_length and sk is not None and math.isclose(scale, 0.25 * math.log2(math.e))
    assert o_acc.shape == (3 + 7, 1, 2 * 128, 512) and lse_acc.shape == (3 + 7, 1, 2 * 128)
    # Without topk_length every request has topk tokens: the kernel built for that takes None and loads
    # no length; attn_sink must then stay absent.  Three requests of two tiles on seven parts split none: the
    # step with the combine (for a capture), then the split kernel alone.
    meta = get_mla_metadata()[0]
    cute.sparse_decode(q, k_cache, indices, None, None, 0.25, meta, True, sched)
    assert sparse_recorder["steps"][1][3] is None and sparse_recorder["combine"][1] is False
    no_lengths = SparseSplitConfig(2, 128, False, False, crossover=True, producer_halves=True, partials_16bit=False)
    assert [(s.split, s.with_combine) for s in sparse_recorder["compiled"][1:]] == [(no_lengths, True),
                                                                                     (no_lengths, False)]
    assert sparse_recorder["scheduler"][1][1].tolist() == [128, 128, 128]  # the planner's lengths
    with pytest.raises(ValueError, match="attn_sink"):
        cute.sparse_decode(q, k_cache, indices, None, sink, 0.25, meta, False, sched)


def test_sparse_extra_cache_arguments_handed_to_the_step(sparse_recorder):
    """Two caches: the kernel built for them reads both caches' lengths (the topk ones where a call gives none);
    the planner plans over each request's main tiles and extra tokens, 64 ceil(m / 64) + e."""
    from mla_cute.api import get_mla_metadata
    from mla_cute.backends import cute
    from mla_cute.fp8 import quantize_kv_cache
    from mla_cute.schedules import SparseDecodeSchedule

    sched = SparseDecodeSchedule(num_sm_parts=7, small_plan_tiles=0)
    q, k_cache, indices = _sparse_inputs()
    extra_cache = quantize_kv_cache(torch.randn(3, 32, 1, 576).to(torch.bfloat16))
    extra_idx = torch.randint(-1, 96, (3, 2, 40), dtype=torch.int32)
    extra_len = torch.tensor([40, 0, 7], dtype=torch.int32)
    topk_length = torch.tensor([0, 70, 500], dtype=torch.int32)
    meta = get_mla_metadata()[0]
    cute.sparse_decode(q, k_cache, indices, topk_length, None, 0.25, meta, True, sched, "V32",
                       (extra_cache, "V32", extra_idx, extra_len))
    split = sparse_recorder["compiled"][0].split
    assert split.extra_cache == "V32" and split.has_topk_length and sparse_recorder["compiled"][0].with_combine
    # Main 0 / 70 / 128 (topk) tokens: 0 / 2 / 2 tiles, then 40 / 0 / 7 extra tokens.
    assert sparse_recorder["scheduler"][0][1].tolist() == [40, 128 + 0, 128 + 7]
    step = sparse_recorder["steps"][0]
    assert step[3] is topk_length and step[6] is extra_len and step[5] is extra_idx
    assert step[4].dtype == torch.int32 and step[4].shape == (3, 32, 164)
    # Neither length given: the full ones (made once, shared by plans of the same batch and topk).
    meta = get_mla_metadata()[0]
    cute.sparse_decode(q, k_cache, indices, None, None, 0.25, meta, True, sched, "V32", (extra_cache, "V32", extra_idx, None))
    assert sparse_recorder["scheduler"][1][1].tolist() == [128 + 40] * 3
    step = sparse_recorder["steps"][1]
    assert step[3].tolist() == [128] * 3 and step[6].tolist() == [40] * 3


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
    from mla_cute.schedules import DEFAULT_DENSE_SCHEDULE, SchedulerConfig, plan_facts

    sched = dataclasses.replace(DEFAULT_DENSE_SCHEDULE, num_sm_parts=parts, unsplit_slack=0)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    assert plan_facts(seqlens, parts, 64, *sched.plan_policy(2 * 12))[0] == combine
    assert plan_facts(seqlens, parts, 64, *dataclasses.replace(sched, even_split_slack=0).plan_policy(24))[0]
    q, k_cache, block_table, _ = _inputs(b=len(lengths), h_kv=1, page=64)
    cute.dense_decode(q, k_cache, block_table, seqlens, 0.1, False, get_mla_metadata()[0], True, sched, seqlens)
    assert recorder["combine"] == [combine]
    assert recorder["scheduler"][0][0] == SchedulerConfig(*sched.plan_policy(24))


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
        assert sparse_recorder["compiled"][-1].with_combine == combine


@pytest.mark.parametrize("lengths,parts,evict,combine", [
    ([131072], 66, True, True),  # b = 1, 128K: 32 tiles a part, split
    ([65536] * 2, 66, True, True),  # 32 tiles a part
    ([131072] * 2, 66, False, True),  # 63 tiles a part with evict_first_tiles=48
    ([4096] * 128, 66, False, False),  # two whole requests a part: 128 tiles
    ([1024] * 128, 66, True, False),  # two whole requests a part: 32 tiles
])
def test_evict_first_chosen_per_plan(recorder, lengths, parts, evict, combine):
    """The plan's busiest part decides the loads; without the lengths on the host (a CUDA graph capture) they
    stay normal; ``evict_first_tiles`` 0 or huge holds one choice for every plan."""
    from mla_cute.api import get_mla_metadata
    from mla_cute.backends import cute
    from mla_cute.schedules import DEFAULT_DENSE_SCHEDULE, plan_facts

    sched = dataclasses.replace(DEFAULT_DENSE_SCHEDULE, num_sm_parts=parts, evict_first_tiles=48)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    split, busiest = plan_facts(seqlens, parts, 64, *sched.plan_policy(2 * 12))
    assert (split, busiest <= 48) == (combine, evict)
    q, k_cache, block_table, _ = _inputs(b=len(lengths), h_kv=1, page=64)
    meta = get_mla_metadata()[0]
    cute.dense_decode(q, k_cache, block_table, seqlens, 0.1, False, meta, True, sched, seqlens)
    built = recorder["compiled"][-1]
    assert (built.split.evict_first, built.with_combine) == (evict, combine) and recorder["combine"] == [combine]
    plan = meta._state["dense"]
    assert plan.config.step == built and plan.config.step.split.cluster_ctas == 1  # 24 heads a KV head
    assert plan.schedule is sched  # later calls compare the caller's schedule
    # The step a capture needs (normal loads, with the combine) was loaded first in any case.
    first = recorder["compiled"][0]
    assert first == plan.config.capture_step and (first.split.evict_first, first.with_combine) == (False, True)
    assert recorder["compiled"][1:] == ([] if built == first else [built])
    cute.dense_decode(q, k_cache, block_table, seqlens, 0.1, False, get_mla_metadata()[0], True, sched)
    assert recorder["compiled"][-1] == first and recorder["combine"][-1]
    for tiles, fixed in ((0, False), (10 ** 9, True)):
        meta = get_mla_metadata()[0]
        cute.dense_decode(q, k_cache, block_table, seqlens, 0.1, False, meta, True,
                          dataclasses.replace(sched, evict_first_tiles=tiles), seqlens)
        assert recorder["compiled"][-1] == meta._state["dense"].config.step
        assert recorder["compiled"][-1].split.evict_first is fixed


def test_precompile_loads_both_entries(recorder, sparse_recorder, monkeypatch):
    """Whether a plan needs the combine is known only at its first call, so precompiling loads both; and the
    kernels of every plan the shape can resolve to."""
    from mla_cute.backends import cute
    from mla_cute.schedules import DEFAULT_DENSE_SCHEDULE, SchedulerConfig, SparseDecodeSchedule

    import mla_cute.kernels.build as build

    schedulers = []
    monkeypatch.setattr(build, "compile_scheduler", lambda config, options="": schedulers.append(config))
    cute.precompile_dense(torch.bfloat16, 1, 128, 1, False, 64, DEFAULT_DENSE_SCHEDULE)
    # Pairs (two M tiles), normal and evict-first loads, each with and without the combine.
    kinds = [(s.split.cluster_ctas, s.split.evict_first, s.with_combine, s.fill) for s in recorder["compiled"]]
    assert kinds == [(2, False, True, False), (2, False, False, False), (2, True, True, False), (2, True, False, False)]
    assert {(s.split.dtype, s.split.s_q, s.split.group, s.split.causal, s.split.page) for s in recorder["compiled"]} \
        == {("bfloat16", 1, 128, False, 64)}
    assert schedulers == [SchedulerConfig(5, 8, 8)]
    # s_q = 2, h_q = 128 (four M tiles): also the 4-CTA cluster steps of long plans (both loads) with the
    # idle-SM fill, and the scheduler with its fill parts.
    del recorder["compiled"][:], schedulers[:]
    cute.precompile_dense(torch.bfloat16, 2, 128, 1, True, 64, DEFAULT_DENSE_SCHEDULE)
    kinds = [(s.split.cluster_ctas, s.split.evict_first, s.with_combine, s.fill) for s in recorder["compiled"]]
    assert kinds == [(2, False, True, False), (2, False, False, False), (2, True, True, False),
                     (2, True, False, False), (4, False, True, True), (4, False, False, True),
                     (4, True, True, True), (4, True, False, True)]
    assert all(s.split.causal for s in recorder["compiled"])
    assert schedulers == [SchedulerConfig(5, 16, 16), SchedulerConfig(5, 16, 16, 3, 11)]
    # With num_sm_parts no fill: one scheduler for both cluster sizes.
    del recorder["compiled"][:], schedulers[:]
    cute.precompile_dense(torch.bfloat16, 2, 128, 1, True, 64, dataclasses.replace(DEFAULT_DENSE_SCHEDULE,
                                                                                   num_sm_parts=30))
    assert [s.fill for s in recorder["compiled"]] == [False] * 8 and schedulers == [SchedulerConfig(5, 16, 16)]
    cute.precompile_sparse(2, 128, False, SparseDecodeSchedule(small_plan_tiles=0))
    assert [(s.split.partials_16bit, s.with_combine) for s in sparse_recorder["compiled"]] == [(False, True),
                                                                                               (False, False)]
    # The small plans' kernels (16-bit partials, the producer whole) too.
    cute.precompile_sparse(2, 128, False, SparseDecodeSchedule())
    assert [(s.split.partials_16bit, s.split.producer_halves) for s in sparse_recorder["compiled"][2:]] == [
        (False, True), (False, True), (True, False), (True, False)]
    # With topk_length the lengths live on the device, so every plan keeps the combine: one entry a plan kind.
    cute.precompile_sparse(2, 128, False, SparseDecodeSchedule(), True)
    assert len(sparse_recorder["compiled"]) == 8
    assert [s.split.has_topk_length for s in sparse_recorder["compiled"]] == [False] * 6 + [True, True]
    assert all(s.with_combine for s in sparse_recorder["compiled"][6:])


def test_sparse_cache_layout_the_kernel_cannot_read():
    from mla_cute.backends import cute

    _, k_cache, _ = _sparse_inputs()
    wide = torch.zeros(4, 64, 1, 672, dtype=torch.uint8)[..., :656]  # rows not packed
    with pytest.raises(NotImplementedError, match="packed"):
        cute.check_sparse_supported(wide)
    cute.check_sparse_supported(k_cache)


def test_schedule_kinds_and_use_schedule():
    import mla_cute
    from mla_cute.api import _resolve_schedule
    from mla_cute.schedules import DenseDecodeSchedule, SparseDecodeSchedule

    with pytest.raises(TypeError, match="SparseDecodeSchedule"):
        _resolve_schedule(DenseDecodeSchedule(), SparseDecodeSchedule)
    x = SparseDecodeSchedule(split_fixed_cost=3)
    with mla_cute.use_schedule(x), mla_cute.use_schedule(DenseDecodeSchedule(split_fixed_cost=2)):
        assert _resolve_schedule(None, SparseDecodeSchedule) is x
        assert _resolve_schedule(None, DenseDecodeSchedule).split_fixed_cost == 2
    assert _resolve_schedule(None, SparseDecodeSchedule) == SparseDecodeSchedule()
    # A schedule is validated where a call takes it.
    with pytest.raises(ValueError, match="split_fixed_cost must be an int >= 0"):
        _resolve_schedule(SparseDecodeSchedule(split_fixed_cost=-1), SparseDecodeSchedule)
    with pytest.raises(ValueError, match="idle_sm_fill_share"):
        with mla_cute.use_schedule(DenseDecodeSchedule(idle_sm_fill_share=0)):
            _resolve_schedule(None, DenseDecodeSchedule)


def test_schedule_fields_are_user_intent():
    """The kernels themselves are fixed: a schedule holds the planner's policy and the per-plan thresholds."""
    from mla_cute.schedules import (DEFAULT_DENSE_SCHEDULE, DEFAULT_SPARSE_SCHEDULE, DenseDecodeSchedule,
                                    SparseDecodeSchedule)

    assert DenseDecodeSchedule() == DEFAULT_DENSE_SCHEDULE and SparseDecodeSchedule() == DEFAULT_SPARSE_SCHEDULE
    assert [f.name for f in dataclasses.fields(DenseDecodeSchedule)] == [
        "num_sm_parts", "split_fixed_cost", "unsplit_slack", "even_split_slack", "evict_first_tiles",
        "quad_multicast_tiles", "idle_sm_fill_share", "combine_chunked_batch", "combine_spread_partials",
        "invariant_piece_blocks", "invariant_max_pieces"]
    assert [f.name for f in dataclasses.fields(SparseDecodeSchedule)] == [
        "num_sm_parts", "split_fixed_cost", "unsplit_slack", "even_split_slack", "small_plan_tiles",
        "small_plan_fixed_cost", "combine_chunked_batch", "combine_spread_partials", "invariant_piece_blocks",
        "invariant_max_pieces"]
    DEFAULT_DENSE_SCHEDULE.validate()
    DEFAULT_SPARSE_SCHEDULE.validate()


def test_dense_workspace_holds_fp32_partials(recorder):
    """The dense split kernel writes fp32 partials (FlashMLA's precision) on every plan: short (b = 1, 128K, 32
    tiles a part), long, and one the host does not know (a capture's)."""
    from mla_cute.api import get_mla_metadata
    from mla_cute.backends import cute
    from mla_cute.schedules import DEFAULT_DENSE_SCHEDULE

    sched = dataclasses.replace(DEFAULT_DENSE_SCHEDULE, num_sm_parts=66)
    for lengths, evict in (([131072], True), ([131072] * 2, True), ([1 << 20] * 2, False)):
        seqlens = torch.tensor(lengths, dtype=torch.int32)
        q, k_cache, block_table, _ = _inputs(b=len(lengths), h_kv=1, page=64)
        for host in (seqlens, None):
            meta = get_mla_metadata()[0]
            cute.dense_decode(q, k_cache, block_table, seqlens, 0.1, False, meta, True, sched, host)
            plan = meta._state["dense"]
            assert plan.o_accum.dtype == torch.float32 and plan.lse_accum.dtype == torch.float32
            assert plan.config.step.split.evict_first is (evict and host is not None)


@pytest.mark.parametrize("b,s_q,h_q,topk,parts,small", [
    (2, 2, 128, 2048, 33, True),  # 3 tiles a part with the fixed cost of 5
    (4, 2, 128, 2048, 33, False),  # 5
    (1, 1, 64, 8192, 132, True),  # 2
    (128, 2, 128, 2048, 33, False),
    (3, 2, 128, 128, 7, True),
    (2, 1, 64, 2048, 132, False),  # one tile a part: nothing to gain
])
def test_sparse_small_plan(sparse_recorder, b, s_q, h_q, topk, parts, small):
    """A small plan (a shape fact) is planned with ``small_plan_fixed_cost`` and writes 16-bit partials; the
    workspace holds them."""
    from mla_cute.api import get_mla_metadata
    from mla_cute.backends import cute
    from mla_cute.schedules import SparseDecodeSchedule

    sched = SparseDecodeSchedule(num_sm_parts=parts)
    assert sched.small_plan(b, topk, parts) is small
    q, k_cache, indices = _sparse_inputs(b=b, s_q=s_q, h_q=h_q, topk=topk)
    meta = get_mla_metadata()[0]
    cute.sparse_decode(q, k_cache, indices, None, None, 0.25, meta, True, sched)
    plan = meta._state["sparse"]
    assert plan.schedule is sched and plan.config.step == sparse_recorder["compiled"][-1]
    assert sparse_recorder["compiled"][-1].split.partials_16bit is small
    assert sparse_recorder["scheduler"][-1][0].fixed_cost == (1 if small else 5)
    assert plan.o_accum.dtype == (torch.bfloat16 if small else torch.float32)
    # Another small fixed cost, and small plans turned off.
    for kwargs, fixed_cost, dtype in (({"small_plan_fixed_cost": 2}, 2 if small else 5,
                                       torch.bfloat16 if small else torch.float32),
                                      ({"small_plan_tiles": 0}, 5, torch.float32)):
        meta = get_mla_metadata()[0]
        cute.sparse_decode(q, k_cache, indices, None, None, 0.25, meta, True,
                           SparseDecodeSchedule(num_sm_parts=parts, **kwargs))
        assert sparse_recorder["scheduler"][-1][0].fixed_cost == fixed_cost
        assert meta._state["sparse"].o_accum.dtype == dtype


def _resolved_step(schedule):
    """The step a schedule resolves to for a capture (no lengths on the host)."""
    from mla_cute.schedules import DenseDecodeSchedule, resolve_dense, resolve_sparse

    if isinstance(schedule, DenseDecodeSchedule):
        return resolve_dense(schedule, dtype="bfloat16", s_q=1, h_q=128, h_kv=1, causal=False, page=64).capture_step
    return resolve_sparse(schedule, b=4, s_q=1, h_q=64, topk=2048, has_sink=False, has_topk_length=True).capture_step


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
    off = _resolved_step(cls(**{field: 0})).combine
    assert off != _resolved_step(cls()).combine
    assert getattr(off, field.replace("combine_", "")) == 0


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
    assert _resolved_step(sched) == _resolved_step(cls(unsplit_slack=0, even_split_slack=7))


@pytest.mark.parametrize("kind,names", [("dense", ("evict_first_tiles", "quad_multicast_tiles")),
                                        ("sparse", ("small_plan_tiles", "small_plan_fixed_cost"))])
def test_threshold_field_rules(kind, names):
    from mla_cute.schedules import DenseDecodeSchedule, SparseDecodeSchedule

    cls = DenseDecodeSchedule if kind == "dense" else SparseDecodeSchedule
    for name in names:
        for good in (0, 1, 40, 10 ** 6):
            cls(**{name: good}).validate()
        for bad in (-1, True, 8.0, None, "8"):
            with pytest.raises(ValueError, match=f"{name} must be an int >= 0"):
                cls(**{name: bad}).validate()
    if kind == "dense":
        for good in (1, 11, 16):
            DenseDecodeSchedule(idle_sm_fill_share=good).validate()
        for bad in (0, 17, 11.0, True):
            with pytest.raises(ValueError, match="idle_sm_fill_share must be an int from 1 to 16"):
                DenseDecodeSchedule(idle_sm_fill_share=bad).validate()


def test_cluster_slots_without_the_kernels(monkeypatch):
    """A GPU other than SM90 (the reference backend plans for it as for an H200) is not asked: the driver query
    loads an sm_90a kernel, which such a GPU cannot run."""
    from mla_cute import device
    from mla_cute.schedules import HOPPER

    def no_query(*args):
        raise AssertionError("the driver was asked")

    monkeypatch.setattr(device, "_query_cluster_slots", no_query)
    monkeypatch.setattr(device, "is_sm90", lambda dev: False)
    gpu = torch.device("cuda", 0)
    assert [device.cluster_slots(gpu, c, 226 * 1024, 384) for c in (1, 2, 4)] == [132, 66, 30]
    assert device.num_sms(torch.device("cpu")) == 132
    assert device.device_facts(torch.device("cpu")) == HOPPER
    # Such a GPU plans with its own SM count (an A100's 108) and an H200's cluster counts.
    monkeypatch.setattr(device, "num_sms", lambda dev: 108)
    assert device.device_facts(gpu) == dataclasses.replace(HOPPER, num_sms=108)


def test_precompile_sparse_configs(monkeypatch):
    import mla_cute
    from mla_cute.backends import cute
    from mla_cute.schedules import SparseDecodeSchedule

    seen = []
    monkeypatch.setattr(cute, "precompile_sparse", lambda *a: seen.append(a))
    x = SparseDecodeSchedule(split_fixed_cost=3)
    assert mla_cute.precompile([dict(sparse=True, s_q=2, h_q=128, attn_sink=True)], schedule=x) == 1
    assert seen == [(2, 128, True, x, False, "V32", "")]
    assert mla_cute.precompile([dict(sparse=True, s_q=1, h_q=64, topk_length=True, kv_format="V4", extra_cache=True)],
                               schedule=x) == 1
    assert seen[-1] == (1, 64, False, x, True, "V4", "V4")  # True: an extra cache of the main format
    assert mla_cute.precompile([dict(sparse=True, s_q=1, h_q=64, topk_length=True, kv_format="V41",
                                     extra_cache="V41_FP4")], schedule=x) == 1
    assert seen[-1] == (1, 64, False, x, True, "V41", "V41_FP4")
    with pytest.raises(ValueError, match="precompile config 0: extra_cache must be True, False or a format"):
        mla_cute.precompile([dict(sparse=True, s_q=1, h_q=64, kv_format="V41", extra_cache="V5")])
    with pytest.raises(ValueError, match="extra_cache: the kernel reads an extra cache of the main"):
        mla_cute.precompile([dict(sparse=True, s_q=1, h_q=64, kv_format="V4", extra_cache="V41_FP4")])
    with pytest.raises(ValueError, match="kv_format must be one of"):
        mla_cute.precompile([dict(sparse=True, s_q=2, h_q=128, kv_format="V5")])
    with pytest.raises(NotImplementedError, match="V41_FP4"):
        mla_cute.precompile([dict(sparse=True, s_q=2, h_q=128, kv_format="V41_FP4")])
    with pytest.raises(ValueError, match="unknown keys"):
        mla_cute.precompile([dict(sparse=True, s_q=2, h_q=128, causal=True)])
    with pytest.raises(ValueError, match="h_q must be an int"):
        mla_cute.precompile([dict(sparse=True, s_q=2, h_q=0)])


def test_precompile_prefill_configs(monkeypatch):
    import mla_cute
    from mla_cute.backends import cute

    seen = []
    monkeypatch.setattr(cute, "precompile_sparse_prefill", lambda *a: seen.append(a))
    assert mla_cute.precompile([dict(prefill=True, h_q=32), dict(prefill=True, h_q=128, d_qk=512, attn_sink=True,
                                                                 topk_length=True)]) == 2
    assert seen == [(32, 576, False, False), (128, 512, True, True)]
    with pytest.raises(ValueError, match="unknown keys"):
        mla_cute.precompile([dict(prefill=True, h_q=64, s_q=2)])
    with pytest.raises(ValueError, match="h_q must be an int"):
        mla_cute.precompile([dict(prefill=True, h_q=True)])
    with pytest.raises(ValueError, match="d_qk must be 576 or 512"):
        mla_cute.precompile([dict(prefill=True, h_q=64, d_qk=448)])


def test_precompile_prefill_from_the_fp8_cache(monkeypatch):
    import mla_cute
    from mla_cute.backends import cute

    seen = []
    monkeypatch.setattr(cute, "precompile_sparse_prefill_fp8", lambda *a: seen.append(a))
    monkeypatch.setattr(cute, "precompile_sparse_prefill", lambda *a: pytest.fail("the bf16 kernel"))
    assert mla_cute.precompile([dict(prefill=True, fp8_cache=True, h_q=32, attn_sink=True)]) == 1
    assert seen == [(32, True, False)]
    with pytest.raises(ValueError, match="fp8_cache.*d_qk 576"):
        mla_cute.precompile([dict(prefill=True, fp8_cache=True, h_q=64, d_qk=512)])


def test_prefill_from_the_fp8_cache_resolves_to_the_decode_kernel_serving_whole_tokens():
    """A token is a request of one position: the crossover where the head tiles pair (with producer halves),
    max_logits on, no combine; one part an SM per head tile, never more parts than tokens."""
    from mla_cute.schedules import DeviceFacts, resolve_sparse_prefill_fp8

    call = resolve_sparse_prefill_fp8(s_q=4096, h_q=128, has_sink=True, has_topk_length=False)
    split = call.step.split
    assert call.parts == 66 and not call.step.with_combine
    assert (split.s_q, split.h_q, split.crossover, split.producer_halves, split.max_logits) == (1, 128, True, True, True)
    assert split.has_sink and not split.has_topk_length and not split.partials_16bit
    low = resolve_sparse_prefill_fp8(s_q=4096, h_q=32, has_sink=False, has_topk_length=True)
    assert low.parts == 132 and not low.step.split.crossover and not low.step.split.producer_halves
    assert resolve_sparse_prefill_fp8(s_q=5, h_q=64, has_sink=False, has_topk_length=False).parts == 5
    assert resolve_sparse_prefill_fp8(s_q=4096, h_q=192, has_sink=False, has_topk_length=False,
                                      device=DeviceFacts(num_sms=114)).parts == 38


def test_prefill_from_the_fp8_cache_hands_the_decode_kernel_whole_tokens(sparse_recorder):
    """Each query token a request of one position: q as [s_q, 1, h_q, 576], the cache's rows as int32 words,
    the whole-token plan's records and split counts, out / lse / max_logits as views of the returned tensors,
    max_logits after the sink; no scheduler runs."""
    from mla_cute.backends import cute
    from mla_cute.fp8 import quantize_kv_cache
    from mla_cute.schedules import whole_token_plan

    s_q, h_q, topk = 5, 128, 64
    k_cache = quantize_kv_cache(torch.randn(3, 64, 1, 576).bfloat16())
    q = torch.randn(s_q, h_q, 576).bfloat16()
    indices = torch.randint(-1, 192, (s_q, 1, topk), dtype=torch.int32)
    lengths = torch.tensor([64, 0, 3, 64, 10], dtype=torch.int32)
    out, max_logits, lse = cute.sparse_prefill_fp8(q, k_cache, indices, 0.25, None, lengths)
    assert out.shape == (s_q, h_q, 512) and max_logits.shape == lse.shape == (s_q, h_q)
    (step,) = sparse_recorder["compiled"]
    assert step.split.max_logits and not step.with_combine and sparse_recorder["scheduler"] == []
    (qq, cache, idx, tl, *extra, records, splits, o, l, _, _, sk, top, scale) = sparse_recorder["steps"][0]
    assert extra == [None, None, None]
    assert qq.shape == (s_q, 1, h_q, 576) and torch.equal(qq[:, 0], q)
    assert cache.dtype == torch.int32 and cache.shape == (3, 64, 164)
    assert idx is indices and tl.tolist() == lengths.tolist() and sk is None
    want_records, want_splits = whole_token_plan(s_q, 5)  # 66 parts, never more than the tokens
    assert torch.equal(records, want_records) and torch.equal(splits, want_splits)
    assert o.data_ptr() == out.data_ptr() and o.shape == (s_q, 1, h_q, 512)
    assert l.data_ptr() == lse.data_ptr() and l.shape == (s_q, h_q, 1)
    assert top.data_ptr() == max_logits.data_ptr() and top.shape == (s_q, h_q, 1)
    assert math.isclose(scale, 0.25 * math.log2(math.e), rel_tol=1e-12)


def test_compile_sparse_refuses_max_logits_with_the_combine():
    import dataclasses

    from mla_cute.kernels.build import compile_sparse
    from mla_cute.schedules import resolve_sparse_prefill_fp8

    step = resolve_sparse_prefill_fp8(s_q=8, h_q=64, has_sink=False, has_topk_length=False).step
    with pytest.raises(ValueError, match="max_logits"):
        compile_sparse(dataclasses.replace(step, with_combine=True))


def test_prefill_resolves_parts_per_head_tile():
    """One CTA an SM: parts = SMs / head tiles, never more than the tokens; the config carries what the kernel
    compiles from."""
    from mla_cute.schedules import DeviceFacts, resolve_sparse_prefill

    call = resolve_sparse_prefill(s_q=4096, h_q=128, d_qk=576, has_sink=True, has_topk_length=False)
    assert call.parts == 66 and call.config.h_q == 128 and call.config.has_sink and not call.config.has_topk_length
    assert resolve_sparse_prefill(s_q=4096, h_q=100, d_qk=512, has_sink=False, has_topk_length=True).parts == 66
    assert resolve_sparse_prefill(s_q=4096, h_q=64, d_qk=512, has_sink=False, has_topk_length=False).parts == 132
    assert resolve_sparse_prefill(s_q=7, h_q=16, d_qk=576, has_sink=False, has_topk_length=False).parts == 7
    assert resolve_sparse_prefill(s_q=4096, h_q=192, d_qk=576, has_sink=False, has_topk_length=False,
                                  device=DeviceFacts(num_sms=114)).parts == 38


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
    from mla_cute.schedules import DenseDecodeSchedule

    other = DenseDecodeSchedule(split_fixed_cost=3)
    q, k_cache, block_table, seqlens = _inputs(h_kv=1)
    meta = get_mla_metadata()[0]
    _call(q, k_cache, block_table, seqlens, meta)
    with pytest.raises(ValueError, match="schedule"):
        _call(q, k_cache, block_table, seqlens, meta, schedule=other)
    with mla_cute.use_schedule(other), pytest.raises(ValueError, match="schedule"):
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
    assert second[0] is q2 and second[2] is indices2 and second[9] is out and second[10] is lse
    assert all(a is b for a, b in zip(first[3:9] + first[11:13], second[3:9] + second[11:13]))
    assert torch.equal(first[1], second[1]) and second[1].dtype == torch.int32
    assert math.isclose(second[15], 0.25 * math.log2(math.e), rel_tol=1e-12) and second[14] is None
    assert (second[13] is kw["attn_sink"]) if with_lengths_and_sink else second[13] is None


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
    from mla_cute.schedules import SparseDecodeSchedule

    other = SparseDecodeSchedule(split_fixed_cost=3)
    q, k_cache, indices = _sparse_inputs()
    lengths = torch.tensor([0, 70, 128], dtype=torch.int32)
    meta = get_mla_metadata()[0]
    _sparse_call(q, k_cache, indices, meta, topk_length=lengths)
    with pytest.raises(ValueError, match="schedule"):
        _sparse_call(q, k_cache, indices, meta, topk_length=lengths, schedule=other)
    with mla_cute.use_schedule(other), pytest.raises(ValueError, match="schedule"):
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


def _two_cache_inputs(b=3, s_q=2, h_q=64):
    """DeepSeek V4's call: topk 128 of a page-256 V4 cache and 64 of a page-2 V4 extra cache."""
    from mla_cute import quantize_kv_cache

    q = torch.randn(b, s_q, h_q, 512).to(torch.bfloat16)
    k_cache = quantize_kv_cache(torch.randn(2, 256, 1, 512).to(torch.bfloat16), kv_format="V4")
    extra_cache = quantize_kv_cache(torch.randn(64, 2, 1, 512).to(torch.bfloat16), kv_format="V4")
    indices = torch.randint(-1, 512, (b, s_q, 128), dtype=torch.int32)
    extra = dict(extra_k_cache=extra_cache, extra_indices_in_kvcache=torch.randint(-1, 128, (b, s_q, 64),
                                                                                  dtype=torch.int32),
                 attn_sink=torch.randn(h_q))
    return q, k_cache, indices, extra


@pytest.mark.parametrize("with_extra_lengths", [False, True])
def test_two_cache_replay_skips_the_checks_of_an_identical_call(sparse_api_on_cute, with_extra_lengths):
    from mla_cute.api import get_mla_metadata

    q, k_cache, indices, kw = _two_cache_inputs()
    if with_extra_lengths:
        kw["extra_topk_length"] = torch.tensor([0, 33, 64], dtype=torch.int32)
    meta = get_mla_metadata()[0]
    _sparse_call(q, k_cache, indices, meta, **kw)
    q2, extra2 = torch.randn_like(q), torch.randint_like(kw["extra_indices_in_kvcache"], -1, 128)
    out, lse = _sparse_call(q2, k_cache, indices, meta, **{**kw, "extra_indices_in_kvcache": extra2})
    assert sparse_api_on_cute["checks"] == 1, "the second call replays"
    first, second = sparse_api_on_cute["steps"]
    assert second[0] is q2 and second[5] is extra2 and second[9] is out and second[10] is lse
    assert torch.equal(first[4], second[4]) and second[4].dtype == torch.int32  # the extra cache's words
    if with_extra_lengths:
        assert second[6] is kw["extra_topk_length"]
    else:  # the full lengths the plan made for a call without them
        assert second[6] is first[6] and torch.equal(second[6], torch.full((3,), 64, dtype=torch.int32))
    assert second[13] is kw["attn_sink"]


def test_two_cache_replay_takes_the_checked_path_when_an_extra_fact_differs(sparse_api_on_cute):
    from mla_cute.api import get_mla_metadata

    q, k_cache, indices, kw = _two_cache_inputs()
    kw["extra_topk_length"] = lengths = torch.tensor([0, 33, 64], dtype=torch.int32)
    meta = get_mla_metadata()[0]
    _sparse_call(q, k_cache, indices, meta, **kw)
    bigger = torch.cat([kw["extra_k_cache"], kw["extra_k_cache"][:1]])
    _sparse_call(q, k_cache, indices, meta, **{**kw, "extra_k_cache": bigger})
    assert sparse_api_on_cute["checks"] == 2, "another extra cache shape is checked"
    _sparse_call(q, k_cache, indices, meta, **{**kw, "extra_k_cache": bigger})
    assert sparse_api_on_cute["checks"] == 2, "and replays from then on"
    lengths[1] += 1  # written in place: the checked path reads the values
    with pytest.raises(ValueError, match="other extra_topk_length values"):
        _sparse_call(q, k_cache, indices, meta, **{**kw, "extra_k_cache": bigger})
    lengths[1] -= 1
    with pytest.raises(ValueError, match="extra_topk_length must be given on every call"):
        _sparse_call(q, k_cache, indices, meta, **{**kw, "extra_k_cache": bigger, "extra_topk_length": None})
    with pytest.raises(ValueError, match="another configuration"):  # the extra cache left out
        _sparse_call(q, k_cache, indices, meta, attn_sink=kw["attn_sink"])


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


# ------------------------------------------------------------------ out= (written in place)
def test_dense_out_is_what_the_step_writes_checked_and_replayed(api_on_cute):
    from mla_cute.api import get_mla_metadata

    q, k_cache, block_table, seqlens = _inputs()
    meta = get_mla_metadata()[0]
    buf = torch.empty(5, 2, 12, 512, dtype=q.dtype)  # an engine's buffer, sliced along its first dimension
    for _ in range(2):  # checked, then replayed
        out, _ = _call(q, k_cache, block_table, seqlens, meta, causal=True, out=buf[:3])
        assert out.data_ptr() == buf.data_ptr() and api_on_cute["steps"][-1][6] is out
    assert api_on_cute["checks"] == 1


def test_sparse_out_is_what_the_step_writes_checked_and_replayed(sparse_api_on_cute):
    from mla_cute.api import get_mla_metadata

    q, k_cache, indices, kw = _two_cache_inputs()
    meta = get_mla_metadata()[0]
    for _ in range(2):
        mine = torch.empty(3, 2, 64, 512, dtype=torch.bfloat16)
        out, _ = _sparse_call(q, k_cache, indices, meta, out=mine, **kw)
        assert out is mine and sparse_api_on_cute["steps"][-1][9] is mine
    assert sparse_api_on_cute["checks"] == 1


@pytest.mark.parametrize("bad,match", [
    (lambda: torch.empty(3, 2, 64, 256, dtype=torch.bfloat16), "shape"),
    (lambda: torch.empty(3, 2, 64, 512, dtype=torch.float16), "dtype|float16"),
    (lambda: torch.empty(3, 2, 512, 64, dtype=torch.bfloat16).transpose(2, 3), "contiguous"),
    (lambda: torch.empty(3 * 2 * 64 * 512 + 1, dtype=torch.bfloat16)[1:].view(3, 2, 64, 512), "aligned"),
    (lambda: "out", "torch.Tensor"),
])
def test_out_is_checked_on_every_call_before_any_launch(sparse_api_on_cute, bad, match):
    from mla_cute.api import get_mla_metadata

    q, k_cache, indices, kw = _two_cache_inputs()
    meta = get_mla_metadata()[0]
    _sparse_call(q, k_cache, indices, meta, **kw)  # a replayable plan: the bad out is caught on the replay path too
    steps = len(sparse_api_on_cute["steps"])
    with pytest.raises((ValueError, TypeError), match=match):
        _sparse_call(q, k_cache, indices, meta, out=bad(), **kw)
    assert len(sparse_api_on_cute["steps"]) == steps


# ------------------------------------------------------ plans given as tensors
def test_dense_tensor_plan_is_made_by_the_scheduler_and_handed_to_the_step(recorder):
    from mla_cute.backends import cute
    from mla_cute.schedules import DEFAULT_DENSE_SCHEDULE, SchedulerConfig

    sched = dataclasses.replace(DEFAULT_DENSE_SCHEDULE, num_sm_parts=5, split_fixed_cost=3)
    q, k_cache, block_table, seqlens = _inputs()
    records, splits = cute.plan_dense_tensors(seqlens, 12, 2, sched)
    assert recorder["scheduler"] == [(SchedulerConfig(3, 4, 4), (5, 8), (4,))]
    assert records.shape == (5, 8) and splits.shape == (4,) and records.dtype == splits.dtype == torch.int32
    outs = [cute.dense_decode_given(q, k_cache, block_table, seqlens, 0.1, True, records, splits, sched)
            for _ in range(2)]
    assert len(recorder["compiled"]) == 1 and recorder["combine"] == [True, True]  # the capture step, once
    for (q_rows, k_arg, bt, sl, rec, spl, out_arg, lse_arg, o_acc, lse_acc, scale_log2), (out, lse) in zip(
            recorder["steps"], outs):
        assert rec is records and spl is splits and out_arg is out and lse_arg is lse and k_arg is k_cache
        assert o_acc.shape == (3 + 5, 2, 12, 512) and lse_acc.shape == (3 + 5, 2, 12)  # a call's partials


def test_sparse_tensor_plan_is_made_by_the_scheduler_and_handed_to_the_step(sparse_recorder):
    from mla_cute.backends import cute
    from mla_cute.schedules import DEFAULT_SPARSE_SCHEDULE, sparse_tensor_plan

    sched = dataclasses.replace(DEFAULT_SPARSE_SCHEDULE, num_sm_parts=7)
    q, k_cache, indices = _sparse_inputs()
    records, splits = cute.plan_sparse_tensors(3, 2, 128, 128, sched, q.device)
    config, planned, sched_shape, splits_shape = sparse_recorder["scheduler"][0]
    assert (7, config) == sparse_tensor_plan(sched, b=3, s_q=2, h_q=128, topk=128)
    assert planned.tolist() == [128] * 3 and sched_shape == (7, 8) and splits_shape == (4,)
    sink = torch.zeros(128)
    out, lse = cute.sparse_decode_given(q, k_cache, indices, None, sink, 0.25, records, splits, sched, "V32")
    cute.sparse_decode_given(q, k_cache, indices, None, sink, 0.25, records, splits, sched, "V32")
    assert len(sparse_recorder["compiled"]) == 1 and sparse_recorder["compiled"][0].with_combine
    (qq, cache, idx, tl, x_cache, x_idx, x_len, rec, spl, o, l, o_acc, lse_acc, sk, top, scale) = \
        sparse_recorder["steps"][0]
    assert rec is records and spl is splits and o is out and l is lse and idx is indices and sk is sink
    assert tl is None and x_cache is None and top is None and cache.dtype == torch.int32
    assert o_acc.shape[0] == 3 + 7 and lse_acc.shape[0] == 3 + 7


def test_full_lengths_inside_a_capture_are_the_graphs_own():
    """Lengths made for a call that passes none: shared outside a CUDA graph capture (read at once), a fresh tensor
    inside one (the graph reads it on every replay; a shared one could be dropped from the cache and freed)."""
    from mla_cute.backends import cute

    shared = cute.full_lengths(5, 77, torch.device("cpu"), False)
    assert cute.full_lengths(5, 77, torch.device("cpu"), False) is shared
    inside = cute.full_lengths(5, 77, torch.device("cpu"), True)
    assert inside is not shared and inside.tolist() == [77] * 5
    assert cute.full_lengths(5, 77, torch.device("cpu"), True) is not inside


def test_strided_tables_and_lengths_reach_the_dense_kernels_packed(recorder):
    """A transposed block table and a strided lengths view (the kernels' signatures take a unit column stride and
    packed lengths) are handed over as copies with the same values, to the scheduler and to the step, on the first
    call and on a replay of its plan."""
    from mla_cute.api import get_mla_metadata
    from mla_cute.backends import cute
    from mla_cute.schedules import DEFAULT_DENSE_SCHEDULE

    q, k_cache, _, _ = _inputs(h_kv=1)
    table = torch.tensor([[3, 0, 6], [1, 4, 7]], dtype=torch.int32).t()  # [b, 2], column-major
    lengths = torch.tensor([5, -1, 0, -1, 200, -1], dtype=torch.int32)[::2]
    assert table.stride(-1) != 1 and lengths.stride(0) != 1
    meta = get_mla_metadata()[0]
    cute.dense_decode(q, k_cache, table, lengths, 0.1, False, meta, True, DEFAULT_DENSE_SCHEDULE)
    plan = meta._state["dense"]
    cute.replay_dense(plan, q, k_cache, table, lengths, meta, 0.1)
    for step in recorder["steps"]:
        bt, sl = step[2], step[3]
        assert bt.stride(-1) == 1 and sl.stride(0) == 1
        assert torch.equal(bt, table) and torch.equal(sl, lengths)
