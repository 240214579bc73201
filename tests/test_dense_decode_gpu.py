"""Dense decode kernels on the H200 against the reference backend (FlashMLA's grid and corners)."""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch

from gpu_cases import assert_close_flashmla, magnitude_abs_tol, make_dense_case, poison_allocator

pytestmark = pytest.mark.gpu

OUT_ABS, OUT_REL, OUT_COS = 8e-4, 2.01 / 128, 5e-6
LSE_ABS, LSE_REL = 1e-6, 8.01 / 65536


def run_and_check(case, s_q, causal, *, reuse=1, magnitude_tol=False):
    import mla_cute

    meta, _ = mla_cute.get_mla_metadata()
    ref_out, ref_lse = mla_cute.flash_mla_with_kvcache(
        **case, head_dim_v=512, tile_scheduler_metadata=mla_cute.get_mla_metadata()[0], causal=causal,
        backend="reference",
    )
    for _ in range(reuse):
        poison_allocator()
        out, lse = mla_cute.flash_mla_with_kvcache(
            **case, head_dim_v=512, tile_scheduler_metadata=meta, causal=causal, backend="cute"
        )
        torch.cuda.synchronize()
        assert out.dtype == case["q"].dtype and lse.dtype == torch.float32
        out_abs = magnitude_abs_tol(ref_out, OUT_ABS) if magnitude_tol else OUT_ABS
        assert_close_flashmla("out", out, ref_out, out_abs, OUT_REL, OUT_COS)
        assert_close_flashmla("lse", lse, ref_lse, LSE_ABS, LSE_REL)
    return meta


@pytest.fixture(autouse=True)
def _dense_variant():
    """MLA_CUTE_DENSE_VARIANT=<a name of ``_variants``> runs every test here with that kernel variant (tests that
    check which kernel the resolver chose then fail: they name what they expected)."""
    name = os.environ.get("MLA_CUTE_DENSE_VARIANT")
    if not name:
        yield
        return
    from mla_cute.schedules import experiment

    with experiment(_variants()[name]):
        yield


def _variants():
    """Kernel variants that the resolver picks for other shapes or plans, forced on every call: rewrites of the
    dense split config it returns (``mla_cute.schedules.experiment``), each leaving a config it made unchanged."""
    replace = dataclasses.replace
    return {
        # the serial baseline (one CTA a cluster)
        "serial": lambda c: replace(c, kernel="serial", cluster_ctas=1, cross_term_first=False),
        # the seesaw's two step orders on every M tile count (the resolver picks one by the count and cluster)
        "cross_first": lambda c: replace(c, cross_term_first=True),
        "cross_last": lambda c: replace(c, cross_term_first=False),
        # no tile multicast on the h_q = 128 kernels (the resolver pairs them)
        "no_multicast": lambda c: replace(c, cluster_ctas=1, cross_term_first=c.m_tiles == 1),
        # evict-first loads on every plan, and normal loads on every plan (the resolver chooses per plan, and
        # short plans take evict-first)
        "evict_first": lambda c: replace(c, evict_first=True),
        "normal_loads": lambda c: replace(c, evict_first=False),
    }


def dense_split(meta):
    """The split config of the kernel a metadata object's dense plan runs."""
    return meta._state["dense"].config.step.split


# Lengths that put the last tile of a request at every position of a tile pair (0-5 tiles,
# partial and full), plus long requests that the planner splits over several CTAs.
PAIR_LENGTHS = [0, 1, 63, 64, 65, 127, 128, 129, 191, 192, 200, 256, 300, 4096, 5000, 17]
SCHEDULE_CASES = [
    (torch.bfloat16, 1, 128, 1, False),
    (torch.bfloat16, 2, 128, 1, True),
    (torch.float16, 2, 64, 1, True),
    (torch.bfloat16, 4, 16, 1, True),
    (torch.bfloat16, 1, 9, 3, False),
]


