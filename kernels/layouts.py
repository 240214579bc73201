"""Layouts: the shared-memory tiles (swizzled Q, K / V and P; the row exchanges; the staging rows) and the
views that let the kernels write FlashMLA's output layouts directly.

The kernels address query rows per KV head, row = s * group + head_in_group.  The user's
``out [b, s_q, h_q, 512]`` and ``lse [b, h_q, s_q]`` are seen as ``(b, h_kv, (group, s_q), ...)``
with a hierarchical row mode, so a flat row index lands on the right element and no
transpose or copy is needed after the kernels.
"""

from __future__ import annotations

import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.tensor_utils import LayoutEnum

from .constants import BLOCK_M, BLOCK_N, D_QK, D_V, HALF_V


def out_rows(mOut: cute.Tensor, h_kv: int, group: int, s_q: int) -> cute.Tensor:
    """[b, s_q, h_q, d] -> (b, h_kv, (group, s_q), d)."""
    s = mOut.stride
    layout = cute.make_layout(
        (mOut.shape[0], h_kv, (group, s_q), mOut.shape[3]),
        stride=(s[0], group * s[2], (s[2], s[1]), s[3]),
    )
    return cute.make_tensor(mOut.iterator, layout)


def lse_rows(mLse: cute.Tensor, h_kv: int, group: int, s_q: int) -> cute.Tensor:
    """[b, h_q, s_q] -> (b, h_kv, (group, s_q))."""
    s = mLse.stride
    layout = cute.make_layout((mLse.shape[0], h_kv, (group, s_q)), stride=(s[0], group * s[1], (s[1], s[2])))
    return cute.make_tensor(mLse.iterator, layout)


def make_smem_layouts(dtype, kv_stages: int, d_qk: int = D_QK):
    """Swizzled layouts (sQ, sK, sV, sP): sQ 64 x d_qk; sK kv_stages x (64 tokens x 576), K-major;
    sV the MN-major view of the same bytes (576 features x 64 tokens, only 512 used); sP 64 x 64."""
    k_major = LayoutEnum.ROW_MAJOR  # K-major operand (A or B)
    mn_major = LayoutEnum.COL_MAJOR
    sQ = cute.slice_(sm90_utils.make_smem_layout_a(k_major, (BLOCK_M, BLOCK_N, d_qk), dtype, 1), (None, None, 0))
    sK = sm90_utils.make_smem_layout_b(k_major, (BLOCK_M, BLOCK_N, D_QK), dtype, kv_stages)
    sV = sm90_utils.make_smem_layout_b(mn_major, (BLOCK_M, D_QK, BLOCK_N), dtype, kv_stages)
    sP = cute.slice_(sm90_utils.make_smem_layout_a(k_major, (BLOCK_M, HALF_V, BLOCK_N), dtype, 1), (None, None, 0))
    return sQ, sK, sV, sP


def make_q_pipeline(storage, q_bytes: int):
    """The Q tile's barrier pair: one TMA producer thread, the 8 consumer warps release it."""
    return pipeline.PipelineTmaAsync.create(
        barrier_storage=storage.q_mbar.data_ptr(),
        num_stages=1,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 8),
        tx_count=q_bytes,
        defer_sync=True,
    )


def operand_tiles(storage, sQ_layout, sK_layout, sV_layout, sP_layout):
    """sQ, sK, sV (the MN-major view of sK's bytes) and sP over a kernel's shared storage."""
    sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
    sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
    sV = cute.make_tensor(cute.recast_ptr(sK.iterator, sV_layout.inner), sV_layout.outer)
    sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)
    return sQ, sK, sV, sP


def row_exchange(storage):
    """(sMax, sSum): each consumer warpgroup's partial row max and row sum, [64 rows][2]."""
    layout = cute.make_layout((BLOCK_M, 2))
    return storage.row_max.get_tensor(layout), storage.row_sum.get_tensor(layout)


# Staging rows for final outputs: 16 bytes of padding per row, so the accumulator's stores, 8 rows
# per instruction, fall in distinct banks.
STAGED_PITCH = D_V + 8


def staged_rows_layout():
    """64 rows x 512 columns of 16-bit output at ``STAGED_PITCH`` elements per row (66 560 bytes)."""
    return cute.make_layout((BLOCK_M, D_V), stride=(STAGED_PITCH, 1))
