"""Named hardware barrier ids, one enum per kernel family (0 is __syncthreads; ids up to 15)."""

from __future__ import annotations

import enum


class SerialBarrier(enum.IntEnum):
    """The serial consumers (``serial_consumer.SplitKVConsumer``: the dense baseline kernel)."""

    ROW_MAX = 1  # both consumer warpgroups published their partial row max
    P_READY = 2  # both halves of P are in sP (and out-of-range V rows are zeroed)
    ROW_SUM = 3  # both consumer warpgroups published their partial row sum


class SeesawBarrier(enum.IntEnum):
    """The dense seesaw kernel (``dense_seesaw.py``; the steps in ``seesaw.py``)."""

    SCALE0 = 1  # WG0 -> WG1: m0 and sScale0 written (cross term first: sP0 too)
    SCALE1 = 2  # WG1 -> WG0: m1 and sScale1 written (cross term first: sP1 too)
    P0_READY = 3  # WG0 -> WG1: sP0 written
    P1_ISSUED = 4  # WG1 -> WG0: sP1 written, and P0 V0_R issued
    ROW_SUM = 5  # both: the epilogue's sums
    MAX_INIT = 6  # WG0 only: sM reset for a request
    OUT_STAGED = 7  # both: the final rows are in sQ's bytes
    P0_READ = 8  # cross term first, WG1 -> WG0: P0 V0_R has read sP0 (instead of P0_READY and P1_ISSUED)


class SparseBarrier(enum.IntEnum):
    """The sparse FP8 decode kernel's leader and follower (``leader_follower.py``, ``sparse_decode_fp8.py``)."""

    P_READY = 1
    P_FREE = 2
    ROW_SUM = 3
    OUT_STAGED = 4
    OUT_COPIED = 5  # the follower's 128 threads only: the staged rows are copied out
    Q_CONVERTED = 6  # the leader's 128 threads: Q is in the operand type
