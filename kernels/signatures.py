"""The fake tensors each kernel is compiled with (symbolic sizes and strides, the alignments the kernels assume),
and the DSL's compile call: imported by a build only (``build.py``), as it imports the DSL."""

from __future__ import annotations

from ..jit import compile_options, prepare_dsl

prepare_dsl()

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor  # noqa: E402

from ..schedules.configs import CombineConfig, MergeConfig, SparsePrefillConfig, WriteCacheConfig  # noqa: E402
from .constants import D_QK, D_V, DTYPES, FLOAT_DTYPES  # noqa: E402


# MLIR pipeline switches every kernel is compiled with.  Strength reduction costs a quarter of a cold
# compile (the default dense kernel: 16.1 s -> 12.5 s without it on two CPU cores, the sparse decode kernel
# 7.3 s -> 6.4 s) and buys nothing here: with it off the dense kernel's PTX has three integer instructions
# fewer and the sparse kernel's is byte-identical; registers and spills (none) are unchanged.
PIPELINE = "use-strength-reduction-pass=false"


def compile_kernel(kernel, args, options: str = ""):
    """``cute.compile`` of ``kernel`` with the fake ``args``, called through TVM-FFI, with ``options`` (the
    DSL's option string) and ``PIPELINE``."""
    from cutlass.base_dsl.compiler import CompileCallable, ExtraCompilerOpts, _parse_compile_options_from_str

    parsed = _parse_compile_options_from_str(compile_options(options))
    extra = parsed.options[ExtraCompilerOpts]
    extra.value = (extra.value + " " + PIPELINE).strip()
    compile_ = CompileCallable()
    compile_._compile_options = parsed  # a string ``options=`` would rebuild them without the pipeline switch
    return compile_(kernel, *args)


def _sym(div: int = 1, width: int = 32):
    return cute.sym_int(width, divisibility=div)


def _s64():
    return _sym(8, 64)  # 16-byte aligned strides of 16-bit tensors, as TMA needs


def _records():
    """A fake ``[parts, 8]`` table of scheduler records."""
    return make_fake_compact_tensor(cutlass.Int32, (_sym(), 8), stride_order=(1, 0), assumed_align=16)


