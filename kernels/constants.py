"""Constants every kernel shares: MLA's head dimensions, the tile shapes, the operand dtypes by name, and
the numbers the softmax and the loads use."""

from __future__ import annotations

import math

import cutlass

D_QK = 576  # 512 latent + 64 RoPE features of q and of a cache row
D_V = 512  # the latent features, V and the output
BLOCK_M = 64  # query rows per CTA: one WGMMA M
BLOCK_N = 64  # tokens per KV tile
HALF_N = BLOCK_N // 2  # tokens of S per consumer warpgroup (the serial split)
HALF_V = D_V // 2  # output columns per consumer warpgroup
MMA_K = 16  # features per WGMMA k-block (16-bit operands)
LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)
# L2 cache-policy operand of a TMA load marking the lines evict-first (CUTLASS's CacheHintSm90::EVICT_FIRST):
# each KV tile is read once, so it should not push Q or the block table out of L2.
L2_EVICT_FIRST = 0x12F0000000000000
# The configs' dtype names (``schedules/configs.py``).
DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}
# What the cache writer and the merge also take: fp32 rows and parts.
FLOAT_DTYPES = {**DTYPES, "float32": cutlass.Float32}
