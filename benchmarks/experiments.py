"""Named experiment configs: kernel variants that no resolver rule picks, kept to measure the default
against.  Each is a rewrite of the dense split config the resolver returns, applied with
``mla_cute.schedules.experiment``::

    with mla_cute.schedules.experiment(EXPERIMENTS["serial"]):
        meta = mla_cute.get_mla_metadata()[0]
        out, lse = mla_cute.flash_mla_with_kvcache(..., meta, ...)   # the serial baseline's kernels

A metadata object made inside the block keeps its kernels after it.  (Pairs instead of 4-CTA clusters need no
experiment: ``DenseDecodeSchedule(quad_multicast_tiles=2**30)``.)
"""

from __future__ import annotations

import dataclasses

EXPERIMENTS = {
    # The serial kernel (``kernels/dense_serial.py``): every step of a tile waits for the previous one; normal loads
    # (the baseline's, whatever the plan).
    "serial": lambda c: dataclasses.replace(c, kernel="serial", cluster_ctas=1, cross_term_first=False,
                                            evict_first=False),
    # The seesaw in FlashMLA's step order, and without tile multicast.
    "cross_term_last": lambda c: dataclasses.replace(c, cross_term_first=False),
    "no_multicast": lambda c: dataclasses.replace(c, cluster_ctas=1, cross_term_first=c.m_tiles == 1),
    "evict_first": lambda c: dataclasses.replace(c, evict_first=True),
    "normal_loads": lambda c: dataclasses.replace(c, evict_first=False),
}
