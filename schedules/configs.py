"""Kernel configs: what the generated code of one kernel depends on, frozen and complete.

A resolver (``resolve.py``) makes them from a schedule, the call's shapes, the plan and the device; the
kernels (``mla_cute.kernels``) and their compile entry points read only these, and the compile cache keys
on them, so equal kernels share one key whatever schedule led to them.  Every field is decided: no
``None`` meaning "choose later".
"""

from __future__ import annotations

import dataclasses

from .planner import FILL_SHARE_ONE

SCHEDULER_LENGTHS = ("dense", "topk", "two_caches")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """The GPU planner's policy (``kernels/scheduler.py``; the host twin is ``planner.plan_splits``), in
    64-token blocks: the fixed cost per request piece, the slacks for whole requests and even pieces, and
    the idle-SM fill's parts (0: none) with their share of a part's blocks, in sixteenths.

    ``lengths``: what a request's length is made of, from the tensors the scheduler reads (``SCHEDULER_LENGTHS``):
    "dense" cache_seqlens, each within [0, max_len]; "topk" sparse decode's topk_length, each within [1, topk];
    "two_caches" a request's main tokens (within [0, topk]) in whole 64-token tiles, then its extra cache's
    tokens (within [0, extra_topk]), at least 1."""

    fixed_cost: int
    unsplit_slack: int = 0
    even_split_slack: int = 0
    fill_parts: int = 0
    fill_share: int = FILL_SHARE_ONE
    lengths: str = "dense"

    def __post_init__(self):
        if self.lengths not in SCHEDULER_LENGTHS:
            raise ValueError(f"lengths must be one of {SCHEDULER_LENGTHS}, got {self.lengths!r}")

    def policy(self) -> tuple:
        """``plan_splits``' arguments after the part count."""
        return (self.fixed_cost, self.unsplit_slack, self.even_split_slack, self.fill_parts, self.fill_share)


@dataclasses.dataclass(frozen=True)
class CombineConfig:
    """The split-KV combine (``kernels/combine.py``) for ``group`` query heads a KV head at ``s_q``
    positions: the largest batch whose rows go to 4 column-chunk CTAs, and the parts a request spans from
    which a chunk is merged by 8 warps (0: never, for either)."""

    dtype: str
    group: int
    s_q: int
    has_sink: bool = False
    chunked_batch: int = 4
    spread_partials: int = 48


