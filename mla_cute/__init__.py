"""mla-cute: FlashMLA-compatible Multi-head Latent Attention kernels for Hopper in the CuTe DSL.

The public names load on first use (PEP 562), so that a kernel build in a process of its own
(``mla_cute.kernels.build``) imports neither the API nor torch."""

import importlib

__version__ = "0.1.0"

# Each public name and the module that defines it.
_EXPORTS = {
    "FlashMLASchedMeta": "api",
    "get_mla_metadata": "api",
    "get_mla_decoding_metadata": "api",
    "flash_mla_with_kvcache": "api",
    "flash_mla_sparse_fwd": "api",
    "precompile": "api",
    "use_schedule": "api",
    "quantize_kv_cache": "kv_formats",
    "dequantize_kv_cache": "kv_formats",
    "write_kv_cache": "api",
    "FP8_BYTES_PER_TOKEN": "fp8",
    "select_backend": "backend",
    "cache_info": "jit",
    "merge_partial_attention": "distributed",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mla_cute' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
