"""Backend selection: ``cute`` kernels on SM90 CUDA tensors, ``reference`` on CPU.

Override with the ``backend=`` argument or the ``MLA_CUTE_BACKEND`` environment
variable.  A GPU never falls back silently: a missing kernel raises
NotImplementedError, and a non-Hopper GPU needs ``backend="reference"``.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from .device import is_sm90

BACKENDS = ("reference", "cute")
ENV_VAR = "MLA_CUTE_BACKEND"


def select_backend(device: torch.device, backend: Optional[str] = None) -> str:
    choice = backend if backend is not None else os.environ.get(ENV_VAR) or None
    if choice is not None:
        if choice not in BACKENDS:
            source = "backend" if backend is not None else ENV_VAR
            raise ValueError(f"{source} must be one of {BACKENDS}, got {choice!r}")
        if choice == "cute" and not is_sm90(device):
            raise ValueError(f"the 'cute' backend needs CUDA tensors on an SM90 (Hopper) GPU, got device {device}")
        return choice
    if device.type == "cpu":
        return "reference"
    if is_sm90(device):
        return "cute"
    raise NotImplementedError(
        f"no kernels for device {device} (compute capability {torch.cuda.get_device_capability(device)}); "
        f"mla-cute's kernels need SM90. Pass backend='reference' (or set {ENV_VAR}=reference) for the torch reference."
    )