@dataclasses.dataclass(frozen=True)
class DenseSplitConfig:
    """One dense decode split kernel: ``dtype`` (the cache's and the output's), ``s_q`` positions of
    ``group`` query heads a KV head over ``h_kv`` KV heads, causal masking, the page size; how many M
    tiles share each KV tile in a cluster (1: none, 2: a pair, 4), whether the seesaw's second warpgroup
    issues the cross term first, and whether KV loads are evict-first in L2.  ``kernel`` names the
    kernel: "seesaw" (every resolver's), or "serial", the baseline kept to measure gains against
    (``kernels/dense_serial.py``; it takes ``cluster_ctas`` 1 and ignores ``cross_term_first``)."""

    dtype: str
    s_q: int
    group: int
    h_kv: int
    causal: bool
    page: int
    cluster_ctas: int
    cross_term_first: bool
    evict_first: bool
    kernel: str = "seesaw"

    @property
    def rows(self) -> int:
        """A KV head's query rows."""
        return self.s_q * self.group

    @property
    def m_tiles(self) -> int:
        return -(-self.rows // 64)


@dataclasses.dataclass(frozen=True)
class DenseStepConfig:
    """What one dense decode call launches: the split kernel, behind one entry with the combine when the
    plan may split a request (``with_combine``), and with ``fill`` the idle-SM fill's pairs after 4-CTA
    clusters (``kernels/fill.py``)."""

    split: DenseSplitConfig
    combine: CombineConfig
    with_combine: bool
    fill: bool = False


def check_extra_format(kv_format: str, extra: str, name: str) -> None:
    """The extra caches the sparse kernel reads beside a ``kv_format`` main cache: none (""), one of its format, or
    V41_FP4 beside V41 / V41_PAGED (ValueError naming ``name`` otherwise)."""
    if extra not in ("", kv_format) and not (extra == "V41_FP4" and kv_format in ("V41", "V41_PAGED")):
        raise ValueError(f"{name}: the kernel reads an extra cache of the main cache's format ({kv_format}) or "
                         f"V41_FP4 beside V41 / V41_PAGED, got {extra!r}")


@dataclasses.dataclass(frozen=True)
class SparseSplitConfig:
    """One sparse FP8 decode split kernel: ``s_q`` tokens of ``h_q`` heads, with an attention sink, with
    per-request ``topk_length``; the crossover (head tiles in pairs sharing each token tile), the crossover's
    producer halves, and 16-bit split partials.  ``max_logits``: the kernel also writes each row's max scaled
    logit (prefill from the FP8 cache, ``flash_mla_sparse_fwd``); its plans never split a request
    (``planner.whole_token_plan``), so no combine is needed.  ``kv_format``: the cache's format
    (``kernels/cache_rows.py``): "V32" (656-byte rows, d_qk 576), "V32_NO_ROPE", "V41" (528), "V41_PAGED" (528,
    page-blocked) or "V4" (584, page-blocked), d_qk 512.  ``extra_cache``: the format of a second cache
    (``extra_k_cache``, its own page size; "": none), its tokens after the main ones in one softmax
    (``kernels/sparse_tiles.py``): the main cache's format, or "V41_FP4" beside a V41 or V41_PAGED main cache;
    the kernel then takes both caches' lengths, so ``has_topk_length`` is set."""

    s_q: int
    h_q: int
    has_sink: bool
    has_topk_length: bool
    crossover: bool
    producer_halves: bool
    partials_16bit: bool
    max_logits: bool = False
    kv_format: str = "V32"
    extra_cache: str = ""

    def __post_init__(self):
        if isinstance(self.extra_cache, bool):  # True: an extra cache of the main format (the field was a bool)
            object.__setattr__(self, "extra_cache", self.kv_format if self.extra_cache else "")
        if self.extra_cache and not self.has_topk_length:
            raise ValueError("extra_cache: the kernel reads both caches' lengths, so has_topk_length must be set")
        check_extra_format(self.kv_format, self.extra_cache, "extra_cache")

    @property
    def head_tiles(self) -> int:
        return -(-self.h_q // 64)

    @property
    def d_qk(self) -> int:
        return 576 if self.kv_format == "V32" else 512


@dataclasses.dataclass(frozen=True)
class SparseStepConfig:
    """What one sparse decode call launches: the split kernel, with the combine behind one entry unless
    the plan is known to split no request."""

    split: SparseSplitConfig
    combine: CombineConfig
    with_combine: bool


@dataclasses.dataclass(frozen=True)
class SparsePrefillConfig:
    """One sparse prefill kernel (``kernels/sparse_prefill.py``): ``h_q`` heads of bf16 q, d_qk 576 (latent and
    RoPE) or 512 (latent only), with an attention sink, with per-token ``topk_length``."""

    h_q: int
    d_qk: int
    has_sink: bool
    has_topk_length: bool


@dataclasses.dataclass(frozen=True)
class WriteCacheConfig:
    """The cache writer (``kernels/write_cache.py``): rows of ``dtype`` ("bfloat16", "float16", "float32")
    quantized into a ``kv_format`` cache at slots of ``slot_dtype`` ("int32", "int64")."""

    kv_format: str
    dtype: str
    slot_dtype: str


@dataclasses.dataclass(frozen=True)
class MergeConfig:
    """The merge of partial attention results (``kernels/merge.py``): outs of ``dtype`` ("bfloat16", "float16",
    "float32") and head dimension ``d_v`` (a multiple of 256), with an attention sink or without."""

    dtype: str
    d_v: int
    has_sink: bool
