"""Device queries: SM90 or not, the SM count, and how many clusters of the dense kernel a GPU holds at once
(through the CUDA driver), as the resolvers' ``DeviceFacts``."""

from __future__ import annotations

from typing import Optional

import torch

from .schedules.resolve import DENSE_SMEM_BYTES, DENSE_THREADS, HOPPER, DeviceFacts

_sm90: dict = {}
_num_sms: dict = {}
_cluster_slots: dict = {}
_facts: dict = {}
# Clusters of 1, 2 and 4 CTAs of a whole SM each (over 114 KiB of shared memory) that an H200 holds at once,
# measured with cuOccupancyMaxActiveClusters: the SMs of a GPC hold whole clusters only, so 4-CTA clusters
# leave 12 of the 132 SMs idle.  Assumed when planning without a GPU.
HOPPER_CLUSTER_SLOTS = {1: HOPPER.num_sms, 2: HOPPER.pair_clusters, 4: HOPPER.quad_clusters}
# An empty kernel to ask the driver how many clusters fit (the count depends on the launch shape only).
_EMPTY_PTX = b".version 8.0\n.target sm_90a\n.address_size 64\n.visible .entry empty()\n{\n ret;\n}\n\0"


def capture_id(device: torch.device) -> Optional[int]:
    """The id of the CUDA graph capture under way on ``device``'s current stream (the runtime's, unique among the
    process's captures); None where the runtime does not say."""
    from cuda.bindings import runtime

    stream = torch.cuda.current_stream(device).cuda_stream
    try:
        err, _status, cid = runtime.cudaStreamGetCaptureInfo(stream)[:3]
    except (TypeError, ValueError, RuntimeError):
        return None
    return int(cid) if err == runtime.cudaError_t.cudaSuccess else None


def num_sms(device: torch.device) -> int:
    """Multiprocessors of ``device`` (cached); ``HOPPER.num_sms`` for a CPU device."""
    if device.type != "cuda":
        return HOPPER.num_sms
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


def is_sm90(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    hit = _sm90.get(idx)
    if hit is None:
        hit = _sm90[idx] = torch.cuda.get_device_capability(idx) == (9, 0)
    return hit


def device_facts(device: torch.device) -> DeviceFacts:
    """The resolvers' facts of ``device`` (cached): its SM count, and its cluster counts from the driver; a GPU
    other than SM90 (which the reference backend plans for) its SM count and an H200's cluster counts, the CPU
    an H200's."""
    if device.type != "cuda":
        return HOPPER
    if not is_sm90(device):
        return DeviceFacts(num_sms(device), HOPPER.pair_clusters, HOPPER.quad_clusters)
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _facts:
        _facts[idx] = DeviceFacts(num_sms(device), cluster_slots(device, 2, DENSE_SMEM_BYTES, DENSE_THREADS),
                                  cluster_slots(device, 4, DENSE_SMEM_BYTES, DENSE_THREADS))
    return _facts[idx]
