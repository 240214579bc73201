"""Compile entry points of the kernels, with fake tensors (``signatures.py``; no GPU needed to compile).  Each
takes a frozen config (``mla_cute.schedules.configs``) and keys the compile cache on it."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import pickle
import subprocess
import sys

from ..jit import _report, _target_arch, cached_compile, disk_cache_usable, estimate, is_warm, prepare_dsl
from ..schedules.configs import (CombineConfig, DenseStepConfig, MergeConfig, SchedulerConfig, SparsePrefillConfig,
                                 SparseStepConfig, WriteCacheConfig)

# This module does not import the DSL: a warm kernel loads without it (``mla_cute.jit``); each build imports
# the DSL with the kernel's module and ``signatures.py``.


# The compile functions ``compile_all`` builds in parallel, by name, and their cache keys' first field.
_KINDS = {"compile_dense": "dense_decode", "compile_scheduler": "scheduler", "compile_sparse": "sparse_decode_fp8",
          "compile_sparse_prefill": "sparse_prefill", "compile_write_cache": "write_cache", "compile_merge": "merge"}


def compile_all(tasks) -> list:
    """The compiled kernels of ``tasks``, ``(compile function of this module, config)`` pairs, in order (each
    distinct one built once).  When
    more than one is cold (in neither the memory nor the disk cache), those are built first at once, each in a
    process of its own writing the disk cache, so a cold call costs its slowest kernel's compile rather than
    their sum; the kernels then load from disk here.  Other functions (a test's stand-ins) run in order."""
    unique = list(dict.fromkeys(tasks))
    ours = all(getattr(fn, "builds_in_parallel", False) for fn, _ in unique)
    if ours and disk_cache_usable() and compile_jobs() > 1:
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
    (``python -c``, given the pair and this process's ``sys.path`` on stdin): nothing of this process runs there
    again, so a caller's script needs no ``if __name__ == "__main__"`` guard, and no CUDA or DSL state is
    inherited.  A child that fails (or cannot start) is reported with its output; its kernel is then built here
    (by the caller)."""
    workers = min(len(cold), compile_jobs())
    _report(f"compiling {len(cold)} kernels at once, {workers} processes"
            f"{estimate([(_KINDS[name], config) for name, config in cold])} ...")
    # The child sets its sys.path to this process's before importing anything of ours (``python -c`` would put
    # the working directory first, where another checkout may lie).
    # The task is pickled inside: unpickling its config imports our modules.
    # It imports no torch (a kernel compiles from fake tensors; TVM-FFI imports torch where it finds it, 4 s of a
    # cold compile on a 16-core H200 machine), so it is told the arch this process targets.
    command = [sys.executable, "-c", "import pickle, sys; sys.modules['torch'] = None; "
               "path, task = pickle.loads(sys.stdin.buffer.read()); sys.path[:] = path; "
               "from mla_cute.kernels.build import _build_child; _build_child(pickle.loads(task))"]
    path = list(sys.path)
    prepare_dsl()  # without a GPU: sm_90a
    env = dict(os.environ, CUTE_DSL_ARCH=_target_arch())

    def build(task):
        try:
            done = subprocess.run(command, input=pickle.dumps((path, pickle.dumps(task))), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, env=env)
            return task, done.returncode, done.stdout.decode(errors="replace")
        except OSError as exc:  # no interpreter to start (an embedded one): built here instead
            return task, None, f"{type(exc).__name__}: {exc}"

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for (name, config), code, text in pool.map(build, cold):
            if code == 0:
                sys.stderr.write(text)
            else:
                how = f"exit {code}" if code is not None else "not started"
                _report(f"the process building {name}({config}) failed ({how}), building it here; its output:\n"
                        f"{text[-4000:]}")


def _build_child(task) -> None:
    """In a child process: build ``task`` (function name, config) into the disk cache."""
    name, config = task
    globals()[name](config)


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
        from . import signatures as sig

        args = sig.dense_decode_signature(sig.DTYPES[split.dtype], split.s_q, split.group * split.h_kv, split.h_kv,
                                          split.page)
        if step.fill:  # the fill parts' records: a second table like the first
            args = args[:5] + (sig._records(),) + args[5:]
        return sig.compile_kernel(kernel, args, options)

    return cached_compile((_KINDS["compile_dense"], step, options), build, describe=f"dense decode {step}",
                          persistent=not options)


def compile_combine(config: CombineConfig, h_kv: int = 1, options: str = ""):
    """The combine kernel alone (the runtime calls it inside the decode steps)."""

    def build():
        from . import signatures as sig
        from .combine import CombineKernel

        return sig.compile_kernel(CombineKernel(config), sig.combine_signature(config, h_kv), options)

    return cached_compile(("combine", config, h_kv, options), build, describe=f"combine {config} h_kv={h_kv}",
                          persistent=not options)


def compile_scheduler(config: SchedulerConfig, options: str = ""):
    """The GPU planner for a policy (``SchedulerConfig``)."""

    def build():
        from . import signatures as sig
        from .scheduler import SchedulerKernel

        return sig.compile_kernel(SchedulerKernel(config), sig.scheduler_signature(config.lengths), options)

    return cached_compile((_KINDS["compile_scheduler"], config, options), build, describe=f"scheduler {config}",
                          persistent=not options)


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
        from . import signatures as sig

        args = sig.sparse_decode_signature(split.s_q, split.h_q, split.has_sink, split.has_topk_length,
                                           split.partials_16bit, split.max_logits, split.kv_format, split.extra_cache)
        return sig.compile_kernel(kernel, args, options)

    return cached_compile((_KINDS["compile_sparse"], step, options), build, describe=f"sparse decode {step}",
                          persistent=not options)


def compile_sparse_prefill(config: SparsePrefillConfig, options: str = ""):
    """The compiled sparse prefill kernel (``kernels/sparse_prefill.py``); without ``has_topk_length`` it takes
    None there, without ``has_sink`` None for the sink."""

    def build():
        from . import signatures as sig
        from .sparse_prefill import SparsePrefillKernel

        return sig.compile_kernel(SparsePrefillKernel(config), sig.sparse_prefill_signature(config), options)

    return cached_compile((_KINDS["compile_sparse_prefill"], config, options), build, describe=f"sparse prefill {config}",
                          persistent=not options)


def compile_write_cache(config: WriteCacheConfig, options: str = ""):
    """The compiled cache writer (``kernels/write_cache.py``)."""

    def build():
        from . import signatures as sig
        from .write_cache import WriteCacheKernel

        return sig.compile_kernel(WriteCacheKernel(config), sig.write_cache_signature(config), options)

    return cached_compile((_KINDS["compile_write_cache"], config, options), build, describe=f"cache writer {config}",
                          persistent=not options)


def compile_merge(config: MergeConfig, options: str = ""):
    """The compiled merge of partial attention results (``kernels/merge.py``)."""

    def build():
        from . import signatures as sig
        from .merge import MergeKernel

        return sig.compile_kernel(MergeKernel(config), sig.merge_signature(config), options)

    return cached_compile((_KINDS["compile_merge"], config, options), build, describe=f"merge {config}",
                          persistent=not options)


for _name in _KINDS:  # what compile_all may build in child processes (by name there)
    globals()[_name].builds_in_parallel = True
