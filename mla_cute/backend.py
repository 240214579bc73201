"""Backend selection: ``cute`` kernels on SM90 CUDA tensors, ``reference`` on CPU.

Override with the ``backend=`` argument or the ``MLA_CUTE_BACKEND`` environment
variable.  A GPU never falls back silently: a missing kernel raises
NotImplementedError, and a non-Hopper GPU needs ``backend="reference"``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import NamedTuple, Optional

import torch

BACKENDS = ("reference", "cute")
ENV_VAR = "MLA_CUTE_BACKEND"


_sm90: dict = {}
_num_sms: dict = {}
_cluster_slots: dict = {}
# SM count assumed when planning without a GPU (CPU tensors): an H100/H200.
HOPPER_NUM_SMS = 132
# Clusters of 1, 2 and 4 CTAs of a whole SM each (over 114 KiB of shared memory) that an H200 holds at once,
# measured with cuOccupancyMaxActiveClusters: the SMs of a GPC hold whole clusters only, so 4-CTA clusters
# leave 12 of the 132 SMs idle.  Assumed when planning without a GPU.
HOPPER_CLUSTER_SLOTS = {1: 132, 2: 66, 4: 30}
# An empty kernel to ask the driver how many clusters fit (the count depends on the launch shape only).
_EMPTY_PTX = b".version 8.0\n.target sm_90a\n.address_size 64\n.visible .entry empty()\n{\n ret;\n}\n\0"


def num_sms(device: torch.device) -> int:
    """Multiprocessors of ``device`` (cached); ``HOPPER_NUM_SMS`` for a CPU device."""
    if device.type != "cuda":
        return HOPPER_NUM_SMS
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _num_sms:
        _num_sms[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _num_sms[idx]


def cluster_slots(device: torch.device, ctas: int, smem_bytes: int, threads: int) -> int:
    """How many clusters of ``ctas`` CTAs, each with ``smem_bytes`` of dynamic shared memory and ``threads``
    threads, ``device`` runs at once (cached).  A device without the kernels (the CPU, or a GPU other than SM90,
    which the reference backend plans for as if it were an H200) gets ``HOPPER_CLUSTER_SLOTS``: the query loads
    an sm_90a kernel."""
    if not is_sm90(device):
        return HOPPER_CLUSTER_SLOTS[ctas]
    idx = device.index if device.index is not None else torch.cuda.current_device()
    key = (idx, ctas, smem_bytes, threads)
    if key not in _cluster_slots:
        _cluster_slots[key] = _query_cluster_slots(idx, ctas, smem_bytes, threads)
    return _cluster_slots[key]


def _query_cluster_slots(idx: int, ctas: int, smem_bytes: int, threads: int) -> int:
    from cuda.bindings import driver as cu

    def ok(result):
        if result[0] != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver call failed while counting {ctas}-CTA clusters: {result[0]}")
        return result[1] if len(result) > 1 else None

    # The device's primary context (the one torch uses), current for the query only.
    ok(cu.cuInit(0))
    dev = ok(cu.cuDeviceGet(idx))
    ctx = ok(cu.cuDevicePrimaryCtxRetain(dev))
    ok(cu.cuCtxPushCurrent(ctx))
    try:
        module = ok(cu.cuModuleLoadData(_EMPTY_PTX))
        try:
            fn = ok(cu.cuModuleGetFunction(module, b"empty"))
            ok(cu.cuFuncSetAttribute(fn, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                     smem_bytes))
            config = cu.CUlaunchConfig()
            config.gridDimX, config.gridDimY, config.gridDimZ = 1, ctas, 1
            config.blockDimX, config.blockDimY, config.blockDimZ = threads, 1, 1
            config.sharedMemBytes = smem_bytes
            attr = cu.CUlaunchAttribute()
            attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = 1, ctas, 1
            config.attrs = [attr]
            config.numAttrs = 1
            return int(ok(cu.cuOccupancyMaxActiveClusters(fn, config)))
        finally:
            ok(cu.cuModuleUnload(module))
    finally:
        ok(cu.cuCtxPopCurrent())
        ok(cu.cuDevicePrimaryCtxRelease(dev))


class DensePlanChoice(NamedTuple):
    """What a dense plan runs on: the schedule with ``multicast_ctas`` decided, the part count (fill parts
    included), the last parts that the idle-SM fill's pairs run (``dense_fill_parts``; 0: none), the planner's
    arguments after the part count (``plan_splits(lengths, parts, 64, *policy)``, ``compile_scheduler(*policy)``),
    and the plan's ``plan_facts`` (None without the lengths)."""

    schedule: object
    parts: int
    fill_parts: int
    policy: tuple
    facts: Optional[tuple]


