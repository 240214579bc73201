"""The resolvers: one per call kind, from schedule + shapes + lengths + device facts to frozen kernel
configs and the plan's parts and policy.  Every per-plan rule lives here, once; the host runtime, the
precompile enumeration and the tests all go through these functions.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Callable, Optional

from .configs import (CombineConfig, DenseSplitConfig, DenseStepConfig, SchedulerConfig, SparsePrefillConfig,
                      SparseSplitConfig, SparseStepConfig)
from .dense import DenseDecodeSchedule
from .planner import m_tiles_for, num_sm_parts_for, plan_facts, plan_has_split, sparse_num_sm_parts_for
from .sparse import SparseDecodeSchedule

# The seesaw kernel's shared storage (``kernels/dense_seesaw.py``, ``SharedStorage``; a compile test checks
# it): mbarriers for Q, 18 sub-tiles, 4 buffer halves and Q's hand-back, and the row max / sum / scale
# exchanges (3 x 2 x 64 fp32), padded to the 1 KiB alignment of the tiles; then Q 64 x 576, two KV tiles
# 64 x 576 and the second P 64 x 64, all 16-bit.
DENSE_SMEM_BYTES = -(-(8 * (2 + 2 * 9 + 4 + 1) + 3 * 2 * 64 * 4) // 1024) * 1024 + 2 * (64 * 576 * 3 + 64 * 64)
DENSE_THREADS = 384  # two consumer warpgroups and the load warpgroup


@dataclasses.dataclass(frozen=True)
class DeviceFacts:
    """What planning needs of a device: its SM count, and how many 2- and 4-CTA clusters of the dense
    kernel (``DENSE_SMEM_BYTES``, ``DENSE_THREADS``) it holds at once (``mla_cute.device.device_facts``)."""

    num_sms: int = 132
    pair_clusters: int = 66
    quad_clusters: int = 30


HOPPER = DeviceFacts()  # an H100 / H200: what a CPU plans for


@dataclasses.dataclass(frozen=True)
class DenseCall:
    """A dense call resolved: ``step``, the kernels it runs; ``capture_step``, those of a plan the host does
    not know (loaded with every plan: a CUDA graph captured later plans on the device, and nothing can be
    loaded during a capture); the part count (fill parts included), the fill parts, and the GPU planner's
    policy."""

    step: DenseStepConfig
    capture_step: DenseStepConfig
    parts: int
    fill_parts: int
    scheduler: SchedulerConfig


@dataclasses.dataclass(frozen=True)
class SparseCall:
    """A sparse call resolved: the kernels (``capture_step``: with the combine, for a CUDA graph), the part
    count and the planner's policy."""

    step: SparseStepConfig
    capture_step: SparseStepConfig
    parts: int
    scheduler: SchedulerConfig


# An experiment (``benchmarks/experiments.py``) may rewrite each dense split config a resolver returns.
_experiment: contextvars.ContextVar[Optional[Callable]] = contextvars.ContextVar("mla_cute_experiment", default=None)


@contextlib.contextmanager
def experiment(rewrite: Callable[[DenseSplitConfig], DenseSplitConfig]):
    """Within the block, ``resolve_dense`` passes every split config through ``rewrite`` (the benchmarks'
    baseline and A/B variants; a metadata object made inside keeps its kernels)."""
    token = _experiment.set(rewrite)
    try:
        yield
    finally:
        _experiment.reset(token)


def _dense_split(dtype: str, s_q: int, h_q: int, h_kv: int, causal: bool, page: int, cluster_ctas: int,
                 evict_first: bool) -> DenseSplitConfig:
    m_tiles = m_tiles_for(s_q, h_q, h_kv)
    cfg = DenseSplitConfig(dtype, s_q, h_q // h_kv, h_kv, causal, page, cluster_ctas,
                           cross_term_first=m_tiles == 1 or cluster_ctas > 1, evict_first=evict_first)
    rewrite = _experiment.get()
    return rewrite(cfg) if rewrite is not None else cfg