def check_tile_positions(name, dtype, s_q, h_q, h_kv, causal, seed, schedule=None):
    """The requests of ``PAIR_LENGTHS`` (a last tile at every position of a pair, and splits) with kernel
    variant ``name`` of ``_variants()`` (None: the resolver's kernel) and ``schedule`` (None: the default),
    against the reference; returns the split config the calls ran."""
    import contextlib

    import mla_cute
    from mla_cute.schedules import experiment

    case = make_dense_case(len(PAIR_LENGTHS), s_q, 0, h_q, h_kv, lengths=PAIR_LENGTHS, dtype=dtype,
                           gen=torch.Generator().manual_seed(seed))
    rewrite = _variants()[name] if name else None
    with contextlib.ExitStack() as stack:
        if rewrite:
            stack.enter_context(experiment(rewrite))
        if schedule:
            stack.enter_context(mla_cute.use_schedule(schedule))
        split = dense_split(run_and_check(case, s_q, causal, reuse=2))
    if rewrite:
        assert rewrite(split) == split, f"variant {name} did not reach the kernel: {split}"
    return split


TILE_POSITION_VARIANTS = [None, "serial", "cross_first", "cross_last", "no_multicast", "evict_first", "normal_loads"]


@pytest.mark.parametrize("name", TILE_POSITION_VARIANTS)
@pytest.mark.parametrize("dtype,s_q,h_q,h_kv,causal", SCHEDULE_CASES)
def test_variant_tile_positions(name, dtype, s_q, h_q, h_kv, causal):
    check_tile_positions(name, dtype, s_q, h_q, h_kv, causal, s_q * 100 + h_q)


# The kernels whose M tiles the resolver pairs in 2-CTA clusters (128 query heads a KV head, two M tiles that
# see the same KV tiles); these short plans take pairs, not 4-CTA clusters.
MULTICAST_CASES = [
    (torch.bfloat16, 1, 128, 1, False),
    (torch.bfloat16, 2, 128, 1, True),
    (torch.float16, 1, 256, 2, False),
]


@pytest.mark.parametrize("dtype,s_q,h_q,h_kv,causal", MULTICAST_CASES)
def test_tile_multicast_tile_positions(dtype, s_q, h_q, h_kv, causal):
    split = check_tile_positions(None, dtype, s_q, h_q, h_kv, causal, s_q * 100 + h_q + 7)
    assert split.cluster_ctas == 2 and split.cross_term_first, split


# Four M tiles a cluster: one or two query positions a cluster (causal: the cluster's rows end up to s_q - 1
# keys apart), two clusters a KV head, two KV heads; and a kernel whose M tiles only pair (six M tiles).
QUAD_MULTICAST_CASES = [
    (torch.bfloat16, 2, 128, 1, True),
    (torch.bfloat16, 4, 128, 1, True),
    (torch.float16, 1, 256, 1, False),
    (torch.bfloat16, 2, 256, 2, True),
    (torch.bfloat16, 3, 128, 1, True),
]