def dense_plan_schedule(device: torch.device, schedule, s_q: int, h_q: int, h_kv: int, causal: bool,
                        host_lengths=None) -> DensePlanChoice:
    """The ``DensePlanChoice`` for requests of ``host_lengths`` (their lengths on the host; None: a plan the
    host does not know).  ``multicast_ctas=None`` takes 4-CTA clusters where the busiest part of their plan
    (without fill parts) reads at least ``quad_multicast_tiles`` tiles."""
    from .schedules import plan_facts

    policy = schedule.plan_policy(s_q * (h_q // h_kv))
    resolved = schedule.multicast_for_plan(None)
    if host_lengths is not None and schedule.multicast_ctas is None:
        quad = dataclasses.replace(schedule, multicast_ctas=4)
        if quad.cluster_ctas_of_call(s_q, h_q, h_kv, causal) == 4:
            parts = dense_num_parts(device, quad, s_q, h_q, h_kv, causal)
            resolved = schedule.multicast_for_plan(plan_facts(host_lengths, parts, 64, *policy)[1])
    parts = dense_num_parts(device, resolved, s_q, h_q, h_kv, causal)
    fill = dense_fill_parts(device, resolved, s_q, h_q, h_kv, causal, parts)
    if fill:
        parts += fill
        policy += (fill, resolved.idle_sm_fill_share)
    facts = None if host_lengths is None else plan_facts(host_lengths, parts, 64, *policy)
    return DensePlanChoice(resolved, parts, fill, policy, facts)


def dense_num_parts(device: torch.device, schedule, s_q: int, h_q: int, h_kv: int, causal: bool) -> int:
    """The dense kernels' part count: ``schedule.num_sm_parts``, else FlashMLA's rule
    (``num_sm_parts_for``), capped with 4-CTA clusters at the clusters the device holds at once (a
    part is one cluster for each KV head and four M tiles): a plan's parts must all run together.
    Without the idle-SM fill's parts (``dense_fill_parts``)."""
    from .schedules import m_tiles_for, num_sm_parts_for

    if schedule.num_sm_parts:
        return schedule.num_sm_parts
    parts = num_sm_parts_for(num_sms(device), s_q, h_q, h_kv)
    if schedule.cluster_ctas_of_call(s_q, h_q, h_kv, causal) == 4:
        clusters_per_part = h_kv * m_tiles_for(s_q, h_q, h_kv) // 4
        parts = max(min(parts, cluster_slots(device, 4, schedule.smem_bytes(), 384) // clusters_per_part), 1)
    return parts


def dense_fill_parts(device: torch.device, schedule, s_q: int, h_q: int, h_kv: int, causal: bool,
                     parts: int) -> int:
    """How many parts of pairs the idle-SM fill (``kernels/fill.py``) adds to a plan of ``parts`` parts of 4-CTA
    clusters: as many as the SMs those clusters leave hold (a part is a pair for each KV head and two M tiles).
    0 without ``idle_sm_fill``, with a user's ``num_sm_parts``, or without 4-CTA clusters; and where the device
    holds fewer pairs than half its SMs (a GPC of an odd SM count: what the clusters leave need not hold
    whole pairs, and a pair that waits for an SM would run after the clusters)."""
    from .schedules import m_tiles_for

    if not schedule.idle_sm_fill or schedule.num_sm_parts or schedule.cluster_ctas_of_call(s_q, h_q, h_kv, causal) != 4:
        return 0
    sms = num_sms(device)
    if 2 * cluster_slots(device, 2, schedule.smem_bytes(), 384) != sms:
        return 0
    m_tiles = m_tiles_for(s_q, h_q, h_kv)
    idle = sms - 4 * parts * (h_kv * m_tiles // 4)
    return max(idle, 0) // (2 * (h_kv * m_tiles // 2))


def is_sm90(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    hit = _sm90.get(idx)
    if hit is None:
        hit = _sm90[idx] = torch.cuda.get_device_capability(idx) == (9, 0)
    return hit


def select_backend(device: torch.device, backend: Optional[str] = None) -> str:
    choice = backend if backend is not None else os.environ.get(ENV_VAR) or None
    if choice is not None:
        if choice not in BACKENDS:
            source = "backend" if backend is not None else ENV_VAR
            raise ValueError(f"{source} must be one of {BACKENDS}, got {choice!r}")
        if choice == "cute" and not is_sm90(device):
            raise ValueError(f"the 'cute' backend needs CUDA tensors on an SM90 (Hopper) GPU, got device {device}")
        return choice
    if device.type == "cpu":
        return "reference"
    if is_sm90(device):
        return "cute"
    raise NotImplementedError(
        f"no kernels for device {device} (compute capability {torch.cuda.get_device_capability(device)}); "
        f"mla-cute's kernels need SM90. Pass backend='reference' (or set {ENV_VAR}=reference) for the torch reference."
    )
