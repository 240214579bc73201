"""mla-cute: FlashMLA-compatible Multi-head Latent Attention kernels for Hopper in the CuTe DSL."""

from .api import (
    FlashMLASchedMeta,
    flash_mla_sparse_fwd,
    flash_mla_with_kvcache,
    get_mla_metadata,
    precompile,
    use_schedule,
)
from .backend import select_backend
from .distributed import merge_partial_attention
from .fp8 import FP8_BYTES_PER_TOKEN
from .jit import cache_info
from .kv_formats import dequantize_kv_cache, quantize_kv_cache, write_kv_cache

__version__ = "0.1.0"

__all__ = [
    "FlashMLASchedMeta",
    "get_mla_metadata",
    "flash_mla_with_kvcache",
    "flash_mla_sparse_fwd",
    "quantize_kv_cache",
    "dequantize_kv_cache",
    "write_kv_cache",
    "FP8_BYTES_PER_TOKEN",
    "select_backend",
    "precompile",
    "cache_info",
    "merge_partial_attention",
    "use_schedule",
]
