"""The host path and torch's function modes.

``torch.set_default_device``, ``with torch.device(...)`` and any ``TorchFunctionMode`` route every torch call made
from Python (a tensor's ``.shape``, ``.stride()``, ``data_ptr()``, each ``torch.empty``) through Python code: a call
that reads a dozen tensors' facts and allocates two outputs costs several times its usual host time under one.
The public calls that launch kernels run with those modes suspended, as a compiled extension runs: every tensor
mla-cute makes names its device and dtype, so the modes would change nothing but the cost.
"""

from __future__ import annotations

import functools

import torch


def without_function_modes(fn):
    """``fn``, run with torch's function modes (and tensor subclasses' ``__torch_function__``) suspended."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with torch._C.DisableTorchFunction():
            return fn(*args, **kwargs)

    return call