def _split_io(dtype, b, s_q: int, h_q: int, h_kv: int, partial_dtype=cutlass.Float32):
    """Fake scheduler records and split counts, FlashMLA's out / lse, and the partials (O in
    ``partial_dtype``, lse in fp32): (sched, num_splits, out, lse, o_accum, lse_accum), as every decode
    step takes them."""
    rows = s_q * (h_q // h_kv)
    splits = _sym()
    # out and the O partials pass 2^31 elements (b = 32768 at h_q = 128): their batch strides are 64-bit, so
    # every element offset is.  The others are packed.
    out_batch = _sym(s_q * h_q * D_V, 64)
    acc_batch = _sym(h_kv * rows * D_V, 64)
    return (
        _records(),
        make_fake_compact_tensor(cutlass.Int32, (_sym(),), assumed_align=4),
        make_fake_tensor(dtype, (b, s_q, h_q, D_V), (out_batch, h_q * D_V, D_V, 1), assumed_align=16),
        make_fake_compact_tensor(cutlass.Float32, (b, h_q, s_q), stride_order=(2, 1, 0), assumed_align=4),
        make_fake_tensor(partial_dtype, (splits, h_kv, rows, D_V), (acc_batch, rows * D_V, D_V, 1),
                         assumed_align=16),
        make_fake_compact_tensor(cutlass.Float32, (splits, h_kv, rows), stride_order=(2, 1, 0), assumed_align=16),
    )


def _scale_and_stream():
    return cutlass.Float32(1.0), make_fake_stream(use_tvm_ffi_env_stream=True)


def combine_signature(config: CombineConfig, h_kv: int):
    """Fake tensors matching ``CombineKernel.__call__``."""
    h_q = config.group * h_kv
    _, num_splits, out, lse, o_acc, lse_acc = _split_io(DTYPES[config.dtype], _sym(), config.s_q, h_q, h_kv)
    sink = make_fake_compact_tensor(cutlass.Float32, (h_q,), assumed_align=4) if config.has_sink else None
    return (num_splits, o_acc, lse_acc, out, lse, sink, make_fake_stream(use_tvm_ffi_env_stream=True))


def scheduler_signature(lengths: str = "dense"):
    """Fake tensors matching ``SchedulerKernel.__call__``: lengths, the extra cache's lengths (``lengths``
    "two_caches", else None), records, split counts, the longest length and the extra cache's topk."""
    b = _sym()
    extra = make_fake_compact_tensor(cutlass.Int32, (b,), assumed_align=4) if lengths == "two_caches" else None
    return (
        make_fake_compact_tensor(cutlass.Int32, (b,), assumed_align=4),
        extra,
        _records(),
        make_fake_compact_tensor(cutlass.Int32, (_sym(),), assumed_align=4),
        cutlass.Int32(0),
        cutlass.Int32(0),
        make_fake_stream(use_tvm_ffi_env_stream=True),
    )


def dense_decode_signature(dtype, s_q: int, h_q: int, h_kv: int, page: int):
    """Fake tensors matching ``DenseSeesawKernel.__call__`` (fp32 partials)."""
    rows = s_q * (h_q // h_kv)
    b, nb, mb = _sym(), _sym(), _sym()
    q = make_fake_tensor(dtype, (b, rows, h_kv, D_QK), (_s64(), _s64(), _s64(), 1), assumed_align=16)
    k = make_fake_tensor(dtype, (nb, page, h_kv, D_QK), (_s64(), _s64(), _s64(), 1), assumed_align=16)
    block_table = make_fake_tensor(cutlass.Int32, (b, mb), (_sym(1, 64), 1), assumed_align=4)
    seqlens = make_fake_compact_tensor(cutlass.Int32, (b,), assumed_align=4)
    return (q, k, block_table, seqlens, *_split_io(dtype, b, s_q, h_q, h_kv), *_scale_and_stream())


def sparse_decode_signature(s_q: int, h_q: int, has_sink: bool, has_topk_length: bool, partials_16bit: bool = False,
                            max_logits: bool = False, kv_format: str = "V32", extra_cache: str = ""):
    """Fake tensors matching ``SparseDecodeFp8Kernel.__call__`` (and the sparse step's); without ``max_logits``
    None in its place, without ``extra_cache`` (the extra cache's format) None for the extra cache, its indices and
    lengths."""
    from .cache_rows import cache_rows

    rows = cache_rows(kv_format)
    b, nb, page, topk = _sym(), _sym(), _sym(), _sym()
    bf16 = cutlass.BFloat16
    q = make_fake_tensor(bf16, (b, s_q, h_q, rows.d_qk), (_s64(), _s64(), _s64(), 1), assumed_align=16)
    # The rows (V4: the data rows) as int32 words: 16-byte loads need 16-byte aligned rows and blocks.
    cache = make_fake_tensor(cutlass.Int32, (nb, page, rows.row_words), (_sym(4, 64), rows.row_words, 1),
                             assumed_align=16)
    indices = make_fake_tensor(cutlass.Int32, (b, s_q, topk), (_sym(1, 64), _sym(1, 64), 1), assumed_align=4)
    topk_len = make_fake_compact_tensor(cutlass.Int32, (b,), assumed_align=4) if has_topk_length else None
    extra = (None, None, None)
    if extra_cache:  # its own format, blocks, page size and topk
        words = cache_rows(extra_cache).row_words
        extra = (make_fake_tensor(cutlass.Int32, (_sym(), _sym(), words), (_sym(4, 64), words, 1), assumed_align=16),
                 make_fake_tensor(cutlass.Int32, (b, s_q, _sym()), (_sym(1, 64), _sym(1, 64), 1), assumed_align=4),
                 make_fake_compact_tensor(cutlass.Int32, (b,), assumed_align=4))
    sink = make_fake_compact_tensor(cutlass.Float32, (h_q,), assumed_align=4) if has_sink else None
    partial = bf16 if partials_16bit else cutlass.Float32
    top = None
    if max_logits:
        top = make_fake_compact_tensor(cutlass.Float32, (b, h_q, s_q), stride_order=(2, 1, 0), assumed_align=4)
    return (q, cache, indices, topk_len, *extra, *_split_io(bf16, b, s_q, h_q, 1, partial), sink, top,
            *_scale_and_stream())


def sparse_prefill_signature(config: SparsePrefillConfig):
    """Fake tensors matching ``SparsePrefillKernel.__call__``."""
    s_q, s_kv, topk, h_q, d = _sym(), _sym(), _sym(), config.h_q, config.d_qk
    bf16 = cutlass.BFloat16
    # q and out pass 2^31 elements at s_q = 70000 (h_q = 128): their token strides are 64-bit.
    q = make_fake_tensor(bf16, (s_q, h_q, d), (_s64(), _sym(8), 1), assumed_align=16)
    kv = make_fake_tensor(bf16, (s_kv, d), (_s64(), 1), assumed_align=16)
    indices = make_fake_tensor(cutlass.Int32, (s_q, topk), (_sym(1, 64), 1), assumed_align=4)
    topk_len = make_fake_compact_tensor(cutlass.Int32, (s_q,), assumed_align=4) if config.has_topk_length else None
    sink = make_fake_compact_tensor(cutlass.Float32, (h_q,), assumed_align=4) if config.has_sink else None
    out = make_fake_tensor(bf16, (s_q, h_q, D_V), (_sym(8, 64), D_V, 1), assumed_align=16)
    max_logits = make_fake_tensor(cutlass.Float32, (s_q, h_q), (_sym(1, 64), 1), assumed_align=4)
    lse = make_fake_tensor(cutlass.Float32, (s_q, h_q), (_sym(1, 64), 1), assumed_align=4)
    return (q, kv, indices, topk_len, sink, out, max_logits, lse, cutlass.Int32(1), *_scale_and_stream())


def write_cache_signature(config: WriteCacheConfig):
    """Fake tensors matching ``WriteCacheKernel.__call__``: 16-byte aligned rows, the pages as int32 words."""
    dtype = FLOAT_DTYPES[config.dtype]
    d = 576 if config.kv_format == "V32" else 512
    per_vector = 16 // (dtype.width // 8)
    rows = make_fake_tensor(dtype, (_sym(), d), (_sym(per_vector, 64), 1), assumed_align=16)
    slot_type = cutlass.Int64 if config.slot_dtype == "int64" else cutlass.Int32
    slots = make_fake_compact_tensor(slot_type, (_sym(),), assumed_align=slot_type.width // 8)
    pages = make_fake_tensor(cutlass.Int32, (_sym(), _sym()), (_sym(4, 64), 1), assumed_align=16)
    return rows, slots, pages, cutlass.Int32(1), make_fake_stream(use_tvm_ffi_env_stream=True)


def merge_signature(config: MergeConfig):
    """Fake tensors matching ``MergeKernel.__call__``: packed outs and lses, the merged out and lse."""
    dtype = FLOAT_DTYPES[config.dtype]
    r, b, s_q, h_q = _sym(), _sym(), _sym(), _sym()
    outs = make_fake_compact_tensor(dtype, (r, b, s_q, h_q, config.d_v), stride_order=(4, 3, 2, 1, 0), assumed_align=16)
    lses = make_fake_compact_tensor(cutlass.Float32, (r, b, h_q, s_q), stride_order=(3, 2, 1, 0), assumed_align=4)
    sink = make_fake_compact_tensor(cutlass.Float32, (h_q,), assumed_align=4) if config.has_sink else None
    out = make_fake_compact_tensor(dtype, (b, s_q, h_q, config.d_v), stride_order=(3, 2, 1, 0), assumed_align=16)
    lse = make_fake_compact_tensor(cutlass.Float32, (b, h_q, s_q), stride_order=(2, 1, 0), assumed_align=4)
    return outs, lses, sink, out, lse, make_fake_stream(use_tvm_ffi_env_stream=True)
