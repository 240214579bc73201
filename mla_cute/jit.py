"""Compiling CuTe DSL kernels: arch selection, fake-tensor signatures, the compile cache.

Kernels are compiled once per static configuration with fake tensors (symbolic
batch, block and split counts) and called through TVM-FFI with torch tensors, so a
call costs a few microseconds of host time.  The cache key holds every static fact
the generated code depends on.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Dict, Hashable

_lock = threading.Lock()
_cache: Dict[Hashable, Any] = {}


def prepare_dsl() -> None:
    """Point the DSL at sm_90a when no GPU is visible (compile-only use); must run before cutlass is imported."""
    if "CUTE_DSL_ARCH" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["CUTE_DSL_ARCH"] = "sm_90a"


def cutlass_dtype(torch_dtype):
    import cutlass
    import torch

    table = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16, torch.float32: cutlass.Float32}
    if torch_dtype not in table:
        raise NotImplementedError(f"no kernel for dtype {torch_dtype}")
    return table[torch_dtype]


def cached_compile(key: Hashable, build: Callable[[], Any]) -> Any:
    """Return the compiled kernel for ``key``, compiling it with ``build()`` the first time."""
    fn = _cache.get(key)
    if fn is None:
        with _lock:
            fn = _cache.get(key)
            if fn is None:
                fn = build()
                _cache[key] = fn
    return fn


def compile_options(extra: str = "") -> str:
    return ("--enable-tvm-ffi " + extra).strip()
