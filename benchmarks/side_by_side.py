"""mla-cute beside FlashMLA's SM90 kernels (the ``flash_mla`` package, every call ``use_legacy=True``), on the
same inputs, in one process, interleaved: the dense and the sparse benchmark in one run.

    python benchmarks/side_by_side.py [--kind dense|sparse|all] [--rows 0,3] [--rounds 5]
                                      [--schedules "default;serial"] [--out rows.json]

Rows, inputs, timing and ratio are those of ``bench_decode.py`` (dense) and ``bench_sparse.py`` (sparse FP8
decode), by ``flashmla_side.py``: each round times FlashMLA and every mla-cute schedule once, the order rotated
from round to round; a row reports each one's median over the rounds and ``ratio`` = FlashMLA's median / ours
(above 1: mla-cute faster), with every out compared to FlashMLA's (relative Frobenius error).  ``--rounds 0``
compiles and checks only.  Where ``flash_mla`` does not import, the ratios are the anchor files', marked
"remembered, another board".
"""

from __future__ import annotations

import sys

import bench_decode
import bench_sparse
import flashmla_side

KINDS = {"dense": [bench_decode], "sparse": [bench_sparse], "all": [bench_decode, bench_sparse]}


def main():
    ap = flashmla_side.parser("mla-cute schedules, as bench_decode.py / bench_sparse.py name them", rounds=5)
    ap.add_argument("--kind", choices=list(KINDS), default="all")
    args = ap.parse_args()
    flashmla_side.main(KINDS[args.kind], args)


if __name__ == "__main__":
    sys.exit(main())
