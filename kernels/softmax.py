"""Online-softmax pieces the consumers share: the running max's slack, O's rescale, the attention sink's
factor, the length mask, and each thread's row state."""

from __future__ import annotations

import dataclasses
from typing import Any

import cutlass
import cutlass.cute as cute



# A running max moves only when a tile's row max exceeds it by more than this (log2 units), so P stays
# below 2^8 and the factor of most tiles is exactly 1: the warpgroups skip rescaling O (the leader-
# follower and seesaw softmaxes; FlashAttention 4's conditional rescaling).
MAX_SLACK = 8.0


@cute.jit
def rescale_o(acc_o, factor):
    """A WGMMA accumulator's rows (O, or S / P) *= factor (value e is in the thread's row (e // 2) % 2);
    skipped when both factors are 1, as they are once the row maxima have settled."""
    if cutlass.min(factor[0], factor[1]) != 1.0:
        for e in cutlass.range_constexpr(cute.size(acc_o)):
            acc_o[e] = acc_o[e] * factor[(e // 2) % 2]


@cute.jit
def sink_factor(sink2, lse2):
    """exp2(lse2) / (exp2(lse2) + exp2(sink2)); 0 when nothing was attended (lse2 infinite)."""
    f = cutlass.Float32(0.0)
    if lse2 > -cutlass.Float32.inf and lse2 < cutlass.Float32.inf:
        f = 1.0 / (1.0 + cute.math.exp2(sink2 - lse2, fastmath=False))
    return f


@dataclasses.dataclass
class LengthMask:
    """Keys at or past ``limit[i]`` (relative to the warpgroup's first token) are masked in row i."""

    limit: Any

    @cute.jit
    def apply(self, s, c, i):
        if c >= self.limit[i]:
            s = -cutlass.Float32.inf
        return s


@dataclasses.dataclass
class RowState:
    """The thread's two query rows (row0, row0 + 8): running max and sum, causal shift; ``exact_max``: the
    rows' true max raw score (the running max lags it by up to ``MAX_SLACK``), where a kernel writes
    max_logits from it, else None."""

    row0: Any
    row_max: Any
    row_sum: Any
    shift: Any
    exact_max: Any = None
