"""Compiling CuTe DSL kernels: arch selection, the in-memory and on-disk compile caches.

Kernels are compiled once per static configuration with fake tensors (symbolic batch,
block and split counts) and called through TVM-FFI with torch tensors.  The in-memory
cache is keyed on every static fact the generated code depends on.  The disk cache
(``$MLA_CUTE_CACHE_DIR``, default ``~/.cache/mla_cute``) stores the exported object of each
compiled kernel under a hash of that key, the DSL version, the target arch and the
sources of ``kernels/`` and ``schedules/``: a warm start loads it in milliseconds, and any
edit of a kernel or schedule source invalidates it.  ``MLA_CUTE_DISK_CACHE=0`` disables it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Hashable

log = logging.getLogger("mla_cute")

_lock = threading.Lock()
_cache: Dict[Hashable, Any] = {}
_source_hash: str | None = None
_PACKAGE_DIR = Path(__file__).resolve().parent


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


def compile_options(extra: str = "") -> str:
    return ("--enable-tvm-ffi " + extra).strip()


def cache_dir() -> Path:
    root = os.environ.get("MLA_CUTE_CACHE_DIR")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mla_cute"


def _sources_hash() -> str:
    """Hash of the kernel and schedule sources (the code that decides what gets compiled)."""
    global _source_hash
    if _source_hash is None:
        import mla_cute.kernels
        import mla_cute.schedules

        h = hashlib.sha256()
        for pkg in (mla_cute.kernels, mla_cute.schedules):
            for path in sorted(Path(pkg.__file__).parent.glob("*.py")):
                h.update(path.name.encode())
                h.update(path.read_bytes())
        _source_hash = h.hexdigest()[:16]
    return _source_hash


def _target_arch() -> str:
    arch = os.environ.get("CUTE_DSL_ARCH")
    if arch:
        return arch
    import torch

    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"sm_{major}{minor}a"
    return "unknown"


def _disk_name(key: Hashable) -> str:
    import cutlass

    text = repr((key, cutlass.__version__, _target_arch(), _sources_hash()))
    return "k" + hashlib.sha256(text.encode()).hexdigest()[:32]


def _load_from_disk(name: str):
    path = cache_dir() / f"{name}.o"
    if not path.exists():
        return None
    import cutlass.cute as cute

    try:
        return getattr(cute.runtime.load_module(str(path), enable_tvm_ffi=True), name)
    except Exception as exc:  # a truncated or foreign file: recompile
        log.warning("mla_cute: ignoring unreadable cache entry %s (%s)", path, exc)
        return None


def _store_to_disk(name: str, fn) -> None:
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f"{name}.{os.getpid()}.tmp.o"
        fn.export_to_c(str(tmp), function_name=name)
        os.replace(tmp, directory / f"{name}.o")
    except OSError as exc:
        log.warning("mla_cute: could not write the compile cache in %s (%s)", directory, exc)


class _CurrentStderr(logging.Handler):
    """Writes to whatever ``sys.stderr`` is at the time (a notebook or a capture may swap it)."""

    def emit(self, record: logging.LogRecord) -> None:
        import sys

        try:
            sys.stderr.write(self.format(record) + "\n")
        except Exception:
            self.handleError(record)


def _report(msg: str) -> None:
    """Progress of cold compiles: a log line with the configuration (visible unless logging is configured)."""
    if not log.hasHandlers():
        handler = _CurrentStderr()
        handler.setFormatter(logging.Formatter("[mla_cute] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    log.info(msg)


def cached_compile(key: Hashable, build: Callable[[], Any], *, describe: str = "", persistent: bool = True) -> Any:
    """The compiled kernel for ``key``: from memory, else from disk, else ``build()`` (then saved)."""
    fn = _cache.get(key)
    if fn is not None:
        return fn
    with _lock:
        fn = _cache.get(key)
        if fn is not None:
            return fn
        use_disk = persistent and os.environ.get("MLA_CUTE_DISK_CACHE", "1") != "0"
        name = _disk_name(key) if use_disk else None
        fn = _load_from_disk(name) if use_disk else None
        if fn is None:
            _report(f"compiling {describe or key} ...")
            t0 = time.perf_counter()
            fn = build()
            _report(f"compiled {describe or key} in {time.perf_counter() - t0:.1f} s")
            if use_disk:
                _store_to_disk(name, fn)
        _cache[key] = fn
    return fn


def clear_memory_cache() -> None:
    """Forget the compiled kernels of this process (the disk cache stays)."""
    with _lock:
        _cache.clear()
