"""Shared pytest setup: CPU-only defaults and skipping of `gpu` / `compile` tests."""

import importlib
import os

import pytest
import torch

# Without a GPU the CuTe DSL cannot query the target arch; this must be set before
# anything imports cutlass (test modules are imported after conftest).
if not torch.cuda.is_available():
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


def _cutlass_error():
    """None when `import cutlass` works, else a short reason (checked lazily: the import is slow)."""
    try:
        importlib.import_module("cutlass")
    except Exception as exc:  # a broken install can raise more than ImportError
        return f"import cutlass failed ({type(exc).__name__}: {exc})"
    return None


def _hopper_missing():
    if not torch.cuda.is_available():
        return "no CUDA device"
    cap = torch.cuda.get_device_capability()
    if cap != (9, 0):
        return f"CUDA device has capability {cap}, need (9, 0)"
    return None


def pytest_collection_modifyitems(config, items):
    gpu_items = [it for it in items if it.get_closest_marker("gpu")]
    compile_items = [it for it in items if it.get_closest_marker("compile")]
    if not gpu_items and not compile_items:
        return
    cutlass_err = _cutlass_error()
    if gpu_items:
        reasons = [r for r in (_hopper_missing(), cutlass_err) if r]
        if reasons:
            skip = pytest.mark.skip(reason="gpu test: " + "; ".join(reasons))
            for it in gpu_items:
                it.add_marker(skip)
    if compile_items and cutlass_err:
        skip = pytest.mark.skip(reason="compile test: " + cutlass_err)
        for it in compile_items:
            it.add_marker(skip)
