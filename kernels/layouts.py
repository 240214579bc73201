"""Views that let the kernels write FlashMLA's output layouts directly.

The kernels address query rows per KV head, row = s * group + head_in_group.  The user's
``out [b, s_q, h_q, 512]`` and ``lse [b, h_q, s_q]`` are seen as ``(b, h_kv, (group, s_q), ...)``
with a hierarchical row mode, so a flat row index lands on the right element and no
transpose or copy is needed after the kernels.
"""

from __future__ import annotations

import cutlass.cute as cute


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
