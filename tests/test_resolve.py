"""The resolvers (``schedules/resolve.py``): from a schedule, the call's shapes, the host's lengths and the
device's facts to frozen kernel configs and the plan's parts and policy.  Pure CPU.

The plans' busiest parts are read here from ``plan_splits``' records (``_busiest``), not from
``plan_facts``, which the resolvers use.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from mla_cute.schedules import (DEFAULT_DENSE_SCHEDULE, DEFAULT_SPARSE_SCHEDULE, HOPPER, CombineConfig,
                                DenseDecodeSchedule, DenseSplitConfig, DenseStepConfig, DeviceFacts,
                                SchedulerConfig, SparseDecodeSchedule, SparseSplitConfig, SparseStepConfig,
                                dense_precompile_steps, experiment, m_tiles_for, plan_splits, resolve_dense,
                                resolve_sparse, sparse_precompile_steps)
from mla_cute.schedules.resolve import DENSE_SMEM_BYTES

TILE = 64


def _dense(schedule=DEFAULT_DENSE_SCHEDULE, s_q=2, h_q=128, h_kv=1, causal=True, lengths=None, device=HOPPER,
           dtype="bfloat16", page=64):
    host = None if lengths is None else torch.as_tensor(lengths, dtype=torch.int64)
    return resolve_dense(schedule, dtype=dtype, s_q=s_q, h_q=h_q, h_kv=h_kv, causal=causal, page=page,
                         device=device, host_lengths=host)


def _uniform(n: int, tiles: int) -> torch.Tensor:
    """``n`` requests of ``tiles`` 64-token tiles each."""
    return torch.full((n,), tiles * TILE, dtype=torch.int64)


def _busiest(lengths, parts: int, policy) -> int:
    """The most KV tiles one part of ``plan_splits``' plan reads, summed from its records."""
    records, _ = plan_splits(torch.as_tensor(lengths), parts, TILE, *policy)
    blocks = [max(int(n) - 1, 0) // TILE + 1 for n in torch.as_tensor(lengths).tolist()]
    most = 0
    for begin, end, first, last, *_ in records.tolist():
        if begin > end:
            continue
        if begin == end:
            most = max(most, last - first)
        else:
            most = max(most, blocks[begin] - first + sum(blocks[begin + 1:end]) + last)
    return most


def _splits(lengths, parts: int, policy) -> bool:
    _, num_splits = plan_splits(torch.as_tensor(lengths), parts, TILE, *policy)
    return bool((num_splits.diff() > 1).any())


# Shapes (s_q, h_q, h_kv) with and without clusters: groups of 16, 64, 128, 192, 256 query heads a KV head.
SHAPES = [(1, 16, 1), (2, 16, 2), (1, 64, 1), (2, 64, 1), (4, 64, 1), (1, 128, 1), (2, 128, 1), (3, 128, 1),
          (4, 128, 1), (1, 192, 1), (2, 192, 1), (1, 256, 1), (2, 256, 2), (1, 128, 2), (2, 256, 1)]
LENGTHS = [None, [5, 0, 200], [64] * 40, [4096] * 128, [8192] * 128, [131072], [65536] * 2, [18560] * 30,
           [300, 70000, 0, 9000]]


# ----------------------------------------------------------------------------- clusters


@pytest.mark.parametrize("s_q,h_q,h_kv", SHAPES)
def test_pairs_exactly_for_a_multiple_of_128_heads_a_kv_head(s_q, h_q, h_kv):
    group = h_q // h_kv
    for lengths in LENGTHS:
        call = _dense(s_q=s_q, h_q=h_q, h_kv=h_kv, lengths=lengths)
        assert call.capture_step.split.cluster_ctas == (2 if group % 128 == 0 else 1), lengths
        assert (call.step.split.cluster_ctas > 1) == (group % 128 == 0), lengths


@pytest.mark.parametrize("s_q,h_q,h_kv", SHAPES)
def test_quad_clusters_only_with_four_m_tiles_to_share(s_q, h_q, h_kv):
    """With every plan long enough (``quad_multicast_tiles=0``), 4-CTA clusters exactly where pairs are allowed
    and a KV head's M tiles come in fours; never for a plan the host does not know."""
    eager = DenseDecodeSchedule(quad_multicast_tiles=0)
    quad_ok = (h_q // h_kv) % 128 == 0 and m_tiles_for(s_q, h_q, h_kv) % 4 == 0
    for lengths in LENGTHS:
        call = _dense(eager, s_q=s_q, h_q=h_q, h_kv=h_kv, lengths=lengths)
        assert call.capture_step.split.cluster_ctas != 4
        assert (call.step.split.cluster_ctas == 4) == (quad_ok and lengths is not None), lengths


# (s_q, h_q, h_kv): the 4-CTA plan's parts (before the fill), each given one request here.
QUAD_SHAPES = {(2, 128, 1): 30, (1, 256, 1): 30, (4, 128, 1): 15, (2, 256, 2): 15}


@pytest.mark.parametrize("threshold", [290, 100, 1])
@pytest.mark.parametrize("shape", list(QUAD_SHAPES))
def test_quad_clusters_from_the_busiest_part_of_their_plan(shape, threshold):
    """One request of ``tiles`` tiles for each part of the 4-CTA plan: its busiest part reads ``tiles``; 4-CTA
    clusters from ``quad_multicast_tiles`` on, pairs just below."""
    s_q, h_q, h_kv = shape
    quad_parts = QUAD_SHAPES[shape]
    schedule = DenseDecodeSchedule(quad_multicast_tiles=threshold)
    policy = schedule.plan_policy(s_q * h_q // h_kv)
    for tiles, ctas in ((threshold - 1, 2), (threshold, 4), (threshold + 1, 4)):
        if tiles < 1:
            continue
        lengths = _uniform(quad_parts, tiles)
        assert _busiest(lengths, quad_parts, policy) == tiles
        call = _dense(schedule, s_q=s_q, h_q=h_q, h_kv=h_kv, lengths=lengths)
        assert call.step.split.cluster_ctas == ctas, tiles
        assert call.step.fill is (ctas == 4) and (call.fill_parts > 0) is (ctas == 4)


def test_quad_part_counts():
    """4-CTA clusters: at most as many parts as the device holds 4-CTA clusters (all parts run at once), with
    fill parts on the SMs they leave; pairs keep FlashMLA's count."""
    eager = DenseDecodeSchedule(quad_multicast_tiles=0)
    lengths = [8192] * 4
    # (s_q, h_q, h_kv) -> (parts with the fill parts, fill parts)
    cases = {(2, 128, 1): (33, 3), (4, 128, 1): (16, 1), (1, 256, 1): (33, 3), (2, 256, 2): (16, 1),
             (1, 128, 1): (66, 0), (3, 128, 1): (22, 0), (2, 64, 1): (66, 0)}
    for (s_q, h_q, h_kv), (parts, fill) in cases.items():
        call = _dense(eager, s_q=s_q, h_q=h_q, h_kv=h_kv, lengths=lengths)
        assert (call.parts, call.fill_parts) == (parts, fill), (s_q, h_q, h_kv)
        assert call.scheduler.fill_parts == fill
    # The capture's plan: pairs, FlashMLA's count, no fill.
    capture = _dense(eager, s_q=2, h_q=128, h_kv=1)
    assert (capture.parts, capture.fill_parts, capture.scheduler.fill_parts) == (33, 0, 0)
    # 29 clusters at once: 116 SMs busy, 16 idle, four fill pairs of two M tiles each.
    call = _dense(eager, lengths=lengths, device=DeviceFacts(132, 66, 29))
    assert (call.parts, call.fill_parts) == (33, 4)


# ----------------------------------------------------------------------------- the idle-SM fill


def test_fill_parts_and_their_policy():
    eager = DenseDecodeSchedule(quad_multicast_tiles=0)
    call = _dense(eager, lengths=[8192] * 4)
    assert call.scheduler == SchedulerConfig(5, 16, 16, 3, 11) and call.step.fill
    assert call.scheduler.policy() == (5, 16, 16, 3, 11)
    shared = _dense(dataclasses.replace(eager, idle_sm_fill_share=9), lengths=[8192] * 4)
    assert shared.scheduler == SchedulerConfig(5, 16, 16, 3, 9) and shared.step == call.step


def test_no_fill_with_num_sm_parts():
    """``num_sm_parts`` fixes the parts: 4-CTA clusters still, no fill parts."""
    call = _dense(DenseDecodeSchedule(quad_multicast_tiles=0, num_sm_parts=12), lengths=[8192] * 4)
    assert call.step.split.cluster_ctas == 4
    assert (call.parts, call.fill_parts, call.step.fill) == (12, 0, False)
    assert call.scheduler == SchedulerConfig(5, 16, 16)


def test_no_fill_where_pairs_do_not_tile_the_sms():
    """A GPC of an odd SM count: the device holds fewer pairs than half its SMs, so fill pairs would not all run."""
    odd = DeviceFacts(num_sms=132, pair_clusters=65, quad_clusters=30)
    call = _dense(DenseDecodeSchedule(quad_multicast_tiles=0), lengths=[8192] * 4, device=odd)
    assert call.step.split.cluster_ctas == 4
    assert (call.parts, call.fill_parts, call.step.fill) == (30, 0, False)


@pytest.mark.parametrize("s_q,h_q,h_kv", SHAPES)
def test_fill_only_with_quad_clusters(s_q, h_q, h_kv):
    for schedule in (DEFAULT_DENSE_SCHEDULE, DenseDecodeSchedule(quad_multicast_tiles=0)):
        for lengths in LENGTHS:
            call = _dense(schedule, s_q=s_q, h_q=h_q, h_kv=h_kv, lengths=lengths)
            assert call.step.fill == (call.fill_parts > 0) == (call.scheduler.fill_parts > 0)
            if call.fill_parts:
                assert call.step.split.cluster_ctas == 4
                # The clusters of all parts but the fill's run at once.
                clusters_a_part = h_kv * m_tiles_for(s_q, h_q, h_kv) // 4
                assert (call.parts - call.fill_parts) * clusters_a_part <= HOPPER.quad_clusters


# ----------------------------------------------------------------------------- loads, order, combine


@pytest.mark.parametrize("threshold", [64, 10, 1])
def test_evict_first_from_the_busiest_part(threshold):
    """s_q = 1, 128 heads: 66 parts of pairs, one request each: evict-first loads up to ``evict_first_tiles``."""
    schedule = DenseDecodeSchedule(evict_first_tiles=threshold)
    for tiles in (threshold - 1, threshold, threshold + 1):
        if tiles < 1:
            continue
        lengths = _uniform(66, tiles)
        call = _dense(schedule, s_q=1, h_q=128, lengths=lengths)
        assert call.parts == 66 and call.step.split.cluster_ctas == 2
        assert _busiest(lengths, 66, call.scheduler.policy()) == tiles
        assert call.step.split.evict_first is (tiles <= threshold), tiles
        assert call.capture_step.split.evict_first is False


@pytest.mark.parametrize("s_q,h_q,h_kv", SHAPES)
def test_evict_first_exactly_when_the_busiest_part_is_short(s_q, h_q, h_kv):
    for schedule in (DEFAULT_DENSE_SCHEDULE, DenseDecodeSchedule(quad_multicast_tiles=0, evict_first_tiles=300),
                     DenseDecodeSchedule(evict_first_tiles=0), DenseDecodeSchedule(num_sm_parts=7)):
        for lengths in LENGTHS[1:]:
            call = _dense(schedule, s_q=s_q, h_q=h_q, h_kv=h_kv, lengths=lengths)
            busiest = _busiest(lengths, call.parts, call.scheduler.policy())
            assert call.step.split.evict_first is (busiest <= schedule.evict_first_tiles), (schedule, lengths)
    assert not _dense(DenseDecodeSchedule(evict_first_tiles=0), lengths=[1]).step.split.evict_first
    assert _dense(DenseDecodeSchedule(evict_first_tiles=10 ** 9), lengths=[1 << 20]).step.split.evict_first


@pytest.mark.parametrize("s_q,h_q,h_kv", SHAPES)
def test_cross_term_first_with_one_m_tile_or_clusters(s_q, h_q, h_kv):
    for lengths in LENGTHS:
        call = _dense(DenseDecodeSchedule(quad_multicast_tiles=0), s_q=s_q, h_q=h_q, h_kv=h_kv, lengths=lengths)
        for split in (call.step.split, call.capture_step.split):
            assert split.cross_term_first == (split.m_tiles == 1 or split.cluster_ctas > 1)
    assert not _dense(s_q=2, h_q=64).step.split.cross_term_first  # two M tiles, no cluster
    assert _dense(s_q=1, h_q=64).step.split.cross_term_first


@pytest.mark.parametrize("s_q,h_q,h_kv", SHAPES)
def test_combine_left_out_when_the_plan_splits_nothing(s_q, h_q, h_kv):
    for lengths in LENGTHS[1:]:
        call = _dense(s_q=s_q, h_q=h_q, h_kv=h_kv, lengths=lengths)
        assert call.step.with_combine == _splits(lengths, call.parts, call.scheduler.policy()), lengths
        assert call.capture_step.with_combine
    assert not _dense(s_q=1, h_q=64, lengths=[5, 0, 200]).step.with_combine
    assert _dense(s_q=1, h_q=64, lengths=[131072]).step.with_combine


@pytest.mark.parametrize("s_q,h_q,h_kv", SHAPES)
def test_capture_step_does_not_depend_on_the_lengths(s_q, h_q, h_kv):
    for schedule in (DEFAULT_DENSE_SCHEDULE, DenseDecodeSchedule(quad_multicast_tiles=0, evict_first_tiles=10 ** 6)):
        unknown = _dense(schedule, s_q=s_q, h_q=h_q, h_kv=h_kv)
        assert unknown.step == unknown.capture_step
        for lengths in LENGTHS[1:]:
            assert _dense(schedule, s_q=s_q, h_q=h_q, h_kv=h_kv, lengths=lengths).capture_step == unknown.capture_step


def test_dense_config_fields():
    """The facts of the call reach the config: causal only with more than one query position (FlashMLA drops it
    at s_q = 1), the group, the page, the dtype and the combine's fields."""
    schedule = DenseDecodeSchedule(combine_chunked_batch=2, combine_spread_partials=7)
    call = _dense(schedule, s_q=3, h_q=32, h_kv=2, causal=True, dtype="float16", page=128)
    assert call.step == DenseStepConfig(
        DenseSplitConfig("float16", 3, 16, 2, True, 128, cluster_ctas=1, cross_term_first=True, evict_first=False),
        CombineConfig("float16", 16, 3, False, 2, 7), with_combine=True, fill=False)
    assert call.step.split.rows == 48 and call.step.split.m_tiles == 1 and call.step.split.kernel == "seesaw"
    assert _dense(s_q=1, causal=True).step.split.causal is False
    assert _dense(s_q=2, causal=False).step.split.causal is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        call.step.split.evict_first = True


def test_experiment_rewrites_the_split_configs():
    def serial(split):
        return dataclasses.replace(split, kernel="serial", cluster_ctas=1)

    with experiment(serial):
        call = _dense(lengths=[4096] * 128)
        assert call.step.split.kernel == call.capture_step.split.kernel == "serial"
        assert call.step.split.cluster_ctas == 1
    assert _dense(lengths=[4096] * 128).step.split.kernel == "seesaw"


# ----------------------------------------------------------------------------- sparse


def _sparse(schedule=DEFAULT_SPARSE_SCHEDULE, b=4, s_q=2, h_q=128, topk=2048, has_sink=False,
            has_topk_length=False, capturing=False):
    return resolve_sparse(schedule, b=b, s_q=s_q, h_q=h_q, topk=topk, has_sink=has_sink,
                          has_topk_length=has_topk_length, capturing=capturing)


@pytest.mark.parametrize("h_q,crossover", [(64, False), (128, True), (192, False), (256, True), (32, False)])
def test_crossover_when_the_head_tiles_pair(h_q, crossover):
    for b in (1, 4, 128):
        call = _sparse(b=b, s_q=1, h_q=h_q)
        assert call.step.split.crossover is crossover
        assert call.step.split.head_tiles == -(-h_q // 64)
        assert call.parts == max(132 // max(h_q // 64, 1), 1)  # FlashMLA's rule: a CTA an SM


# (b, s_q, h_q, topk, num_sm_parts, small): tiles a part = ceil(b * (topk tiles + 5) / parts)
SMALL_CASES = [
    (2, 2, 128, 2048, 33, True),  # 3
    (4, 2, 128, 2048, 33, False),  # 5
    (1, 1, 64, 8192, 132, True),  # 2
    (128, 2, 128, 2048, 33, False),
    (3, 2, 128, 128, 7, True),
    (2, 1, 64, 2048, 132, False),  # 1: nothing to gain
]


@pytest.mark.parametrize("b,s_q,h_q,topk,parts,small", SMALL_CASES)
def test_small_plan_kernel_and_policy(b, s_q, h_q, topk, parts, small):
    """A small plan writes 16-bit partials, keeps the producer whole and takes the small fixed cost; another
    plan splits the crossover's producer in halves."""
    schedule = SparseDecodeSchedule(num_sm_parts=parts)
    assert schedule.small_plan(b, topk, parts) is small
    call = _sparse(schedule, b=b, s_q=s_q, h_q=h_q, topk=topk)
    assert call.parts == parts
    split = call.step.split
    assert split.partials_16bit is small
    assert split.producer_halves is (split.crossover and not small)
    assert call.scheduler == SchedulerConfig(*schedule.plan_policy(s_q * h_q, small), lengths="topk")
    assert call.scheduler.fixed_cost == (1 if small else 5)
    assert call.capture_step.split == split  # a shape fact: the capture takes the same kernel
    off = _sparse(SparseDecodeSchedule(num_sm_parts=parts, small_plan_tiles=0), b=b, s_q=s_q, h_q=h_q, topk=topk)
    assert not off.step.split.partials_16bit and off.scheduler.fixed_cost == 5
    assert off.step.split.producer_halves is off.step.split.crossover


def test_small_fixed_cost_reaches_the_scheduler():
    call = _sparse(SparseDecodeSchedule(small_plan_fixed_cost=3, unsplit_slack=1), b=2)
    assert call.step.split.partials_16bit and call.scheduler == SchedulerConfig(3, 4, 0, lengths="topk")
    assert _sparse(SparseDecodeSchedule(split_fixed_cost=7), b=128).scheduler == SchedulerConfig(7, 0, 0,
                                                                                                 lengths="topk")


def test_sparse_combine_only_when_needed():
    """Without topk_length every request has topk tokens, so the host knows whether the plan splits; with it,
    or while a CUDA graph is captured, the combine stays."""
    for parts, has_topk_length, capturing, combine in ((3, False, False, False), (2, False, False, True),
                                                       (3, True, False, True), (3, False, True, True)):
        call = _sparse(SparseDecodeSchedule(num_sm_parts=parts), b=3, topk=1024, has_topk_length=has_topk_length,
                       capturing=capturing)
        assert call.parts == parts
        assert call.step.with_combine is combine, (parts, has_topk_length, capturing)
        assert call.capture_step.with_combine and call.capture_step.split == call.step.split
        assert call.step.split.has_topk_length is has_topk_length
    assert _splits(_uniform(3, 16), 2, SparseDecodeSchedule().plan_policy(256))
    assert not _splits(_uniform(3, 16), 3, SparseDecodeSchedule().plan_policy(256))


def test_sparse_config_fields():
    schedule = SparseDecodeSchedule(num_sm_parts=5, combine_chunked_batch=0, combine_spread_partials=9)
    call = _sparse(schedule, b=64, s_q=1, h_q=128, topk=2048, has_sink=True, has_topk_length=True)
    assert call.step == SparseStepConfig(
        SparseSplitConfig(1, 128, True, True, crossover=True, producer_halves=True, partials_16bit=False),
        CombineConfig("bfloat16", 128, 1, True, 0, 9), with_combine=True)


# ----------------------------------------------------------------------------- one key for equal kernels


def test_equal_kernels_share_one_key():
    """Schedules that differ only in what the kernels do not read resolve to equal, hashable configs."""
    a = _dense(DEFAULT_DENSE_SCHEDULE, lengths=[4096] * 128)
    b = _dense(DenseDecodeSchedule(split_fixed_cost=4, idle_sm_fill_share=5, quad_multicast_tiles=1000),
               lengths=[4096] * 128)
    assert a.scheduler != b.scheduler
    assert a.step == b.step and hash(a.step) == hash(b.step)
    assert {("dense_decode", a.step, ""): 1}[("dense_decode", b.step, "")] == 1
    assert a.capture_step == b.capture_step
    # A kernel that differs does not share it.
    c = _dense(DenseDecodeSchedule(evict_first_tiles=10 ** 6), lengths=[4096] * 128)
    assert c.step != a.step and c.step.split.evict_first != a.step.split.evict_first
    s = _sparse(DEFAULT_SPARSE_SCHEDULE, b=128)
    t = _sparse(SparseDecodeSchedule(small_plan_fixed_cost=2), b=128)  # not a small plan: the field is unused
    assert s.step == t.step and hash(s.step) == hash(t.step) and {s.step: 1}[t.step] == 1
    u = _sparse(SparseDecodeSchedule(unsplit_slack=3), b=128, has_topk_length=True)
    v = _sparse(DEFAULT_SPARSE_SCHEDULE, b=128, has_topk_length=True)
    assert u.scheduler != v.scheduler and u.step == v.step and hash(u.step) == hash(v.step)
    assert _sparse(b=2).step != s.step  # a small plan: 16-bit partials
    assert hash(a.scheduler) == hash(SchedulerConfig(*a.scheduler.policy()))


# ----------------------------------------------------------------------------- precompile covers every call


PRECOMPILE_SCHEDULES = [DEFAULT_DENSE_SCHEDULE, DenseDecodeSchedule(quad_multicast_tiles=0),
                        DenseDecodeSchedule(num_sm_parts=20), DenseDecodeSchedule(evict_first_tiles=500),
                        DenseDecodeSchedule(quad_multicast_tiles=64, evict_first_tiles=64)]


@pytest.mark.parametrize("s_q,h_q,h_kv", SHAPES)
def test_every_dense_call_is_precompiled(s_q, h_q, h_kv):
    for schedule, causal in itertools.product(PRECOMPILE_SCHEDULES, (False, True)):
        steps = dense_precompile_steps(schedule, dtype="bfloat16", s_q=s_q, h_q=h_q, h_kv=h_kv, causal=causal,
                                       page=64)
        assert len(set(steps)) == len(steps)
        capture = _dense(schedule, s_q=s_q, h_q=h_q, h_kv=h_kv, causal=causal)
        assert (capture.step, capture.scheduler) in steps
        for lengths in LENGTHS[1:]:
            call = _dense(schedule, s_q=s_q, h_q=h_q, h_kv=h_kv, causal=causal, lengths=lengths)
            assert (call.step, call.scheduler) in steps, (schedule, lengths)


def test_quad_evict_first_step_is_precompiled_near_the_thresholds():
    schedule = DenseDecodeSchedule(quad_multicast_tiles=65, evict_first_tiles=64)
    call = _dense(schedule, lengths=[64 * 64 * 30 + 1])  # one request: 65 tiles a 4-CTA part, 61 with the fill
    assert call.step.split.cluster_ctas == 4 and call.step.split.evict_first
    steps = dense_precompile_steps(schedule, dtype="bfloat16", s_q=2, h_q=128, h_kv=1, causal=True, page=64)
    assert (call.step, call.scheduler) in steps


def test_dense_precompile_kinds():
    """Pairs and 4-CTA steps (with the fill), each with both loads, with and without the combine."""
    steps = dense_precompile_steps(DEFAULT_DENSE_SCHEDULE, dtype="bfloat16", s_q=2, h_q=128, h_kv=1, causal=True,
                                   page=64)
    kinds = [(s.split.cluster_ctas, s.split.evict_first, s.with_combine, s.fill) for s, _ in steps]
    assert kinds == [(2, False, True, False), (2, False, False, False), (2, True, True, False),
                     (2, True, False, False), (4, False, True, True), (4, False, False, True), (4, True, True, True),
                     (4, True, False, True)]
    assert [sched for _, sched in steps] == [SchedulerConfig(5, 16, 16)] * 4 + [SchedulerConfig(5, 16, 16, 3, 11)] * 4
    small = dense_precompile_steps(DEFAULT_DENSE_SCHEDULE, dtype="bfloat16", s_q=1, h_q=64, h_kv=1, causal=False,
                                   page=64)
    assert [(s.split.cluster_ctas, s.split.evict_first, s.with_combine) for s, _ in small] == [
        (1, False, True), (1, False, False), (1, True, True), (1, True, False)]


SPARSE_PRECOMPILE_SCHEDULES = [DEFAULT_SPARSE_SCHEDULE, SparseDecodeSchedule(small_plan_tiles=0),
                               SparseDecodeSchedule(num_sm_parts=16), SparseDecodeSchedule(small_plan_tiles=40)]


@pytest.mark.parametrize("s_q,h_q", [(1, 64), (2, 64), (1, 128), (2, 128), (4, 128), (1, 192)])
def test_every_sparse_call_is_precompiled(s_q, h_q):
    for schedule, has_sink, has_topk_length in itertools.product(SPARSE_PRECOMPILE_SCHEDULES, (False, True),
                                                                 (False, True)):
        steps = sparse_precompile_steps(schedule, s_q=s_q, h_q=h_q, has_sink=has_sink,
                                        has_topk_length=has_topk_length)
        assert len(set(steps)) == len(steps)
        for b, topk, capturing in itertools.product((1, 2, 3, 8, 64, 128), (128, 512, 2048), (False, True)):
            call = _sparse(schedule, b=b, s_q=s_q, h_q=h_q, topk=topk, has_sink=has_sink,
                           has_topk_length=has_topk_length, capturing=capturing)
            assert (call.step, call.scheduler) in steps, (schedule, b, topk)
            assert (call.capture_step, call.scheduler) in steps


def test_sparse_precompile_kinds():
    steps = sparse_precompile_steps(DEFAULT_SPARSE_SCHEDULE, s_q=2, h_q=128, has_sink=False, has_topk_length=False)
    assert [(s.split.partials_16bit, s.with_combine) for s, _ in steps] == [(False, True), (False, False),
                                                                             (True, True), (True, False)]
    assert [sched.fixed_cost for _, sched in steps] == [5, 5, 1, 1]
    with_lengths = sparse_precompile_steps(SparseDecodeSchedule(small_plan_tiles=0), s_q=2, h_q=128, has_sink=True,
                                           has_topk_length=True)
    assert [(s.split.partials_16bit, s.with_combine, s.split.has_topk_length) for s, _ in with_lengths] == [
        (False, True, True)]


def test_dense_smem_fits_a_hopper_cta():
    """Q, two 64 x 576 tiles, one P and the row buffers: over 225 KiB, within a Hopper CTA's 227 KiB."""
    assert 225 * 1024 < DENSE_SMEM_BYTES <= 232448


def test_precompile_under_an_experiment_matches_its_calls():
    """Inside an experiment that takes the clusters apart, precompile lists what the calls resolve to: no 4-CTA
    or fill steps, and every resolved step is listed."""
    import dataclasses

    from mla_cute.schedules import experiment

    def serial(c):
        return dataclasses.replace(c, kernel="serial", cluster_ctas=1, cross_term_first=False)

    shape = dict(dtype="bfloat16", s_q=2, h_q=128, h_kv=1, causal=True, page=64)
    with experiment(serial):
        steps = dense_precompile_steps(DEFAULT_DENSE_SCHEDULE, **shape)
        assert steps and all(s.split.kernel == "serial" and not s.fill for s, _ in steps)
        assert len(set(steps)) == len(steps)
        for n in (4096, 8192, 65536):
            call = resolve_dense(DEFAULT_DENSE_SCHEDULE, host_lengths=torch.full((128,), n), **shape)
            assert (call.step, call.scheduler) in steps


def test_reference_sparse_metadata_is_the_cute_plan():
    """The reference backend fills the metadata with the plan the kernels would run, small plans' fixed cost
    included (b = 2, s_q = 2, h_q = 128, topk 2048 is a small plan)."""
    import mla_cute
    from mla_cute import api
    from mla_cute.schedules import plan_splits

    q = torch.zeros(2, 2, 128, 576, dtype=torch.bfloat16)
    call = resolve_sparse(DEFAULT_SPARSE_SCHEDULE, b=2, s_q=2, h_q=128, topk=2048, has_sink=False,
                          has_topk_length=False)
    assert call.scheduler.fixed_cost == DEFAULT_SPARSE_SCHEDULE.small_plan_fixed_cost
    meta = mla_cute.get_mla_metadata()[0]
    api._fill_sparse_reference_metadata(meta, q, 2048, None, DEFAULT_SPARSE_SCHEDULE)
    records, splits = plan_splits(torch.full((2,), 2048), call.parts, 64, *call.scheduler.policy())
    assert torch.equal(meta.num_splits, splits) and torch.equal(meta.tile_scheduler_metadata, records)
    fifth = plan_splits(torch.full((2,), 2048), call.parts, 64, DEFAULT_SPARSE_SCHEDULE.split_fixed_cost)[1]
    assert not torch.equal(splits, fifth), "the small plan's fixed cost changes this plan"


def test_sparse_split_config_takes_the_old_boolean_extra_cache():
    """``extra_cache`` names the extra cache's format; True (an extra cache of the main format) and False, as the
    field once was, still mean that."""
    from mla_cute.schedules.configs import SparseSplitConfig

    fields = dict(s_q=1, h_q=64, has_sink=False, has_topk_length=True, crossover=False, producer_halves=False,
                  partials_16bit=False, kv_format="V4")
    assert SparseSplitConfig(**fields, extra_cache=True).extra_cache == "V4"
    assert SparseSplitConfig(**fields, extra_cache=False).extra_cache == ""
    with pytest.raises(ValueError, match="extra_cache: the kernel reads an extra cache"):
        SparseSplitConfig(**fields, extra_cache="V41_FP4")
