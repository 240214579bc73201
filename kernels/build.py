"""Compile entry points of the kernels, with fake tensors (no GPU needed to compile)."""

from __future__ import annotations

from ..jit import cached_compile, compile_options, cutlass_dtype, prepare_dsl

prepare_dsl()

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor  # noqa: E402

from ..schedules.dense import DenseDecodeSchedule  # noqa: E402
from ..schedules.planner import FILL_SHARE_ONE  # noqa: E402
from .dense_decode import D_QK, D_V, DenseDecodeKernel  # noqa: E402
from .dense_seesaw import DenseSeesawKernel  # noqa: E402


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


def dense_decode_signature(dtype, s_q: int, h_q: int, h_kv: int, page: int, partial_dtype=cutlass.Float32):
    """Fake tensors matching ``DenseDecodeKernel.__call__``."""
    rows = s_q * (h_q // h_kv)
    b, nb, mb = _sym(), _sym(), _sym()
    q = make_fake_tensor(dtype, (b, rows, h_kv, D_QK), (_s64(), _s64(), _s64(), 1), assumed_align=16)
    k = make_fake_tensor(dtype, (nb, page, h_kv, D_QK), (_s64(), _s64(), _s64(), 1), assumed_align=16)
    block_table = make_fake_tensor(cutlass.Int32, (b, mb), (_sym(1, 64), 1), assumed_align=4)
    seqlens = make_fake_compact_tensor(cutlass.Int32, (b,), assumed_align=4)
    return (q, k, block_table, seqlens, *_split_io(dtype, b, s_q, h_q, h_kv, partial_dtype), *_scale_and_stream())


def dense_decode_key(torch_dtype, s_q: int, h_q: int, h_kv: int, causal: bool, page: int, schedule: DenseDecodeSchedule):
    return ("dense_decode", str(torch_dtype), s_q, h_q // h_kv, h_kv, bool(causal and s_q > 1), page,
            schedule.kernel_key())


def _describe(torch_dtype, s_q, h_q, h_kv, causal, page, schedule) -> str:
    return (f"{str(torch_dtype).replace('torch.', '')} s_q={s_q} h_q={h_q} h_kv={h_kv} causal={causal} "
            f"page={page} kv_stages={schedule.kv_stages} qk_prefetch={schedule.qk_prefetch} "
            f"kv_evict_first={schedule.kv_evict_first} seesaw={schedule.seesaw} "
            f"cross_term_first={schedule.cross_term_first} tile_multicast={schedule.tile_multicast} "
            f"cluster_ctas={schedule.cluster_ctas_of_call(s_q, h_q, h_kv, causal)} "
            f"load_warpgroup={schedule.load_warpgroup_on()} partials_16bit={schedule.partials_16bit}")


def compile_dense_decode(torch_dtype, s_q: int, h_q: int, h_kv: int, causal: bool, page: int,
                         schedule: DenseDecodeSchedule, options: str = "", *, with_combine: bool = False,
                         fill: bool = False):
    """The compiled dense decode split kernel for these static facts (``with_combine``: split + combine
    behind one host entry, as the runtime calls it).  ``kv_evict_first=None`` (chosen per plan) builds the
    kernel for a plan the host does not know; the runtime passes ``schedule.for_plan(...)``.  ``fill``: a
    schedule of 4-CTA clusters, built as the idle-SM fill's step (``fill.py``: the clusters' kernel, the
    pairs' kernel and, ``with_combine``, the combine), which takes the fill parts' records after the
    clusters' (``mSched``, ``mFillSched``)."""
    schedule.validate()
    schedule = schedule.for_plan(None)
    causal = causal and s_q > 1
    if fill and schedule.cluster_ctas_of_call(s_q, h_q, h_kv, causal) != 4:
        raise ValueError("fill=True needs a schedule of 4-CTA clusters for this shape (multicast_ctas=4 and four M "
                         "tiles to a cluster)")
    key = dense_decode_key(torch_dtype, s_q, h_q, h_kv, causal, page, schedule) + (options, with_combine)
    if fill:
        key += ("fill",)

    def build():
        dtype = cutlass_dtype(torch_dtype)
        group = h_q // h_kv
        combine = None
        if with_combine:
            from .combine import CombineKernel

            combine = CombineKernel(dtype, group, s_q, chunked_batch=schedule.combine_chunked_batch,
                                    spread_partials=schedule.combine_spread_partials,
                                    pdl=schedule.combine_pdl)
        facts = (dtype, s_q * group, group, s_q, causal, page)
        if fill:
            from .fill import DenseDecodeFillStep

            kernel = DenseDecodeFillStep(DenseSeesawKernel(*facts, schedule, fill_role="clusters"),
                                         DenseSeesawKernel(*facts, schedule.as_pairs(), fill_role="fill"), combine)
        else:
            kernel = (DenseSeesawKernel if schedule.seesaw else DenseDecodeKernel)(*facts, schedule)
            if combine is not None:
                from .dense_step import DenseDecodeStep

                kernel = DenseDecodeStep(kernel, combine)
        partial = dtype if schedule.partials_16bit else cutlass.Float32
        args = dense_decode_signature(dtype, s_q, h_q, h_kv, page, partial)
        if fill:  # the fill parts' records: a second table like the first
            args = args[:5] + (_records(),) + args[5:]
        return cute.compile(kernel, *args, options=compile_options(options))

    what = ("dense decode step " if with_combine else "dense decode split kernel ") + _describe(
        torch_dtype, s_q, h_q, h_kv, causal, page, schedule) + (" with the idle-SM fill" if fill else "")
    return cached_compile(key, build, describe=what, persistent=not options)


def compile_combine(torch_dtype, s_q: int, h_q: int, h_kv: int, options: str = "", chunked_batch: int = 4,
                    spread_partials: int = 48, pdl: bool = False):
    """The combine kernel alone (the runtime calls it inside the decode steps, there with the schedule's
    ``combine_pdl``)."""
    from .combine import CombineKernel

    key = ("combine", str(torch_dtype), s_q, h_q, h_kv, options, chunked_batch, spread_partials, pdl)

    def build():
        dtype = cutlass_dtype(torch_dtype)
        _, num_splits, out, lse, o_acc, lse_acc = _split_io(dtype, _sym(), s_q, h_q, h_kv)
        args = (num_splits, o_acc, lse_acc, out, lse, None, make_fake_stream(use_tvm_ffi_env_stream=True))
        kernel = CombineKernel(dtype, h_q // h_kv, s_q, chunked_batch=chunked_batch, spread_partials=spread_partials,
                               pdl=pdl)
        return cute.compile(kernel, *args, options=compile_options(options))

    what = (f"combine s_q={s_q} h_q={h_q} h_kv={h_kv} chunked_batch={chunked_batch} spread_partials={spread_partials} "
            f"pdl={pdl}")
    return cached_compile(key, build, describe=what, persistent=not options)


def compile_scheduler(fixed_cost: int, unsplit_slack: int = 0, even_split_slack: int = 0, fill_parts: int = 0,
                      fill_share: int = FILL_SHARE_ONE, options: str = ""):
    """The scheduler kernel for a planner policy (``schedule.plan_policy``, and with fill parts the two more
    arguments of ``mla_cute.backend.DensePlanChoice.policy``)."""
    from .scheduler import SchedulerKernel

    key = ("scheduler", fixed_cost, unsplit_slack, even_split_slack, options)
    if fill_parts:
        key += (fill_parts, fill_share)

    def build():
        args = (
            make_fake_compact_tensor(cutlass.Int32, (_sym(),), assumed_align=4),
            _records(),
            make_fake_compact_tensor(cutlass.Int32, (_sym(),), assumed_align=4),
            cutlass.Int32(0),
            make_fake_stream(use_tvm_ffi_env_stream=True),
        )
        return cute.compile(SchedulerKernel(fixed_cost, unsplit_slack, even_split_slack, fill_parts, fill_share),
                            *args, options=compile_options(options))

    what = f"scheduler fixed_cost={fixed_cost} unsplit_slack={unsplit_slack} even_split_slack={even_split_slack}"
    if fill_parts:
        what += f" fill_parts={fill_parts} fill_share={fill_share}"
    return cached_compile(key, build, describe=what, persistent=not options)


def sparse_decode_signature(s_q: int, h_q: int, has_sink: bool, has_topk_length: bool, partials_16bit: bool = False):
    """Fake tensors matching ``SparseDecodeFp8Kernel.__call__`` (and the sparse step)."""
    from .sparse_decode_fp8 import ROW_BYTES

    b, nb, page, topk = _sym(), _sym(), _sym(), _sym()
    bf16 = cutlass.BFloat16
    q = make_fake_tensor(bf16, (b, s_q, h_q, D_QK), (_s64(), _s64(), _s64(), 1), assumed_align=16)
    # The 656-byte rows as int32 words: 16-byte loads need 16-byte aligned rows.
    cache = make_fake_tensor(cutlass.Int32, (nb, page, ROW_BYTES // 4), (_sym(4, 64), ROW_BYTES // 4, 1),
                             assumed_align=16)
    indices = make_fake_tensor(cutlass.Int32, (b, s_q, topk), (_sym(1, 64), _sym(1, 64), 1), assumed_align=4)
    topk_len = make_fake_compact_tensor(cutlass.Int32, (b,), assumed_align=4) if has_topk_length else None
    sink = make_fake_compact_tensor(cutlass.Float32, (h_q,), assumed_align=4) if has_sink else None
    partial = bf16 if partials_16bit else cutlass.Float32
    return (q, cache, indices, topk_len, *_split_io(bf16, b, s_q, h_q, 1, partial), sink, *_scale_and_stream())


def compile_sparse_decode(s_q: int, h_q: int, has_sink: bool, schedule, options: str = "", *,
                          with_combine: bool = False, has_topk_length: bool = False):
    """The compiled sparse FP8 decode split kernel (``with_combine``: split + combine behind one entry).
    ``has_topk_length``: the calls pass ``topk_length``; without it the kernel takes None there and every
    request attends to topk tokens, with no length to load.  ``partials_16bit=None`` or ``producer_halves=None``
    (chosen per plan) builds the kernel for a plan that is not small; the runtime passes ``schedule.for_plan(...)``."""
    schedule.validate()
    if schedule.partials_16bit is None or schedule.producer_halves is None:
        schedule = schedule.for_plan(False)
    key = ("sparse_decode_fp8", s_q, h_q, bool(has_sink), schedule.kernel_key(), options, with_combine,
           bool(has_topk_length))

    def build():
        from .sparse_decode_fp8 import SparseDecodeFp8Kernel

        kernel = SparseDecodeFp8Kernel(h_q, s_q, has_sink, schedule)
        if with_combine:
            from .combine import CombineKernel
            from .sparse_step import SparseDecodeStep

            kernel = SparseDecodeStep(
                kernel, CombineKernel(cutlass.BFloat16, h_q, s_q, has_sink, schedule.combine_chunked_batch,
                                     schedule.combine_spread_partials, schedule.combine_pdl))
        args = sparse_decode_signature(s_q, h_q, has_sink, has_topk_length, schedule.partials_16bit)
        return cute.compile(kernel, *args,
                            options=compile_options(options))

    what = (("sparse decode step " if with_combine else "sparse decode split kernel ")
            + f"s_q={s_q} h_q={h_q} sink={bool(has_sink)} topk_length={bool(has_topk_length)} "
            + f"kv_stages={schedule.kv_stages} "
            + f"crossover={schedule.crossover} peer_bulk_copy={schedule.peer_bulk_copy} "
            + f"leader_follower={schedule.leader_follower} partials_16bit={schedule.partials_16bit} "
            + f"fp16_operands={schedule.fp16_operands} producer_halves={schedule.producer_halves}")
    return cached_compile(key, build, describe=what, persistent=not options)