def _quad_expected(s_q, h_q, h_kv) -> int:
    return 4 if (s_q * h_q // h_kv) % 256 == 0 else 2


@pytest.mark.parametrize("dtype,s_q,h_q,h_kv,causal", QUAD_MULTICAST_CASES)
def test_quad_multicast_tile_positions(dtype, s_q, h_q, h_kv, causal):
    """A schedule that takes 4-CTA clusters on every plan the host knows (``quad_multicast_tiles=0``): with the
    idle-SM fill, the last parts run as pairs (an H200's pairs tile its SMs: 30 clusters leave 12 SMs)."""
    from mla_cute.schedules import DenseDecodeSchedule

    split = check_tile_positions(None, dtype, s_q, h_q, h_kv, causal, s_q * 100 + h_q + 11,
                                 schedule=DenseDecodeSchedule(quad_multicast_tiles=0))
    assert split.cluster_ctas == _quad_expected(s_q, h_q, h_kv), split


@pytest.mark.parametrize("dtype,s_q,h_q,h_kv,causal", QUAD_MULTICAST_CASES[:2] + QUAD_MULTICAST_CASES[3:4])
def test_quad_multicast_without_fill_tile_positions(dtype, s_q, h_q, h_kv, causal):
    """4-CTA clusters on a part count the schedule sets (which turns the idle-SM fill off)."""
    from mla_cute.schedules import DenseDecodeSchedule

    split = check_tile_positions(None, dtype, s_q, h_q, h_kv, causal, s_q * 100 + h_q + 13,
                                 schedule=DenseDecodeSchedule(quad_multicast_tiles=0, num_sm_parts=12))
    assert split.cluster_ctas == 4, split


@pytest.mark.parametrize("s_k,quad", [(16384, True), (4096, False)])
def test_quad_multicast_chosen_per_plan(s_k, quad):
    """The default decides the cluster per plan: 64 requests of 16K at s_q = 2, h_q = 128 give a part of the
    4-CTA clusters' plan 500 tiles or more (4-CTA clusters), 4K far fewer (pairs); both match the reference."""
    case = make_dense_case(64, 2, s_k, 128, 1, varlen=True, gen=torch.Generator().manual_seed(s_k))
    meta = run_and_check(case, 2, True)
    plan = meta._state["dense"]
    assert dense_split(meta).cluster_ctas == (4 if quad else 2)
    # For a plan the host does not know (a CUDA graph captured later) the pairs' kernel is loaded too.
    assert plan.config.capture_step.split.cluster_ctas == 2
    # 4-CTA clusters come with the idle-SM fill (on an H200: 30 clusters, the last three parts as pairs).
    assert len(plan.records) == (2 if quad else 1)


def test_cluster_slots_on_the_device():
    """The driver's count of co-resident clusters of the dense kernel's CTAs (whole SMs): every SM for single
    CTAs and pairs on a Hopper part, at most a quarter of them for 4-CTA clusters; the device facts the
    resolver plans with are those counts, and a 4-CTA plan's parts all fit at once."""
    from mla_cute.device import cluster_slots, device_facts, num_sms
    from mla_cute.schedules import DEFAULT_DENSE_SCHEDULE, resolve_dense
    from mla_cute.schedules.resolve import DENSE_SMEM_BYTES, DENSE_THREADS

    dev = torch.device("cuda")
    sms = num_sms(dev)
    assert sms == torch.cuda.get_device_properties(dev).multi_processor_count
    assert cluster_slots(dev, 1, DENSE_SMEM_BYTES, DENSE_THREADS) == sms
    assert cluster_slots(dev, 2, DENSE_SMEM_BYTES, DENSE_THREADS) == sms // 2
    quads = cluster_slots(dev, 4, DENSE_SMEM_BYTES, DENSE_THREADS)
    assert 1 <= quads <= sms // 4
    facts = device_facts(dev)
    assert (facts.num_sms, facts.pair_clusters, facts.quad_clusters) == (sms, sms // 2, quads)
    call = resolve_dense(DEFAULT_DENSE_SCHEDULE, dtype="bfloat16", s_q=2, h_q=128, h_kv=1, causal=True, page=64,
                         device=facts, host_lengths=torch.full((64,), 16384))
    assert call.step.split.cluster_ctas == 4
    assert call.parts - call.fill_parts <= quads


@pytest.mark.parametrize("s_q,causal", [(1, False), (2, True)])
def test_two_multicast_pairs_per_kv_head(s_q, causal):
    """256 query heads on one KV head: the default pairs M tiles 0-1 and 2-3 (and, at s_q = 2, 4-5 and 6-7)
    into 2-CTA clusters, each pair with its own tiles and hand-backs, the cross term first (a plan this short
    takes pairs, not 4-CTA clusters)."""
    split = check_tile_positions(None, torch.bfloat16, s_q, 256, 1, causal, s_q * 100 + 256)
    assert split.cluster_ctas == 2 and split.cross_term_first, split


def _grid():
    full = os.environ.get("MLA_CUTE_FULL_GRID") == "1"
    bs = [1, 2, 6, 64] if full else [2, 64]
    hqs = [1, 3, 9, 63, 64, 126, 128]
    for b in bs:
        for s_q in (1, 2, 4):
            for s_k in (20, 140, 4096):
                for h_q in hqs:
                    for h_kv in (1, 2, 3, 8):
                        if h_q % h_kv:
                            continue
                        if not full and h_kv > 1 and h_q not in (64, 126, 128):
                            continue
                        for varlen in (False, True):
                            for causal in ((False, True) if s_q > 1 else (False,)):
                                yield b, s_q, s_k, h_q, h_kv, varlen, causal


GRID = list(_grid())


@pytest.mark.parametrize("b,s_q,s_k,h_q,h_kv,varlen,causal", GRID)
def test_dense_grid(b, s_q, s_k, h_q, h_kv, varlen, causal):
    gen = torch.Generator().manual_seed(hash((b, s_q, s_k, h_q, h_kv, varlen, causal)) % 2**31)
    case = make_dense_case(b, s_q, s_k, h_q, h_kv, varlen=varlen, gen=gen)
    run_and_check(case, s_q, causal)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_lengths_zero(dtype):
    case = make_dense_case(128, 2, 4096, 128, 1, varlen=True, zero_half=True, dtype=dtype)
    run_and_check(case, 2, True)


def test_metadata_reuse_and_gpu_scheduler_matches_planner():
    from mla_cute.schedules import DEFAULT_DENSE_SCHEDULE as default
    from mla_cute.schedules import plan_splits

    case = make_dense_case(64, 1, 4096, 128, 1, varlen=True)
    meta = run_and_check(case, 1, False, reuse=3)
    records, splits = plan_splits(case["cache_seqlens"].cpu(), meta.tile_scheduler_metadata.shape[0], 64,
                                  *default.plan_policy(128))
    assert torch.equal(meta.tile_scheduler_metadata.cpu(), records)
    assert torch.equal(meta.num_splits.cpu(), splits)


@pytest.mark.parametrize("fixed_cost,slack,even,fill", [(5, 0, 0, ()), (5, 12, 0, ()), (0, 3, 0, ()), (5, 40, 0, ()),
                                                       (5, 0, 4, ()), (5, 8, 8, ()), (0, 0, 3, ()), (5, 4, 40, ()),
                                                       (5, 16, 16, (3, 11)), (0, 0, 0, (1, 1)), (5, 4, 4, (6, 16))])
def test_gpu_scheduler_matches_planner(fixed_cost, slack, even, fill):
    """The scheduler kernel writes the host planner's records for random, uniform, empty and benchmark
    lengths, with and without the searches for a plan of whole requests (``unsplit_slack``) and of even
    pieces (``even_split_slack``), and with fill parts (``fill``: their count and share)."""
    from mla_cute.kernels.build import compile_scheduler
    from mla_cute.schedules import SchedulerConfig, plan_has_split, plan_splits

    rng = random.Random(fixed_cost * 100 + slack + 10000 * even)
    cases = [([4096] * 128, 33), ([8192] * 128, 33), ([8192] * 128, 66), ([16384] * 128, 66), ([131072], 66),
             ([0] * 5, 7), ([16384] * 64, 132), ([1] * 300, 17), ([65536] * 8, 66), ([32768] * 32, 132)]
    for _ in range(60):
        b = rng.randint(1, 200)
        n = rng.choice([64, 700, 4096, 20000])
        lens = [n] * b if rng.random() < 0.3 else [rng.randint(0, n) for _ in range(b)]
        cases.append((lens, rng.choice([1, 2, 7, 33, 66, 132])))
    scheduler = compile_scheduler(SchedulerConfig(fixed_cost, slack, even, *fill))
    outcomes = set()
    for lens, parts in cases:
        parts = max(parts, fill[0] + 1) if fill else parts
        seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        records = torch.full((parts, 8), -7, dtype=torch.int32, device="cuda")
        splits = torch.full((len(lens) + 1,), -7, dtype=torch.int32, device="cuda")
        scheduler(seqlens, records, splits, max(lens) if lens else 0)
        want_records, want_splits = plan_splits(seqlens.cpu(), parts, 64, fixed_cost, slack, even, *fill)
        assert torch.equal(records.cpu(), want_records), (lens[:8], parts)
        assert torch.equal(splits.cpu(), want_splits), (lens[:8], parts)
        outcomes.add(plan_has_split(seqlens.cpu(), parts, 64, fixed_cost, slack, even, *fill))
    assert outcomes == {False, True}


@pytest.mark.parametrize("page", [128, 256])
def test_page_sizes(page):
    case = make_dense_case(4, 1, 1000, 64, 1, varlen=True, page=page)
    run_and_check(case, 1, False)


def test_single_long_request():
    """The default chooses the loads per plan: b = 1, 128K reads 32 tiles a part, so its plan takes the
    evict-first kernel."""
    case = make_dense_case(1, 1, 131072, 128, 1)
    meta = run_and_check(case, 1, False, reuse=2)
    assert dense_split(meta).evict_first is True


def test_single_long_request_normal_loads():
    from mla_cute.schedules import experiment

    case = make_dense_case(1, 1, 131072, 128, 1)
    with experiment(_variants()["normal_loads"]):
        meta = run_and_check(case, 1, False)
    assert dense_split(meta).evict_first is False


@pytest.mark.parametrize("mode", ["whole", "chunks", "spread"])
@pytest.mark.parametrize("s_q,h_q", [(3, 5), (1, 128)])
def test_combine_paths(mode, s_q, h_q):
    """The combine's three launches (whole rows, column chunks, spread chunks), with 1 to ~30 splits a
    request (below, at and past a warp's load group of partials) and (h_q = 5, s_q = 3) rows not a
    multiple of 4, each a programmatic dependent launch after the split kernel."""
    import mla_cute
    from mla_cute.schedules import DenseDecodeSchedule

    rng = random.Random(len(mode) * 100 + h_q)
    lens = [20000] + [rng.choice([1, 64, rng.randint(1, 3000), rng.randint(3000, 9000)]) for _ in range(36)]
    case = make_dense_case(37, s_q, 0, h_q, 1, lengths=lens, gen=torch.Generator().manual_seed(h_q))
    sched = DenseDecodeSchedule(num_sm_parts=132, combine_chunked_batch=0 if mode == "whole" else 64,
                                combine_spread_partials=1 if mode == "spread" else 0)
    with mla_cute.use_schedule(sched):
        meta = run_and_check(case, s_q, s_q > 1)
    splits = (meta.num_splits[1:] - meta.num_splits[:-1]).cpu()
    assert splits.max() >= 9 and (splits == 1).any() and ((splits > 1) & (splits < 8)).any(), splits


def test_noncontiguous_q():
    case = make_dense_case(3, 2, 700, 128, 1, varlen=True)
    big = torch.randn(3, 2, 256, 576, device="cuda").to(torch.bfloat16)
    big[:, :, ::2] = case["q"]
    case["q"] = big[:, :, ::2]
    run_and_check(case, 2, True)


@pytest.mark.parametrize("h_q", [64, 128])
def test_scores_growing_past_the_max_slack(h_q):
    """Key rows scaled by 2^(10 t / s_k) along each sequence and q by 10: the scores grow by hundreds in
    log2 units, so the running max, held while a tile stays within ``MAX_SLACK`` of it, must move again
    and again (a max held too long overflows 2^(S - max)), and O be rescaled mid-split.  The outputs
    reach the hundreds: the exact-max kernel measured the same largest error (one bf16 step)."""
    case = make_dense_case(4, 1, 4096, h_q, 1)
    cache, table = case["k_cache"], case["block_table"].long()
    gain = torch.pow(2.0, torch.linspace(0, 10, table.shape[1] * 64, device="cuda")).view(-1, 64, 1, 1)
    for i in range(4):
        cache[table[i]] = (cache[table[i]].float() * gain).to(cache.dtype)
    case["q"] = case["q"] * 10
    run_and_check(case, 1, False, magnitude_tol=True)


@pytest.mark.parametrize("seed", range(int(os.environ.get("MLA_CUTE_FUZZ", "12"))))
def test_fuzz(seed):
    rng = random.Random(seed)
    h_kv = rng.choice([1, 1, 1, 2, 4])
    h_q = h_kv * rng.choice([1, 5, 16, 32, 64, 100, 128])
    s_q = rng.choice([1, 1, 2, 3])
    b = rng.randint(1, 40)
    lens = [rng.choice([0, rng.randint(1, 70), rng.randint(1, 5000)]) for _ in range(b)]
    if max(lens) == 0:
        lens[0] = 1
    dtype = rng.choice([torch.bfloat16, torch.float16])
    case = make_dense_case(b, s_q, 0, h_q, h_kv, lengths=lens, dtype=dtype,
                           gen=torch.Generator().manual_seed(seed))
    run_and_check(case, s_q, rng.random() < 0.5)
