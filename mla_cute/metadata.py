"""The metadata object of decode calls (FlashMLA's ``FlashMLASchedMeta``) and the rules of its reuse: what a
first call binds it to, what a later call must match, and how a failed first call leaves it empty again."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional

import torch


@dataclasses.dataclass
class FlashMLASchedMeta:
    """Tile-scheduler metadata, filled by the first ``flash_mla_with_kvcache`` call.

    Reuse one object across the layers of a decode step: the shapes, the config and
    the values of ``cache_seqlens`` (or ``topk_length``) must stay the same.

    tile_scheduler_metadata: int32 ``[parts, 8]`` (see ``mla_cute.schedules.RECORD_FIELDS``): ``num_sm_parts``
    parts, or with ``enable_batch_invariant`` ``b`` times the pieces bound (``schedules.invariant_plan``).
    num_splits: int32 ``[batch_size + 1]``, prefix sum of the split count of each request.
    """

    @dataclasses.dataclass
    class Config:
        b: int
        s_q: int
        h_q: int
        page_block_size: int
        h_k: int
        causal: bool
        is_fp8_kvcache: bool
        topk: Optional[int]
        extra_page_block_size: Optional[int] = None
        extra_topk: Optional[int] = None
        kv_format: Optional[str] = None  # sparse: the cache's format (one metadata object serves one)
        extra_kv_format: Optional[str] = None  # sparse: the extra cache's format
        head_dim: Optional[int] = None  # dense: q's and the cache's head_dim (576 or 512; a kernel each)
        dtype: Optional[torch.dtype] = None  # dense: q's dtype (a kernel each)
        batch_invariant: bool = False  # enable_batch_invariant: the plan that cuts each request by its own length

    have_initialized: bool = False
    config: Optional[Config] = None
    tile_scheduler_metadata: Optional[torch.Tensor] = None
    num_splits: Optional[torch.Tensor] = None
    # What the metadata was computed from: the lengths tensor and its version counter,
    # so a reuse with other lengths is caught without reading device memory.
    _lengths_ref: Optional[torch.Tensor] = dataclasses.field(default=None, repr=False)
    _lengths_key: Optional[tuple] = dataclasses.field(default=None, repr=False)
    _lengths_copy: Optional[torch.Tensor] = dataclasses.field(default=None, repr=False)
    # The same for sparse decode's extra_topk_length.
    _extra_lengths_ref: Optional[torch.Tensor] = dataclasses.field(default=None, repr=False)
    _extra_lengths_key: Optional[tuple] = dataclasses.field(default=None, repr=False)
    _extra_lengths_copy: Optional[torch.Tensor] = dataclasses.field(default=None, repr=False)
    # Whether the first call ran inside a CUDA graph capture (its replays then plan the lengths they find), and
    # that capture's id (the scheduler kernel is in that graph only).
    _in_capture: bool = dataclasses.field(default=False, repr=False)
    _capture_id: Optional[int] = dataclasses.field(default=None, repr=False)
    # Backend-private state (workspaces, launch plans), keyed by the backend.
    _state: dict = dataclasses.field(default_factory=dict, repr=False)
    # The dense cute plan once a call has passed every check; later calls with the same
    # facts (see ``cute.dense_call_facts``) skip straight to the launch.
    _replay: Optional[object] = dataclasses.field(default=None, repr=False)


def lengths_key(t: torch.Tensor) -> tuple:
    """What identifies a lengths tensor's values between calls without reading them: its storage, shape,
    device and version counter.  A tensor made under ``torch.inference_mode()`` keeps no version counter
    (inference engines make theirs so): its key has none, so a reuse with that same tensor is trusted as
    FlashMLA trusts every reuse.  Whatever the lengths hold then, the kernels read nothing outside the
    block table and the cache."""
    return (t.data_ptr(), None if t.is_inference() else t._version, tuple(t.shape), t.device)


def check_metadata(meta: FlashMLASchedMeta, config: FlashMLASchedMeta.Config, lengths: Optional[torch.Tensor],
                    extra_lengths: Optional[torch.Tensor] = None) -> bool:
    """Check a reused metadata object against this call (``extra_lengths``: sparse decode's extra_topk_length).
    Returns True when it is still empty."""
    if not isinstance(meta, FlashMLASchedMeta):
        raise TypeError(
            f"tile_scheduler_metadata must be a FlashMLASchedMeta (from get_mla_metadata()), got {type(meta).__name__}"
        )
    if not meta.have_initialized:
        if meta.tile_scheduler_metadata is not None or meta.num_splits is not None:
            # Tensors a caller put on an empty object (a plan made elsewhere): the kernels would run their own
            # plan over them, which is not what the caller asked for.
            raise ValueError(
                "tile_scheduler_metadata: an empty FlashMLASchedMeta carries tile_scheduler_metadata / num_splits "
                "tensors made outside mla-cute; mla-cute plans the split itself: pass get_mla_metadata()[0] as it is"
            )
        return True
    if meta.config != config:
        diffs = [
            f"{f.name}: {getattr(meta.config, f.name)!r} -> {getattr(config, f.name)!r}"
            for f in dataclasses.fields(config)
            if getattr(meta.config, f.name) != getattr(config, f.name)
        ]
        raise ValueError(
            "tile_scheduler_metadata was computed for another configuration (" + ", ".join(diffs) + "); "
            "call get_mla_metadata() again for a new configuration"
        )
    _check_lengths(meta, lengths, "topk_length", "_lengths", "cache_seqlens/topk_length")
    _check_lengths(meta, extra_lengths, "extra_topk_length", "_extra_lengths", "extra_topk_length")
    return False


def _check_lengths(meta: FlashMLASchedMeta, lengths: Optional[torch.Tensor], name: str, attr: str, what: str) -> None:
    """A reused metadata object's lengths (``attr``: its fields' prefix): given now as on the first call, with
    the same values (read only when the tensor is another one, or written since)."""
    ref, key, copy = (getattr(meta, attr + suffix) for suffix in ("_ref", "_key", "_copy"))
    if (lengths is None) != (copy is None):
        # Sparse decode only (dense always has cache_seqlens): the plan was made for the lengths
        # given, or for topk tokens each.
        raise ValueError(
            f"{name} must be given on every call with this tile_scheduler_metadata or on none "
            f"(first call: {'given' if copy is not None else 'None'})"
        )
    if lengths is not None and (lengths is not ref or lengths_key(lengths) != key):
        capturing = lengths.is_cuda and torch.cuda.is_current_stream_capturing()
        if not capturing and not torch.equal(lengths, copy):
            raise ValueError(
                f"tile_scheduler_metadata was computed for other {what} values; "
                "call get_mla_metadata() again when the lengths change"
            )
        setattr(meta, attr + "_ref", lengths)
        setattr(meta, attr + "_key", lengths_key(lengths))


def bind_metadata(meta: FlashMLASchedMeta, config: FlashMLASchedMeta.Config, capture: tuple,
                  lengths: Optional[torch.Tensor], extra_lengths: Optional[torch.Tensor] = None) -> None:
    """Record what an empty metadata object is computed for (after the call's checks passed), and whether the
    call runs inside a CUDA graph capture: ``capture`` is (capturing, the capture's id or None)."""
    meta.config = config
    meta.have_initialized = True
    meta._in_capture, meta._capture_id = capture
    for attr, given in (("_lengths", lengths), ("_extra_lengths", extra_lengths)):
        if given is not None:
            setattr(meta, attr + "_ref", given)
            setattr(meta, attr + "_key", lengths_key(given))
            setattr(meta, attr + "_copy", given.clone())


@contextlib.contextmanager
def unbind_on_error(meta: FlashMLASchedMeta, first: bool):
    """A first call that fails after its checks (and the binding) leaves the metadata empty again, as
    ``get_mla_metadata()`` made it, so the next call computes it afresh instead of inheriting a half-filled one."""
    if not first:
        yield
        return
    try:
        yield
    except BaseException:
        fresh = FlashMLASchedMeta()
        for f in dataclasses.fields(FlashMLASchedMeta):
            setattr(meta, f.name, getattr(fresh, f.name))
        raise
