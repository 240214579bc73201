"""Schedule of the dense decode kernel, as plain data.

The kernel reads every field at compile time; changing a field re-JITs.  Fields
that describe the hardware contract of the kernel (64-row M tiles, 64-token KV
tiles, 576/512 head dims) are constants of the kernel, not schedule fields.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from .checks import check_bool, check_combine, check_counts, check_kv_stages, check_smem, check_split_policy
from .planner import FILL_SHARE_ONE, m_tiles_for, split_policy


@dataclasses.dataclass(frozen=True)
class DenseDecodeSchedule:
    """Tunables of the dense decode kernels (``kernels/dense_seesaw.py``, ``kernels/dense_decode.py``).

    kv_stages: KV tiles in flight (64 x 576 each, 72 KiB in 16-bit): 2 fits next to Q.
    seesaw: the seesaw kernel (``kernels/dense_seesaw.py``, the default): two warpgroups on a
        tile pair, each owning half of the output, one's softmax overlapping the other's tensor
        cores; tiles arrive as nine 64 x 64 sub-tiles with their own barriers.  Needs
        kv_stages == 2 (the pair) and qk_prefetch off.  False: the serial kernel
        (``kernels/dense_decode.py``: a TMA producer warpgroup, every step of a tile waiting for
        the previous one), measured 10-20% slower on the compute-bound rows (docs/performance.md).
    qk_prefetch: serial kernel only: issue the next tile's S = Q K^T before this tile's softmax.
        Measured slower on the H200, so off.
    kv_evict_first: load KV tiles with the L2 evict-first policy (they are read once, FlashMLA
        sets it).  Measured no faster with the serial kernel and 0-2% slower with the seesaw on
        the H200 on plans whose parts read 124 or more tiles.  None (the default): chosen per plan:
        on when the host knows the plan (the first call's lengths; not inside a CUDA graph capture)
        and its busiest part reads at most ``evict_first_tiles`` KV tiles, else off.  With the seesaw
        and the load warpgroup, h_q = 128 (docs/performance.md, entries 28 and 30): 7.5-7.8% faster at
        b = 1, 64K (16 tiles a part), 3.9-4.2% at b = 1, 128K (32), 0.7-2.5% at 63, none at 125-128.
        ``precompile`` builds both kernels for it.
    evict_first_tiles: with ``kv_evict_first=None``, the most tiles the busiest part of a plan may read
        for its loads to be evict-first.
    split_fixed_cost: the planner's fixed cost per request piece, in 64-token blocks.
    unsplit_slack: the planner keeps every request whole when a plan that splits nothing costs a part at
        most ``unsplit_slack`` 64-token blocks more than the payload of FlashMLA's plan for each 64-row M
        tile of a KV head's query rows (``plan_policy``; ``schedules/planner.py``): a split costs the fp32
        partials and the combine kernel, neither counted by the fixed cost per piece, and both grow with
        the query rows.  Measured on the H200 (docs/performance.md, entry 27), b = 128, h_q = 128: whole
        plans 3 and 11 blocks dearer were 1.5-7% and 0.7-6% faster at s_q = 2 (4K, 8K; 4 M tiles), one 3
        blocks dearer 0.7-2.4% faster at s_q = 1, 8K (2 M tiles), but one 10 blocks dearer up to 3% slower
        at s_q = 1, 16K.  0: FlashMLA's plan.
    even_split_slack: where no whole plan is taken, the planner cuts each request too long for a part
        into equal pieces, one part each, so no part holds a request boundary next to a piece, when that
        costs a part at most ``even_split_slack`` blocks more than FlashMLA's payload for each 64-row M
        tile (``plan_policy``; ``schedules/planner.py``).  Measured on the H200 (docs/performance.md,
        entry 29): one M tile a KV head (the memory-bound rows) 0.6-5.5% faster (64 x 16K at h_q = 16
        and 64, 32 x 32K and 16 x 64K at h_q = 16: pieces of 128 tiles instead of 125-127 tiles over one
        or two pieces), b = 8, 64K at h_q = 128 within 0.4%.  0: not tried.
    num_sm_parts: CTAs per (KV head, M tile); None = FlashMLA's rule from the SM count.
    cross_term_first: seesaw kernel only: warpgroup 1 issues P0 V0_R (the cross term, P0 at warpgroup 0's
        row max) before its own softmax, and P1 V1_R right behind it; a buffer's right half refills a
        step earlier.  Measured on the H200 (docs/performance.md, entries 22 and 25): 2-3.5% faster on
        the memory-bound rows (one M tile a KV head); with tile multicast (h_q = 128) 4-7% faster on
        every row measured; with two M tiles and no multicast 4-5% faster at b = 1, 128K but 1-4% slower
        on the long and the s_q = 2 rows.  None: on exactly when the kernel has one M tile a KV head
        or pairs its M tiles with tile multicast.
    tile_multicast: seesaw kernel only: the two M tiles of a pair (rows 0-63 and 64-127 of a KV head's
        128, which see the same tiles) run as a 2-CTA cluster, and each 64 x 64 sub-tile is loaded
        once for both, half by each CTA, with TMA multicast: half the L2-to-SM traffic, but a buffer
        half refills only once both CTAs freed it.  Needs an even number of M tiles and, when causal,
        a multiple of 128 query heads a KV head (the pair's rows end at the same key).  Measured on the
        H200 (docs/performance.md, entries 24 and 25): in FlashMLA's step order 0.5-4% faster on the
        h_q = 128 rows but 2% slower at b = 1, 128K; with the cross term first (its default order) 0-5%
        faster, even at b = 1, 128K, 3% slower at b = 1, 64K.  None: on exactly when a KV head has a
        multiple of 128 query heads.
    multicast_ctas: with tile multicast, how many M tiles share each tile in one cluster: 2 (a pair, each CTA
        loading half of every sub-tile's rows) or 4 (where a KV head has a multiple of 4 M tiles, e.g. s_q = 2
        with h_q = 128: a quarter each, a quarter of the L2-to-SM traffic of no multicast; else pairs).  With 4
        and causality the cluster's rows end at most s_q - 1 keys apart: all four read the tiles of its last
        row, and each row is masked past its own end.  4 needs the load warpgroup.  A GPC holds whole clusters
        only: an H200 runs 30 4-CTA clusters at once (120 of its 132 SMs), so the plan then has at most that
        many clusters (``mla_cute.backend.dense_num_parts``).  Measured on the H200 (docs/performance.md,
        entry 44), s_q = 2, h_q = 128: 1.9-3.4% faster where the busiest part reads 546 tiles (b = 128, 8K;
        b = 64, 16K), 1.1-1.2% at 341 and 410 (5K, 6K), 0.7% slower at 307 (4608, entry 45), 1.8-2% slower at
        273 (b = 128, 4K), 3.4% slower at b = 1, 128K (68); h_q = 256, s_q = 1, b = 64: 3.1% faster at 546 (16K),
        1.6% slower at 273 (8K).  With the idle-SM fill (``idle_sm_fill``, entry 47) 2-4% more where the clusters
        were faster, 0.9% faster at 307 and 1% slower at 273.  None (the default): chosen per plan, 4 when the host
        knows the plan and its busiest part, planned over the 4-CTA clusters' parts (without fill parts), reads at
        least ``quad_multicast_tiles`` KV tiles, else 2.
    quad_multicast_tiles: with ``multicast_ctas=None``, the fewest tiles the busiest part of a 4-CTA plan must
        read for the plan to take 4-CTA clusters.
    idle_sm_fill: a plan of 4-CTA clusters also runs pair clusters on the SMs the clusters leave idle (12 on an
        H200): the last parts of the plan go to a second split kernel of pairs, launched programmatically once
        every 4-CTA cluster has started, so its pairs take the idle SMs (``kernels/fill.py``).  Each of those
        parts reads ``idle_sm_fill_share`` sixteenths of the blocks of another part (the planner's
        ``fill_parts``).  Only where the device's GPCs hold pairs in whatever the clusters leave
        (``mla_cute.backend.dense_fill_parts``) and ``num_sm_parts`` is None.  Measured on the H200
        (docs/performance.md, entry 47), h_q = 128, s_q = 2, b = 128: 3.8-4.0% faster at 8K, 1.9-2.7% at 5K;
        b = 64, 16K 1.5-2.1%; h_q = 256, s_q = 1, b = 64, 16K 0-2.3%.  False: the 4-CTA clusters alone.
    idle_sm_fill_share: with ``idle_sm_fill``, a fill part's blocks against another part's, in sixteenths (1 to
        16): a pair on the idle SMs runs slower than a 4-CTA cluster while both run (entry 47, 8K: share 13
        2% slower than 11, 16 and 9 slower still).
    load_warpgroup: seesaw kernel only: a third warpgroup issues every TMA copy (Q, each buffer half's
        refill, a request's first tiles, the block-table reads before them); the consumer warpgroups only
        hand a freed buffer half back through an mbarrier (with tile multicast: to both CTAs' loaders), so
        neither a copy's issue nor the wait for the peer's hand-back sits on their path, and the loads run
        ahead across request boundaries.  The consumers get 240 registers and the loader 24 (setmaxnreg,
        384 threads).  False: the warp that frees a buffer half issues its refill (FlashMLA's way).
        Measured on the H200 (docs/performance.md, entry 26): 3-6% faster on the h_q = 128 rows with
        s_q = 1, about 1% on the memory-bound rows, neutral at s_q = 2.  None: on with the seesaw.
    combine_chunked_batch: the largest batch whose combine splits each row into 4 column chunks,
        one CTA each (0: never).  A small batch has few rows and many partials a row; chunks
        spread them over more SMs (b = 1, 128K: 94 -> 85 us on the H200).
    combine_spread_partials: a batch of at most ``combine_chunked_batch`` requests whose requests may each
        span this many parts or more (parts / b >= this) merges each row chunk on 8 warps, each taking
        every 8th partial, which meet in shared memory; else one warp a row chunk (0: never).  b = 1 has
        66 or 132 parts.  Measured on the H200 (docs/performance.md, entry 31): b = 1 calls 3-11% faster
        (dense h_q = 128, 128K: 70.7-71.0 us against 72.8-73.2), b = 2 with 132 parts 4%; the combine
        alone at b = 4 with 33 partials a row (partials in L2) 9.3 us against 7.9 one warp a chunk.
    partials_16bit: a split's partial O in the output's 16-bit dtype (lse stays fp32), staged in shared
        memory and copied out with bulk copies like the final rows, instead of fp32 from registers:
        half the partial bytes written and read back by the combine.  Needs the seesaw kernel.  False (the
        default): FlashMLA's fp32 partials on every plan.  None: chosen per plan, on when the host knows the
        plan and its busiest part reads at most ``partials_16bit_tiles`` KV tiles (a short plan's partials are
        a large share of its time), else off.  Off by default since, on FlashMLA's test data, a split row's
        second rounding doubles the cosine difference against the reference (about 4.3e-6 against FlashMLA's
        2.2e-6; FlashMLA's test allows 5e-6, and a single-head row passed it); b = 1, 128K costs 3.4% (69.6 us
        against 67.3, side by side on the H200).
        Measured on the H200 (docs/performance.md, entries 32 and 35): calls of one to four requests 1-11% faster
        (h_q = 128, 128K: 67.7-68.2 us against 69.2-69.4; 16K: 24.2-24.5 against 26.6-26.8; b = 4, 16K: 43.5-43.6
        against 46.3-46.5; h_q = 64, 64K: 36.4-36.8 against 37.8-38.7; even at one tile a part, b = 1, 4K: 18.0
        against 18.7-19.0), b = 2, h_q = 32, 64K and 64 x 16K within 0.2% (forced on); the relative error of split
        rows 1.2-1.5x higher (b = 1, 128K: 1.1e-3 against 7.6e-4).
    partials_16bit_tiles: with ``partials_16bit=None``, the most tiles the busiest part of a plan may read for
        its partials to be 16-bit.
    combine_pdl: launch the combine kernel with Programmatic Dependent Launch: its CTAs start as the split
        kernel's last CTAs exit (instead of after the split grid's completion and a new launch), read the split
        counts, and wait (``griddepcontrol.wait``) before the partials.  The split kernel does not trigger early
        (its CTAs hold whole SMs; entry 4's trigger at its start measured slower).  Measured on the H200
        (docs/performance.md, entry 33): 0.7-1.6 us off every call that runs the combine at b <= 2 (b = 1, 128K:
        69.3-69.9 us against 70.6-71.3), the b = 128 rows within noise.  False: a plain launch.
    """

    kv_stages: int = 2
    qk_prefetch: bool = False
    kv_evict_first: Optional[bool] = None
    evict_first_tiles: int = 64
    seesaw: bool = True
    split_fixed_cost: int = 5
    unsplit_slack: int = 4
    even_split_slack: int = 4
    num_sm_parts: Optional[int] = None
    combine_chunked_batch: int = 4
    combine_spread_partials: int = 48
    cross_term_first: Optional[bool] = None
    tile_multicast: Optional[bool] = None
    multicast_ctas: Optional[int] = None
    quad_multicast_tiles: int = 290
    idle_sm_fill: bool = True
    idle_sm_fill_share: int = 11
    load_warpgroup: Optional[bool] = None
    partials_16bit: Optional[bool] = False
    partials_16bit_tiles: int = 32
    combine_pdl: bool = True

    def kernel_key(self) -> tuple:
        """The fields the generated kernel code depends on (the others act on the host side)."""
        return (self.kv_stages, self.qk_prefetch, self.kv_evict_first, self.seesaw, self.combine_chunked_batch,
                self.combine_spread_partials, self.cross_term_first, self.tile_multicast, self.load_warpgroup_on(),
                self.partials_16bit, self.combine_pdl, 4 if self.multicast_ctas == 4 else 2)

    def load_warpgroup_on(self) -> bool:
        """``load_warpgroup`` resolved (None: on with the seesaw kernel)."""
        return self.seesaw if self.load_warpgroup is None else self.load_warpgroup

    def cross_term_first_for(self, m_tiles: int, multicast: bool) -> bool:
        """``cross_term_first`` for a kernel with ``m_tiles`` 64-row M tiles a KV head, with tile multicast
        (``tile_multicast_for``) or without."""
        if self.cross_term_first is None:
            return m_tiles == 1 or multicast
        return self.cross_term_first

    def tile_multicast_for(self, m_tiles: int, group: int, causal: bool) -> bool:
        """``tile_multicast`` for a kernel with ``m_tiles`` M tiles and ``group`` query heads a KV head;
        True where the pairing is impossible raises."""
        if self.tile_multicast is None:
            return group % 128 == 0
        if not self.tile_multicast:
            return False
        if m_tiles % 2 != 0 or (causal and group % 128 != 0):
            raise ValueError(
                f"tile_multicast pairs M tiles that see the same KV tiles: it needs an even number of 64-row M "
                f"tiles (got {m_tiles}) and, when causal, a multiple of 128 query heads a KV head (got {group})")
        return True

    def cluster_ctas_for(self, m_tiles: int, group: int, causal: bool) -> int:
        """CTAs in a cluster of the seesaw kernel with ``m_tiles`` M tiles and ``group`` query heads a KV head:
        1 without tile multicast, else 4 with ``multicast_ctas=4`` where ``m_tiles`` divides by 4, else 2
        (``multicast_ctas=None`` is decided per plan: ``multicast_for_plan``).  Where ``tile_multicast=True``
        cannot pair, ``tile_multicast_for`` raises when the kernel is built; here 1."""
        on = group % 128 == 0 if self.tile_multicast is None else self.tile_multicast
        if not (self.seesaw and on and m_tiles % 2 == 0 and (not causal or group % 128 == 0)):
            return 1
        return 4 if self.multicast_ctas == 4 and m_tiles % 4 == 0 else 2

    def cluster_ctas_of_call(self, s_q: int, h_q: int, h_kv: int, causal: bool) -> int:
        """``cluster_ctas_for`` the kernel of a call with ``s_q`` positions, ``h_q`` query and ``h_kv`` KV heads."""
        return self.cluster_ctas_for(m_tiles_for(s_q, h_q, h_kv), h_q // h_kv, causal)

    def multicast_for_plan(self, busiest_tiles_quad: Optional[int]) -> "DenseDecodeSchedule":
        """This schedule with ``multicast_ctas`` decided for a plan whose busiest part, planned over the 4-CTA
        clusters' parts, reads ``busiest_tiles_quad`` KV tiles (None: a plan the host does not know, or a
        kernel without four M tiles to a cluster: pairs)."""
        if self.multicast_ctas is not None:
            return self
        quad = (busiest_tiles_quad is not None and self.load_warpgroup_on()
                and busiest_tiles_quad >= self.quad_multicast_tiles)
        return dataclasses.replace(self, multicast_ctas=4 if quad else 2)

    def as_pairs(self) -> "DenseDecodeSchedule":
        """This schedule with pairs for 4-CTA clusters (the idle-SM fill's kernel)."""
        return dataclasses.replace(self, multicast_ctas=2)

    def smem_bytes(self, elem_bytes: int = 2) -> int:
        q = 64 * 576 * elem_bytes
        kv = self.kv_stages * 64 * 576 * elem_bytes
        p = 64 * 64 * elem_bytes  # the seesaw's second P lives in Q's RoPE bytes
        if self.seesaw:
            # Barriers: Q, the 18 sub-tiles, the 4 buffer halves' hand-backs, the loader's Q-free.
            small = 3 * 2 * 64 * 4 + 8 * (2 + 2 * 9 + 4 + 1)
        else:
            small = 2 * 64 * 4 * 2 + 64 * 8 * (self.kv_stages + 2)
        return q + kv + p + small

    def for_plan(self, busiest_tiles: Optional[int]) -> "DenseDecodeSchedule":
        """This schedule with ``kv_evict_first`` and ``partials_16bit`` decided for a plan whose busiest part
        reads ``busiest_tiles`` KV tiles (None: a plan the host does not know), so a kernel can be built from it."""
        known = busiest_tiles is not None
        evict, partials = self.kv_evict_first, self.partials_16bit
        if evict is None:
            evict = known and busiest_tiles <= self.evict_first_tiles
        if partials is None:
            partials = known and self.seesaw and busiest_tiles <= self.partials_16bit_tiles
        return dataclasses.replace(self, kv_evict_first=evict, partials_16bit=partials)

    def plan_policy(self, rows_per_kv_head: int) -> tuple[int, int, int]:
        """The planner's (``fixed_cost``, ``unsplit_slack``, ``even_split_slack``) in blocks for a KV head with
        ``rows_per_kv_head`` query rows (``planner.split_policy``)."""
        return split_policy(self, rows_per_kv_head)

    def validate(self) -> None:
        """Reject impossible schedules before compiling, with the reason."""
        check_kv_stages(self)
        check_bool("qk_prefetch", self.qk_prefetch)
        if self.qk_prefetch and self.kv_stages < 2:
            raise ValueError("qk_prefetch needs kv_stages >= 2 (the next tile must be resident)")
        if self.kv_evict_first is not None:
            check_bool("kv_evict_first", self.kv_evict_first)
        if type(self.evict_first_tiles) is not int or self.evict_first_tiles < 0:
            raise ValueError(f"evict_first_tiles must be an int >= 0, got {self.evict_first_tiles!r}")
        check_bool("seesaw", self.seesaw)
        if self.seesaw and self.kv_stages != 2:
            raise ValueError(f"seesaw needs kv_stages == 2 (one tile pair), got {self.kv_stages}; "
                             "set seesaw=False for another stage count")
        if self.seesaw and self.qk_prefetch:
            raise ValueError("qk_prefetch is a serial-kernel option (the seesaw already overlaps S with the "
                             "softmax); set seesaw=False to use it")
        if self.cross_term_first is not None:
            check_bool("cross_term_first", self.cross_term_first)
            if self.cross_term_first and not self.seesaw:
                raise ValueError("cross_term_first orders the seesaw's steps; set seesaw=True or leave it None")
        if self.tile_multicast is not None:
            check_bool("tile_multicast", self.tile_multicast)
            if self.tile_multicast and not self.seesaw:
                raise ValueError("tile_multicast is a seesaw-kernel option; set seesaw=True or leave it None")
        if self.multicast_ctas is not None and (type(self.multicast_ctas) is not int or self.multicast_ctas not in (2, 4)):
            raise ValueError(f"multicast_ctas must be 2, 4 or None, got {self.multicast_ctas!r}")
        check_counts(self, "quad_multicast_tiles")
        check_bool("idle_sm_fill", self.idle_sm_fill)
        if type(self.idle_sm_fill_share) is not int or not 1 <= self.idle_sm_fill_share <= FILL_SHARE_ONE:
            raise ValueError(f"idle_sm_fill_share must be an int from 1 to {FILL_SHARE_ONE} (sixteenths of a "
                             f"part's blocks), got {self.idle_sm_fill_share!r}")
        if self.multicast_ctas == 4 and not self.load_warpgroup_on():
            raise ValueError("multicast_ctas=4 needs the load warpgroup (its loader waits for all four CTAs' "
                             "hand-backs); leave load_warpgroup None or set it True")
        if self.load_warpgroup is not None:
            check_bool("load_warpgroup", self.load_warpgroup)
            if self.load_warpgroup and not self.seesaw:
                raise ValueError("load_warpgroup is a seesaw-kernel option (the serial kernel always has its TMA "
                                 "producer warpgroup); set seesaw=True or leave it None")
        if self.partials_16bit is not None:
            check_bool("partials_16bit", self.partials_16bit)
        check_counts(self, "partials_16bit_tiles")
        if self.partials_16bit and not self.seesaw:
            raise ValueError("partials_16bit needs the seesaw kernel (its epilogue stages rows in shared memory "
                             "for bulk copies); set seesaw=True")
        check_split_policy(self)
        check_combine(self)
        check_smem(self)


# FlashMLA's schedule: the seesaw on tile pairs, sub-tile barriers.
SEESAW_DENSE_SCHEDULE = DenseDecodeSchedule()
DEFAULT_DENSE_SCHEDULE = SEESAW_DENSE_SCHEDULE
# The first schedule, every step of a tile waiting for the previous one; kept selectable so every
# gain is measured against it.
SERIAL_DENSE_SCHEDULE = DenseDecodeSchedule(seesaw=False, kv_evict_first=False)
# The serial kernel with the next tile's QK^T issued before this tile's softmax, KV loads
# marked evict-first (measured slower).
PREFETCH_DENSE_SCHEDULE = DenseDecodeSchedule(seesaw=False, qk_prefetch=True, kv_evict_first=True)
