"""Schedule of the sparse FP8 decode kernel, as plain data.

The kernel reads every field at compile time; changing a field re-JITs.  The 64-head M
tile, 64-token KV tile and the 656-byte row are constants of the kernel.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from .checks import check_bool, check_combine, check_counts, check_kv_stages, check_smem, check_split_policy
from .planner import split_policy


@dataclasses.dataclass(frozen=True)
class SparseDecodeSchedule:
    """Tunables of ``kernels/sparse_decode_fp8.py``.

    kv_stages: dequantized 64 x 576 bf16 token tiles in flight (72 KiB each): 2 fit next to Q.
    crossover: pair the 64-head tiles of a query token (h_q = 128: heads 0-63 and 64-127) in a
        2-CTA cluster; each CTA gathers and dequantizes half of every token tile and stores it
        into its own and its peer's shared memory.  Ignored when the head tiles do not pair
        (h_q <= 64, or an odd number of 64-head tiles).  On by default: 1.04-1.05x faster than the
        whole-tile gather at b >= 64, h_q = 128 on the H200, once the producer issues a tile's
        first row loads before waiting for the stage (docs/performance.md).
    peer_bulk_copy: how the crossover hands the peer CTA its half of a tile: True, bulk copies
        (cp.async.bulk shared::cluster) of each producer warp's rows once it has stored them
        locally; False, st.async stores of each 16 bytes as they are converted.  On by default:
        1.10-1.12x faster than the stores at b >= 64, h_q = 128 on the H200 with one copy per
        column block after a warpgroup barrier, and 1.02-1.03x more per warp (docs/performance.md).
    leader_follower: the consumers' split of a tile (``kernels/leader_follower.py``): consumer
        warpgroup 1 computes S over all 64 tokens, the softmax and O_L, and hands P to warpgroup 2,
        which only computes O_R, so warpgroup 2's P V overlaps the next tile's S and softmax.
        False: the serial consumer (``kernels/consumer.py``): each warpgroup S over 32 tokens, both
        meeting at the row max and at P before their P V.
    split_fixed_cost: the planner's fixed cost per request piece, in 64-token blocks.
    unsplit_slack: the planner keeps every request whole when a plan that splits nothing costs a part at
        most this many 64-token blocks more than the payload of FlashMLA's plan for each 64 query rows of a
        request (``plan_policy``; as for dense decode).  Off: on the H200 the topk 16K row (b = 64, s_q = 2,
        h_q = 128), whose whole plan costs 10 blocks more, read 1264.5 us whole against 1240.8 / 1256.4
        split (docs/performance.md, entry 27).
    even_split_slack: as for dense decode: equal pieces of the requests too long for a part, one part
        each, when that costs a part at most this many blocks more than the payload for each 64 query rows
        of a request (``plan_policy``).  Off: at 4 blocks per 64 rows the topk 16K row would take two whole
        requests a part, the plan measured slower (docs/performance.md, S35), and b = 2 pieces of 2-3 tiles
        instead of 3; the even plan itself was not measured on the sparse kernel.
    num_sm_parts: CTAs per (query token, 64-head tile); None = FlashMLA's rule from the SM count.
    combine_chunked_batch: the largest batch whose combine splits each row into 4 column chunks,
        one CTA each (0: never).  A small batch has few rows and many partials a row; chunks
        spread them over more SMs (b = 2, s_q = 2: 30.6 -> 28.5 us on the H200).
    combine_spread_partials: as for dense decode, the parts a request may span (parts / b) from which a
        small batch's combine spreads each row chunk over 8 warps (0: never).  Sparse parts are 132 / (s_q x
        64-head tiles), so b = 1 or 2 at s_q = 1, h_q = 64: b = 1, topk 8192 10% faster on the H200; the b =
        2, s_q = 2 row (16 parts a request) keeps one warp a row chunk (docs/performance.md, S36).
    partials_16bit: a split's partial O in the output's 16-bit dtype (lse stays fp32), staged in shared
        memory and copied out by the follower's threads like the final rows, instead of fp32 from registers:
        half the partial bytes written and read back by the combine.  Needs the leader-follower
        consumers.  None (the default): on for small plans only (``small_plan_tiles``).  Measured on the
        H200 (docs/performance.md, entry 32, sparse S37, S39): with FlashMLA's fixed cost the b = 2 and b = 74
        rows within 1% (b = 2: 24.9-25.0 us against 24.9-25.2); with the small plans' fixed cost b = 2 6-9% faster;
        the relative error of the small plans 2.9-3.0e-3 against 2.2e-3 (within FlashMLA's test tolerances).  False:
        FlashMLA's fp32 partials on every plan.
    small_plan_tiles: a call whose requests, planned with ``split_fixed_cost``, give a part at least 2 and at most
        this many 64-token tiles (``ceil(b * (topk tiles + split_fixed_cost) / parts)``, from the shapes alone) is planned
        with ``small_plan_fixed_cost`` instead, and with ``partials_16bit=None`` writes 16-bit partials: its
        time goes to each part's start and end and to the combine, not to the tiles.  Measured on the H200
        (docs/performance.md, S39), against FlashMLA's fixed cost and fp32 partials: b = 2, s_q = 2, h_q = 128, topk
        2048 (3 tiles a part; then 2 over 32 parts) 20.9-22.3 us against 23.5-23.8, where either change alone gained
        at most 0.7 us; b = 4, s_q = 1 22.3-22.4 against 23.6-23.9; b = 1, h_q = 64, topk 8192 19.8-20.3 against
        20.6-20.8; b = 1, s_q = 2 (2 tiles a part; then 1) 20.0 against 19.8.  0: never.
    small_plan_fixed_cost: the planner's fixed cost per request piece for small plans (``small_plan_tiles``).
    fp16_operands: the MMAs' operands (Q, the dequantized K = V, P) in fp16 instead of bf16, accumulating in fp32
        either way.  An fp8 pair becomes an fp16 pair in one conversion and takes its scale in one multiply;
        reaching bf16 takes three instructions more a pair, and the producer's dequantization is what limits the
        rate.  Q is converted in place once a request, times 2^-4 (undone in the softmax scale); S's RoPE k-blocks
        stay bf16.  With the quantizer's power-of-two scales K then holds exactly the bf16 dequantization's values
        while the scale lies in [2^-15, 2^7] (a 128-value block's amax from about 0.007 to 57344; smaller values are
        rounded to 2^-25 or finer, larger ones overflow), and Q's latent part converts exactly from 2^-13 to below
        2^20 in magnitude (smaller values rounded to multiples of 2^-20).  Measured on the H200
        (docs/performance.md, S49): b = 128, h_q = 64 (the whole-tile gather, 4 rows a thread) 7% faster, the
        crossover's rows 0-1.4%, b = 2 the same.  False: bf16 operands, FlashMLA's arithmetic.
    producer_halves: the crossover's producer warpgroup as two halves of two warps, each gathering every other tile
        of the part (4 rows a thread instead of 2 of every tile), so two tiles' row loads are in flight at once
        and a warp's proxy fences before its hand-over copies wait only for its own half's loads; each warp hands
        over 16 consecutive rows (2 KiB copies).  Needs ``peer_bulk_copy`` and the leader-follower consumers (its
        producer's registers hold the 4 rows); ignored where the crossover does not pair.  None (the default): on
        except for small plans (``small_plan_tiles``).  Measured on the H200 (docs/performance.md, S50): b = 128,
        s_q = 2, h_q = 128 2.7% faster (327.5 -> 318.7 us), b = 64 3.3%, s_q = 1 2.1%; the b = 2 small plan (2
        tiles a part: one a half) 7% slower (20.4 -> 21.8 us).  False: every producer warp gathers every tile.
    combine_pdl: as for dense decode, the combine launched with Programmatic Dependent Launch.  Measured on
        the H200 (docs/performance.md, entry 33, sparse S38): the b = 2 row 23.7-24.0 us against 25.0-25.3, b = 1,
        h_q = 64, topk 8192 about 1 us faster, b = 74 and 128 within noise.  False: a plain launch.
    """

    kv_stages: int = 2
    crossover: bool = True
    peer_bulk_copy: bool = True
    leader_follower: bool = True
    split_fixed_cost: int = 5
    unsplit_slack: int = 0
    even_split_slack: int = 0
    num_sm_parts: Optional[int] = None
    combine_chunked_batch: int = 4
    combine_spread_partials: int = 48
    partials_16bit: Optional[bool] = None
    combine_pdl: bool = True
    fp16_operands: bool = True
    producer_halves: Optional[bool] = None
    small_plan_tiles: int = 4
    small_plan_fixed_cost: int = 1

    def kernel_key(self) -> tuple:
        """The fields the generated kernel code depends on (the others act on the host side)."""
        return (self.kv_stages, self.crossover, self.peer_bulk_copy, self.leader_follower, self.combine_chunked_batch,
                self.combine_spread_partials, self.partials_16bit, self.combine_pdl, self.fp16_operands,
                self.producer_halves)

    def smem_bytes(self) -> int:
        """The kernel's shared storage: mbarriers, row max/sum, bias, then the 1 KiB-aligned tiles."""
        small = 8 * (2 + 2 * self.kv_stages) + 2 * 2 * 64 * 4 + self.kv_stages * 64 * 4
        small = -(-small // 1024) * 1024
        q = 64 * 576 * 2
        kv = self.kv_stages * 64 * 576 * 2
        p = 64 * 64 * 2
        return small + q + kv + p

    def small_plan(self, b: int, topk: int, parts: int) -> bool:
        """Whether ``b`` requests of ``topk`` tokens over ``parts`` parts make a small plan (``small_plan_tiles``):
        a shape fact, so every call with the same shapes takes the same kernel and plan policy."""
        tiles = -(-(b * (-(-topk // 64) + self.split_fixed_cost)) // parts)
        # Parts of one tile gain nothing: the smaller fixed cost leaves the plan as it is, and the staged
        # 16-bit partial then only adds its copies' latency (S39: b = 2, s_q = 1, h_q = 64, topk 2048 1 us slower).
        return 2 <= tiles <= self.small_plan_tiles

    def for_plan(self, small: bool) -> "SparseDecodeSchedule":
        """This schedule resolved for a plan that is small (``small_plan``) or not: the fixed cost the planner
        uses, and ``partials_16bit`` and ``producer_halves`` as bools, so a kernel can be built from it."""
        fixed_cost = self.small_plan_fixed_cost if small else self.split_fixed_cost
        partials = self.partials_16bit
        if partials is None:
            partials = small and self.leader_follower
        halves = self.producer_halves
        if halves is None:
            halves = not small and self.peer_bulk_copy and self.leader_follower
        return dataclasses.replace(self, split_fixed_cost=fixed_cost, partials_16bit=partials, producer_halves=halves)

    def plan_policy(self, rows: int) -> tuple[int, int, int]:
        """The planner's (``fixed_cost``, ``unsplit_slack``, ``even_split_slack``) in blocks for requests of
        ``rows`` query rows, s_q x h_q (``planner.split_policy``)."""
        return split_policy(self, rows)

    def validate(self) -> None:
        """Reject impossible schedules before compiling, with the reason."""
        check_kv_stages(self)
        check_bool("crossover", self.crossover)
        check_bool("peer_bulk_copy", self.peer_bulk_copy)
        check_bool("leader_follower", self.leader_follower)
        check_bool("fp16_operands", self.fp16_operands)
        if self.producer_halves is not None:
            check_bool("producer_halves", self.producer_halves)
        if self.producer_halves and not (self.peer_bulk_copy and self.leader_follower):
            raise ValueError("producer_halves needs the crossover's bulk hand-over and the leader-follower consumers "
                             "(their producer's registers hold 4 rows a thread); set peer_bulk_copy=True and "
                             "leader_follower=True")
        if self.partials_16bit is not None:
            check_bool("partials_16bit", self.partials_16bit)
        if self.partials_16bit and not self.leader_follower:
            raise ValueError("partials_16bit needs the leader-follower consumers (their epilogue stages rows in "
                             "shared memory); set leader_follower=True")
        check_split_policy(self)
        check_counts(self, "small_plan_tiles", "small_plan_fixed_cost")
        check_combine(self)
        check_smem(self)


# The two 64-head tiles of h_q = 128 share each token tile in a 2-CTA cluster (the default).
CROSSOVER_SPARSE_SCHEDULE = SparseDecodeSchedule(crossover=True)
DEFAULT_SPARSE_SCHEDULE = CROSSOVER_SPARSE_SCHEDULE
# Each CTA gathers all 64 rows of every token tile itself.
NO_CROSSOVER_SPARSE_SCHEDULE = SparseDecodeSchedule(crossover=False)
# The serial consumer (both warpgroups compute S), with the crossover.
SERIAL_SPARSE_SCHEDULE = SparseDecodeSchedule(leader_follower=False)
