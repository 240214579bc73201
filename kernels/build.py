"""Compile entry points of the kernels, with fake tensors (no GPU needed to compile).  Each takes a frozen
config (``mla_cute.schedules.configs``) and keys the compile cache on it."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import pickle
import subprocess
import sys

from ..jit import _report, cached_compile, compile_options, disk_cache_enabled, is_warm, prepare_dsl

prepare_dsl()

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor  # noqa: E402

from ..schedules.configs import (CombineConfig, DenseStepConfig, SchedulerConfig,  # noqa: E402
                                 SparsePrefillConfig, SparseStepConfig, WriteCacheConfig)
from .constants import D_QK, D_V, DTYPES  # noqa: E402


# The compile functions ``compile_all`` builds in parallel, by name, and their cache keys' first field.
_KINDS = {"compile_dense": "dense_decode", "compile_scheduler": "scheduler", "compile_sparse": "sparse_decode_fp8",
          "compile_sparse_prefill": "sparse_prefill", "compile_write_cache": "write_cache"}


def compile_all(tasks) -> list:
    """The compiled kernels of ``tasks``, ``(compile function of this module, config)`` pairs, in order (each
    distinct one built once).  When
    more than one is cold (in neither the memory nor the disk cache), those are built first at once, each in a
    process of its own writing the disk cache, so a cold call costs its slowest kernel's compile rather than
    their sum; the kernels then load from disk here.  Other functions (a test's stand-ins) run in order."""
    unique = list(dict.fromkeys(tasks))
    ours = all(getattr(fn, "builds_in_parallel", False) for fn, _ in unique)
    if ours and disk_cache_enabled() and compile_jobs() > 1:
        cold = [(fn.__name__, cfg) for fn, cfg in unique if not is_warm((_KINDS[fn.__name__], cfg, ""))]
        if len(cold) > 1:
            _build_in_processes(cold)
    done = {task: task[0](task[1]) for task in unique}
    return [done[task] for task in tasks]


def compile_jobs() -> int:
    """The processes ``compile_all`` may use: ``$MLA_CUTE_COMPILE_JOBS``, else the CPU count (1: no child
    processes)."""
    text = os.environ.get("MLA_CUTE_COMPILE_JOBS")
    if text is None:
        return os.cpu_count() or 1
    try:
        jobs = int(text)
    except ValueError:
        jobs = 0
    if jobs < 1:
        raise ValueError(f"MLA_CUTE_COMPILE_JOBS must be an integer >= 1, got {text!r}")
    return jobs


def _build_in_processes(cold: list) -> None:
    """Build ``cold`` ((function name, config) pairs) into the disk cache, each in a fresh interpreter of its own
    (``python -c``, given the pair on stdin and this process's ``sys.path``): nothing of this process runs there
    again, so a caller's script needs no ``if __name__ == "__main__"`` guard, and no CUDA or DSL state is
    inherited.  A child that fails is reported with its output; its kernel is then built here (by the caller)."""
    workers = min(len(cold), compile_jobs())
    _report(f"compiling {len(cold)} kernels at once, {workers} processes ...")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    command = [sys.executable, "-c", "from mla_cute.kernels.build import _build_child; _build_child()"]

    def build(task):
        done = subprocess.run(command, input=pickle.dumps(task), env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT)
        return task, done

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for (name, config), done in pool.map(build, cold):
            text = done.stdout.decode(errors="replace")
            if done.returncode == 0:
                sys.stderr.write(text)
            else:
                _report(f"the process building {name}({config}) failed (exit {done.returncode}), building it here; "
                        f"its output:\n{text[-4000:]}")


def _build_child() -> None:
    """In a child process: build the (function name, config) pickled on stdin into the disk cache."""
    name, config = pickle.loads(sys.stdin.buffer.read())
    globals()[name](config)


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


def dense_decode_signature(dtype, s_q: int, h_q: int, h_kv: int, page: int):
    """Fake tensors matching ``DenseSeesawKernel.__call__`` (fp32 partials)."""
    rows = s_q * (h_q // h_kv)
    b, nb, mb = _sym(), _sym(), _sym()
    q = make_fake_tensor(dtype, (b, rows, h_kv, D_QK), (_s64(), _s64(), _s64(), 1), assumed_align=16)
    k = make_fake_tensor(dtype, (nb, page, h_kv, D_QK), (_s64(), _s64(), _s64(), 1), assumed_align=16)
    block_table = make_fake_tensor(cutlass.Int32, (b, mb), (_sym(1, 64), 1), assumed_align=4)
    seqlens = make_fake_compact_tensor(cutlass.Int32, (b,), assumed_align=4)
    return (q, k, block_table, seqlens, *_split_io(dtype, b, s_q, h_q, h_kv), *_scale_and_stream())


def _dense_kernel(config):
    from .dense_seesaw import DenseSeesawKernel
    from .dense_serial import DenseSerialKernel

    return (DenseSerialKernel if config.kernel == "serial" else DenseSeesawKernel)(config)


def compile_dense(step: DenseStepConfig, options: str = ""):
    """The compiled dense decode step: the split kernel alone, or behind one host entry with the combine
    (``step.with_combine``), and with ``step.fill`` the idle-SM fill's pair kernel between them
    (``fill.py``), which takes the fill parts' records after the clusters' (``mSched``, ``mFillSched``)."""
    split = step.split
    if step.fill and split.cluster_ctas != 4:
        raise ValueError(f"the idle-SM fill runs after 4-CTA clusters, got cluster_ctas={split.cluster_ctas}")

    def build():
        from .combine import CombineKernel

        combine = CombineKernel(step.combine) if step.with_combine else None
        if step.fill:
            from .dense_seesaw import DenseSeesawKernel
            from .fill import DenseDecodeFillStep

            pairs = dataclasses.replace(split, cluster_ctas=2)
            kernel = DenseDecodeFillStep(DenseSeesawKernel(split, fill_role="clusters"),
                                         DenseSeesawKernel(pairs, fill_role="fill"), combine)
        else:
            kernel = _dense_kernel(split)
            if combine is not None:
                from .dense_step import DenseDecodeStep

                kernel = DenseDecodeStep(kernel, combine)
        args = dense_decode_signature(DTYPES[split.dtype], split.s_q, split.group * split.h_kv, split.h_kv,
                                      split.page)
        if step.fill:  # the fill parts' records: a second table like the first
            args = args[:5] + (_records(),) + args[5:]
        return cute.compile(kernel, *args, options=compile_options(options))

    return cached_compile((_KINDS["compile_dense"], step, options), build, describe=f"dense decode {step}",
                          persistent=not options)


def compile_combine(config: CombineConfig, h_kv: int = 1, options: str = ""):
    """The combine kernel alone (the runtime calls it inside the decode steps)."""
    from .combine import CombineKernel

    def build():
        dtype = DTYPES[config.dtype]
        h_q = config.group * h_kv
        _, num_splits, out, lse, o_acc, lse_acc = _split_io(dtype, _sym(), config.s_q, h_q, h_kv)
        sink = make_fake_compact_tensor(cutlass.Float32, (h_q,), assumed_align=4) if config.has_sink else None
        args = (num_splits, o_acc, lse_acc, out, lse, sink, make_fake_stream(use_tvm_ffi_env_stream=True))
        return cute.compile(CombineKernel(config), *args, options=compile_options(options))

    return cached_compile(("combine", config, h_kv, options), build, describe=f"combine {config} h_kv={h_kv}",
                          persistent=not options)


def compile_scheduler(config: SchedulerConfig, options: str = ""):
    """The GPU planner for a policy (``SchedulerConfig``)."""
    from .scheduler import SchedulerKernel

    def build():
        args = (
            make_fake_compact_tensor(cutlass.Int32, (_sym(),), assumed_align=4),
            _records(),
            make_fake_compact_tensor(cutlass.Int32, (_sym(),), assumed_align=4),
            cutlass.Int32(0),
            make_fake_stream(use_tvm_ffi_env_stream=True),
        )
        return cute.compile(SchedulerKernel(config), *args, options=compile_options(options))

    return cached_compile((_KINDS["compile_scheduler"], config, options), build, describe=f"scheduler {config}",
                          persistent=not options)


def sparse_decode_signature(s_q: int, h_q: int, has_sink: bool, has_topk_length: bool, partials_16bit: bool = False,
                            max_logits: bool = False, kv_format: str = "V32", extra_cache: bool = False):
    """Fake tensors matching ``SparseDecodeFp8Kernel.__call__`` (and the sparse step's); without ``max_logits``
    None in its place, without ``extra_cache`` None for the extra cache, its indices and lengths."""
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
    if extra_cache:  # its own blocks, page size and topk
        extra = (make_fake_tensor(cutlass.Int32, (_sym(), _sym(), rows.row_words), (_sym(4, 64), rows.row_words, 1),
                                  assumed_align=16),
                 make_fake_tensor(cutlass.Int32, (b, s_q, _sym()), (_sym(1, 64), _sym(1, 64), 1), assumed_align=4),
                 make_fake_compact_tensor(cutlass.Int32, (b,), assumed_align=4))
    sink = make_fake_compact_tensor(cutlass.Float32, (h_q,), assumed_align=4) if has_sink else None
    partial = bf16 if partials_16bit else cutlass.Float32
    top = None
    if max_logits:
        top = make_fake_compact_tensor(cutlass.Float32, (b, h_q, s_q), stride_order=(2, 1, 0), assumed_align=4)
    return (q, cache, indices, topk_len, *extra, *_split_io(bf16, b, s_q, h_q, 1, partial), sink, top,
            *_scale_and_stream())


def compile_sparse(step: SparseStepConfig, options: str = ""):
    """The compiled sparse FP8 decode step: the split kernel, with the combine behind one entry when
    ``step.with_combine``.  Without ``has_topk_length`` the kernel takes None there and every request attends
    to topk tokens.  The max_logits tensor follows the sink: None, but with ``split.max_logits`` (prefill from
    the FP8 cache, the kernel alone)."""
    split = step.split
    if split.max_logits and step.with_combine:
        raise ValueError("max_logits: a kernel writing max_logits serves whole requests, without the combine")

    def build():
        from .sparse_decode_fp8 import SparseDecodeFp8Kernel

        kernel = SparseDecodeFp8Kernel(split)
        if step.with_combine:
            from .combine import CombineKernel
            from .sparse_step import SparseDecodeStep

            kernel = SparseDecodeStep(kernel, CombineKernel(step.combine))
        args = sparse_decode_signature(split.s_q, split.h_q, split.has_sink, split.has_topk_length,
                                       split.partials_16bit, split.max_logits, split.kv_format, split.extra_cache)
        return cute.compile(kernel, *args, options=compile_options(options))

    return cached_compile((_KINDS["compile_sparse"], step, options), build, describe=f"sparse decode {step}",
                          persistent=not options)


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


def compile_sparse_prefill(config: SparsePrefillConfig, options: str = ""):
    """The compiled sparse prefill kernel (``kernels/sparse_prefill.py``); without ``has_topk_length`` it takes
    None there, without ``has_sink`` None for the sink."""

    def build():
        from .sparse_prefill import SparsePrefillKernel

        return cute.compile(SparsePrefillKernel(config), *sparse_prefill_signature(config),
                            options=compile_options(options))

    return cached_compile((_KINDS["compile_sparse_prefill"], config, options), build, describe=f"sparse prefill {config}",
                          persistent=not options)


def write_cache_signature(config: WriteCacheConfig):
    """Fake tensors matching ``WriteCacheKernel.__call__``: 16-byte aligned rows, the pages as int32 words."""
    from .write_cache import ROW_TYPES

    dtype = ROW_TYPES[config.dtype]
    d = 576 if config.kv_format == "V32" else 512
    per_vector = 16 // (dtype.width // 8)
    rows = make_fake_tensor(dtype, (_sym(), d), (_sym(per_vector, 64), 1), assumed_align=16)
    slot_type = cutlass.Int64 if config.slot_dtype == "int64" else cutlass.Int32
    slots = make_fake_compact_tensor(slot_type, (_sym(),), assumed_align=slot_type.width // 8)
    pages = make_fake_tensor(cutlass.Int32, (_sym(), _sym()), (_sym(4, 64), 1), assumed_align=16)
    return rows, slots, pages, cutlass.Int32(1), make_fake_stream(use_tvm_ffi_env_stream=True)


def compile_write_cache(config: WriteCacheConfig, options: str = ""):
    """The compiled cache writer (``kernels/write_cache.py``)."""

    def build():
        from .write_cache import WriteCacheKernel

        return cute.compile(WriteCacheKernel(config), *write_cache_signature(config), options=compile_options(options))

    return cached_compile((_KINDS["compile_write_cache"], config, options), build, describe=f"cache writer {config}",
                          persistent=not options)


for _name in _KINDS:  # what compile_all may build in child processes (by name there)
    globals()[_name].builds_in_parallel = True