def dense_cluster_options(s_q: int, h_q: int, h_kv: int) -> tuple[int, ...]:
    """Cluster sizes a dense kernel of this shape can take: pairs sharing each KV tile with a multiple of 128
    query heads a KV head (two M tiles that read the same tiles, even when causal), 4-CTA clusters where a
    KV head has a multiple of four M tiles; else none (1)."""
    if (h_q // h_kv) % 128 != 0:
        return (1,)
    return (2, 4) if m_tiles_for(s_q, h_q, h_kv) % 4 == 0 else (2,)


def _dense_parts(schedule: DenseDecodeSchedule, device: DeviceFacts, s_q: int, h_q: int, h_kv: int,
                 cluster_ctas: int) -> tuple[int, int]:
    """(parts, fill parts): ``num_sm_parts``, else FlashMLA's rule, capped with 4-CTA clusters at the clusters
    the device holds at once (all parts of a plan run together); then as many fill parts of pairs as the SMs
    those clusters leave idle hold (none where the device's pairs do not tile its SMs)."""
    if schedule.num_sm_parts:
        return schedule.num_sm_parts, 0
    parts = num_sm_parts_for(device.num_sms, s_q, h_q, h_kv)
    if cluster_ctas != 4:
        return parts, 0
    m_tiles = m_tiles_for(s_q, h_q, h_kv)
    parts = max(min(parts, device.quad_clusters // (h_kv * m_tiles // 4)), 1)
    if 2 * device.pair_clusters != device.num_sms:
        return parts, 0
    idle = device.num_sms - 4 * parts * (h_kv * m_tiles // 4)
    return parts, max(idle, 0) // (2 * (h_kv * m_tiles // 2))


def _dense_plan(schedule: DenseDecodeSchedule, device: DeviceFacts, s_q: int, h_q: int, h_kv: int,
                cluster_ctas: int) -> tuple[int, int, SchedulerConfig]:
    """(parts with the fill parts, fill parts, the scheduler's config) of a plan of ``cluster_ctas``-CTA clusters."""
    parts, fill = _dense_parts(schedule, device, s_q, h_q, h_kv, cluster_ctas)
    policy = schedule.plan_policy(s_q * (h_q // h_kv))
    sched = SchedulerConfig(*policy, fill, schedule.idle_sm_fill_share) if fill else SchedulerConfig(*policy)
    return parts + fill, fill, sched


def dense_tensor_plan(schedule: DenseDecodeSchedule, *, rows: int, h_kv: int, device: DeviceFacts = HOPPER
                      ) -> tuple[int, SchedulerConfig]:
    """(parts, the scheduler's config) of the plan ``get_mla_decoding_metadata`` makes as tensors for requests of
    ``rows`` query rows a KV head (s_q times the heads a KV head serves): the plan of a dense call whose lengths
    the host does not know (``resolve_dense``'s capture step), a function of the rows and ``h_kv`` alone."""
    parts, _, sched = _dense_plan(schedule, device, 1, rows * h_kv, h_kv, 1)
    return parts, sched


def _dense_combine(schedule: DenseDecodeSchedule, dtype: str, s_q: int, group: int) -> CombineConfig:
    return CombineConfig(dtype, group, s_q, False, schedule.combine_chunked_batch, schedule.combine_spread_partials)


def _quad_kept(dtype: str, s_q: int, h_q: int, h_kv: int, causal: bool, page: int) -> bool:
    """Whether the split config of 4-CTA clusters stays one after the experiment in force (one that takes the
    clusters apart plans as the kernel it builds: pairs)."""
    return _dense_split(dtype, s_q, h_q, h_kv, causal, page, 4, False).cluster_ctas == 4


def resolve_dense(schedule: DenseDecodeSchedule, *, dtype: str, s_q: int, h_q: int, h_kv: int, causal: bool,
                  page: int, device: DeviceFacts = HOPPER, host_lengths=None) -> DenseCall:
    """The dense call's kernels and plan.  ``host_lengths``: the requests' lengths on the host (the first call
    with a metadata object has read them), else None (a plan the host does not know, as in a CUDA graph
    capture).  Rules: pairs where the shape allows them (``dense_cluster_options``), 4-CTA clusters for plans
    whose busiest part reads at least ``quad_multicast_tiles`` tiles, evict-first loads for plans whose busiest
    part reads at most ``evict_first_tiles``, the cross term first with one M tile or any cluster, the
    combine left out where the plan splits no request."""
    causal = causal and s_q > 1
    options = dense_cluster_options(s_q, h_q, h_kv)
    pairs = options[0]
    combine = _dense_combine(schedule, dtype, s_q, h_q // h_kv)
    capture_parts, capture_fill, capture_sched = _dense_plan(schedule, device, s_q, h_q, h_kv, pairs)
    capture = DenseStepConfig(_dense_split(dtype, s_q, h_q, h_kv, causal, page, pairs, False), combine, True,
                              capture_fill > 0)
    if host_lengths is None:
        return DenseCall(capture, capture, capture_parts, capture_fill, capture_sched)
    ctas = pairs
    if 4 in options and _quad_kept(dtype, s_q, h_q, h_kv, causal, page):
        quad_parts, _ = _dense_parts(schedule, device, s_q, h_q, h_kv, 4)
        quad_policy = schedule.plan_policy(s_q * (h_q // h_kv))  # planned without the fill parts
        if plan_facts(host_lengths, quad_parts, 64, *quad_policy)[1] >= schedule.quad_multicast_tiles:
            ctas = 4
    parts, fill, sched = _dense_plan(schedule, device, s_q, h_q, h_kv, ctas)
    split, busiest = plan_facts(host_lengths, parts, 64, *sched.policy())
    evict = busiest <= schedule.evict_first_tiles
    step = DenseStepConfig(_dense_split(dtype, s_q, h_q, h_kv, causal, page, ctas, evict), combine, split, fill > 0)
    return DenseCall(step, capture, parts, fill, sched)


def dense_precompile_steps(schedule: DenseDecodeSchedule, *, dtype: str, s_q: int, h_q: int, h_kv: int,
                           causal: bool, page: int, device: DeviceFacts = HOPPER) -> list:
    """Every (step, scheduler) a call of this shape can resolve to, for ``precompile``: each cluster size the
    shape allows, normal and evict-first loads (a 4-CTA plan's fill parts can bring its busiest part under
    ``evict_first_tiles``), with and without the combine."""
    causal = causal and s_q > 1
    combine = _dense_combine(schedule, dtype, s_q, h_q // h_kv)
    out = []
    for ctas in dense_cluster_options(s_q, h_q, h_kv):
        if ctas == 4 and not _quad_kept(dtype, s_q, h_q, h_kv, causal, page):
            continue
        _, fill, sched = _dense_plan(schedule, device, s_q, h_q, h_kv, ctas)
        for evict in (False, True):
            split = _dense_split(dtype, s_q, h_q, h_kv, causal, page, ctas, evict)
            for with_combine in (True, False):
                out.append((DenseStepConfig(split, combine, with_combine, fill > 0), sched))
    return list(dict.fromkeys(out))


def resolve_sparse(schedule: SparseDecodeSchedule, *, b: int, s_q: int, h_q: int, topk: int, has_sink: bool,
                   has_topk_length: bool, device: DeviceFacts = HOPPER, capturing: bool = False,
                   kv_format: str = "V32", extra_cache: str = "") -> SparseCall:
    """The sparse call's kernels and plan.  Rules: the crossover where the 64-head tiles pair; a small plan
    (``small_plan_tiles``, from the shapes) takes the small fixed cost and 16-bit partials and leaves the
    producer whole, other plans split the crossover's producer in halves; the combine is left out when every
    request has ``topk`` tokens (no ``topk_length``), the plan splits none and no CUDA graph is being captured.
    ``kv_format``: the cache's format; ``extra_cache``: a second cache's format ("": none; ``topk`` then counts
    both caches' tiles, and the kernel reads lengths: ``has_topk_length`` must be set)."""
    if extra_cache and not has_topk_length:
        raise ValueError("extra_cache: the kernel reads both caches' lengths; pass has_topk_length=True")
    parts = schedule.num_sm_parts or sparse_num_sm_parts_for(device.num_sms, s_q, h_q)
    split, combine, sched = _sparse_kernels(schedule, s_q, h_q, has_sink, has_topk_length,
                                            schedule.small_plan(b, topk, parts), kv_format, extra_cache)
    capture = SparseStepConfig(split, combine, True)
    step = capture
    if not has_topk_length and not capturing and not _topk_plan_has_split(b, topk, parts, sched.policy()):
        step = SparseStepConfig(split, combine, False)
    return SparseCall(step, capture, parts, sched)


def sparse_tensor_plan(schedule: SparseDecodeSchedule, *, b: int, s_q: int, h_q: int, topk: int,
                       device: DeviceFacts = HOPPER) -> tuple[int, SchedulerConfig]:
    """(parts, the scheduler's config) of the plan ``get_mla_decoding_metadata`` makes as tensors for ``b``
    requests of ``topk`` tokens each over one cache: ``resolve_sparse``'s, a function of the shapes alone (not of
    the sink, the format or ``topk_length``)."""
    call = resolve_sparse(schedule, b=b, s_q=s_q, h_q=h_q, topk=topk, has_sink=False, has_topk_length=False,
                          device=device, capturing=True)
    return call.parts, call.scheduler


def _sparse_kernels(schedule: SparseDecodeSchedule, s_q: int, h_q: int, has_sink: bool, has_topk_length: bool,
                    small: bool, kv_format: str, extra_cache: str = ""
                    ) -> tuple[SparseSplitConfig, CombineConfig, SchedulerConfig]:
    """The split kernel's, the combine's and the scheduler's configs of a small plan or another: the crossover
    where the 64-head tiles pair (with producer halves unless small), 16-bit partials and the small fixed cost
    for small plans; the cache format is the kernel's."""
    crossover = -(-h_q // 64) % 2 == 0
    split = SparseSplitConfig(s_q, h_q, has_sink, has_topk_length, crossover,
                              producer_halves=crossover and not small, partials_16bit=small, kv_format=kv_format,
                              extra_cache=extra_cache)
    combine = CombineConfig("bfloat16", h_q, s_q, has_sink, schedule.combine_chunked_batch,
                            schedule.combine_spread_partials)
    lengths = "two_caches" if extra_cache else "topk"
    return split, combine, SchedulerConfig(*schedule.plan_policy(s_q * h_q, small), lengths=lengths)


def sparse_precompile_steps(schedule: SparseDecodeSchedule, *, s_q: int, h_q: int, has_sink: bool,
                            has_topk_length: bool, kv_format: str = "V32", extra_cache: str = "") -> list:
    """Every (step, scheduler) a sparse call of this shape can resolve to: small plans and others, with the
    combine and, without ``topk_length`` (nor an extra cache, whose kernel reads lengths), without it."""
    out = []
    has_topk_length = has_topk_length or bool(extra_cache)
    for small in ((False, True) if schedule.small_plan_tiles else (False,)):
        split, combine, sched = _sparse_kernels(schedule, s_q, h_q, has_sink, has_topk_length, small, kv_format,
                                                extra_cache)
        for with_combine in ((True,) if has_topk_length else (True, False)):
            out.append((SparseStepConfig(split, combine, with_combine), sched))
    return out


def resolve_dense_invariant(schedule: DenseDecodeSchedule, *, dtype: str, s_q: int, h_q: int, h_kv: int,
                            causal: bool, page: int, device: DeviceFacts = HOPPER) -> DenseStepConfig:
    """The step every batch size of a batch-invariant dense call runs (``enable_batch_invariant=True``; its plan:
    ``planner.call_invariant_plan``): ``resolve_dense``'s step of a plan the host does not know (no choice made
    from the lengths), with the combine on its unchunked path (whose choice depends on the batch size)."""
    fixed = dataclasses.replace(schedule, combine_chunked_batch=0, combine_spread_partials=0)
    call = resolve_dense(fixed, dtype=dtype, s_q=s_q, h_q=h_q, h_kv=h_kv, causal=causal, page=page, device=device)
    return call.capture_step


def resolve_sparse_invariant(schedule: SparseDecodeSchedule, *, s_q: int, h_q: int, has_sink: bool,
                             has_topk_length: bool, kv_format: str = "V32", extra_cache: str = "") -> SparseStepConfig:
    """The step every batch size of a batch-invariant sparse call runs: the kernel of plans that are not small (fp32
    partials; a small plan is a batch-size fact), with the combine on its unchunked path."""
    if extra_cache and not has_topk_length:
        raise ValueError("extra_cache: the kernel reads both caches' lengths; pass has_topk_length=True")
    fixed = dataclasses.replace(schedule, small_plan_tiles=0, combine_chunked_batch=0, combine_spread_partials=0)
    split, combine, _ = _sparse_kernels(fixed, s_q, h_q, has_sink, has_topk_length, False, kv_format, extra_cache)
    return SparseStepConfig(split, combine, True)


@functools.lru_cache(maxsize=64)
def _topk_plan_has_split(b: int, topk: int, parts: int, policy: tuple) -> bool:
    """Whether the plan of ``b`` requests of ``topk`` tokens each splits one: the same on every decode step,
    so the host walk runs once."""
    import torch

    return plan_has_split(torch.full((b,), topk, dtype=torch.int64), parts, 64, *policy)


@dataclasses.dataclass(frozen=True)
class SparsePrefillCall:
    """A sparse prefill call resolved: the kernel's config and its part count (CTAs a 64-head tile; each
    serves an even share of the query tokens)."""

    config: SparsePrefillConfig
    parts: int


def resolve_sparse_prefill(*, s_q: int, h_q: int, d_qk: int, has_sink: bool, has_topk_length: bool,
                           device: DeviceFacts = HOPPER) -> SparsePrefillCall:
    """The prefill call's kernel and parts.  Rules: one CTA an SM, the head tiles of a token side by side
    (their CTAs read the same rows at about the same time, so the second read hits L2), never more parts than
    tokens."""
    parts = max(1, min(s_q, device.num_sms // m_tiles_for(1, h_q, 1)))
    return SparsePrefillCall(SparsePrefillConfig(h_q, d_qk, has_sink, has_topk_length), parts)


def sparse_prefill_precompile_configs(*, h_q: int, d_qk: int, has_sink: bool,
                                      has_topk_length: bool) -> list[SparsePrefillConfig]:
    """Every kernel a prefill call of this configuration can resolve to (one: the part count is a launch
    argument)."""
    return [resolve_sparse_prefill(s_q=1, h_q=h_q, d_qk=d_qk, has_sink=has_sink,
                                   has_topk_length=has_topk_length).config]


@dataclasses.dataclass(frozen=True)
class SparsePrefillFp8Call:
    """A sparse prefill call over the paged FP8 cache resolved: the sparse decode kernel that serves it (a query
    token as a request of one position, writing max_logits, never split) and its part count, for
    ``planner.whole_token_plan``."""

    step: SparseStepConfig
    parts: int


def resolve_sparse_prefill_fp8(*, s_q: int, h_q: int, has_sink: bool, has_topk_length: bool,
                               device: DeviceFacts = HOPPER) -> SparsePrefillFp8Call:
    """The FP8-cache prefill call's kernel and parts.  Rules: the decode kernel's crossover where the 64-head
    tiles pair, with its producer halves (a prefill plan is not small); one CTA an SM for each head tile of a
    token (``sparse_num_sm_parts_for`` at one position), never more parts than tokens; whole tokens, so no
    combine."""
    crossover = -(-h_q // 64) % 2 == 0
    split = SparseSplitConfig(1, h_q, has_sink, has_topk_length, crossover, producer_halves=crossover,
                              partials_16bit=False, max_logits=True)
    combine = CombineConfig("bfloat16", h_q, 1, has_sink)  # part of the step's key only: never launched
    parts = max(1, min(s_q, sparse_num_sm_parts_for(device.num_sms, 1, h_q)))
    return SparsePrefillFp8Call(SparseStepConfig(split, combine, False), parts)
