"""Compile-only checks (CPU, sm_90a): the kernels use the Hopper paths we rely on, without spills."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest

pytestmark = pytest.mark.compile

OPTIONS = "--keep-ptx remarks{ptx}"


def _ptxas_report(stderr: str):
    spills = [tuple(map(int, m)) for m in re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", stderr)]
    regs = [int(m) for m in re.findall(r"Used (\d+) registers", stderr)]
    return spills, regs


def _assert_wgmma_not_serialized(stderr: str) -> None:
    """ptxas reports each serialization of the WGMMAs as "(Cnnnn) Potential Performance Loss: wgmma.mma_async
    instructions are serialized due to <reason>" (C7512: too few registers; C7518: a WGMMA in a divergent
    path), after which the WGMMAs run one after another.  Any such report fails, and any C75nn code (the
    checks before named C7514 and C7517)."""
    codes = set(re.findall(r"\((C\d{4})\)\s+Potential\s+Performance\s+Loss", stderr))
    codes = sorted(codes | set(re.findall(r"\((C75\d\d)\)", stderr)))
    assert not codes, f"ptxas serialized WGMMA ({', '.join(codes)}): " + stderr[:2000]


def _assert_seesaw_build_clean(ptx: str, capfd) -> list:
    """A seesaw dense build: both warpgroups' S over 36 k-blocks at least four times, no local memory, WGMMAs
    not serialised, no stack frame nor spills; returns ptxas's register counts."""
    assert ptx.count("wgmma.mma_async") >= 4 * 36
    assert "ld.local" not in ptx and "st.local" not in ptx
    err = capfd.readouterr().err
    _assert_wgmma_not_serialized(err)
    spills, regs = _ptxas_report(err)
    assert spills and all(sp == (0, 0, 0) for sp in spills), f"stack frame / spills: {spills}"
    return regs


def test_wgmma_serialization_check_reads_wrapped_remarks():
    """The compiler prints ptxas's report wrapped and indented inside a remark; the check still finds it."""
    wrapped = ("  ptxas output:\n          ptxas info    : (C7518) Potential Performance Loss: wgmma.mma_async "
               "instructions are\n          serialized due to a reason in the function 'k'\n")
    split = "ptxas info    : (C7512) Potential\n          Performance Loss: wgmma.mma_async instructions are"
    for text, code in ((wrapped, "C7518"), (split, "C7512")):
        with pytest.raises(AssertionError, match=code):
            _assert_wgmma_not_serialized(text)
    with pytest.raises(AssertionError, match="C7514"):
        _assert_wgmma_not_serialized("ptxas info    : (C7514) wgmma.mma_async serialized")
    _assert_wgmma_not_serialized("ptxas info    : Used 168 registers, used 6 barriers")


def _out_copied_sync() -> str:
    """The PTX of the sparse follower's 128 threads meeting at OUT_COPIED (the staged rows copied out)."""
    from mla_cute.kernels.barriers import SparseBarrier

    return f"bar.sync \t{int(SparseBarrier.OUT_COPIED)}, 128;"


def _dense_step(dtype: str, s_q: int, h_q: int, h_kv: int, causal: bool, *, with_combine: bool = False,
                fill: bool = False, **split):
    """The dense step the resolver makes for a call of this shape whose plan the host does not know (as in a
    CUDA graph capture), its split config's fields ``split`` replaced: a kernel variant the resolver picks for
    other shapes or plans, built directly."""
    import dataclasses

    from mla_cute.schedules import DEFAULT_DENSE_SCHEDULE, resolve_dense

    step = resolve_dense(DEFAULT_DENSE_SCHEDULE, dtype=dtype, s_q=s_q, h_q=h_q, h_kv=h_kv, causal=causal,
                         page=64).capture_step
    return dataclasses.replace(step, split=dataclasses.replace(step.split, **split), with_combine=with_combine,
                               fill=fill)


def _sparse_step(s_q: int, h_q: int, has_sink: bool = False, *, has_topk_length: bool = False,
                 with_combine: bool = False, kv_format: str = "V32", extra_cache: str = "", **split):
    """The sparse step the resolver makes for this shape on a plan that is not small, its split config's fields
    ``split`` replaced (the crossover, its producer halves and 16-bit partials are chosen per shape and plan)."""
    import dataclasses

    from mla_cute.schedules import DEFAULT_SPARSE_SCHEDULE, resolve_sparse

    # 4096 requests of 2048 tokens: far more tiles a part than a small plan has.
    step = resolve_sparse(DEFAULT_SPARSE_SCHEDULE, b=4096, s_q=s_q, h_q=h_q, topk=2048, has_sink=has_sink,
                          has_topk_length=has_topk_length or bool(extra_cache), capturing=True, kv_format=kv_format,
                          extra_cache=extra_cache).capture_step
    return dataclasses.replace(step, split=dataclasses.replace(step.split, **split), with_combine=with_combine)


@pytest.fixture(autouse=True)
def _no_artifacts_in_working_dir():
    """``--keep-ptx`` writes each kernel's PTX into $CUTE_DSL_DUMP_DIR, which the DSL reads once, when cutlass
    is imported (conftest points it at a temporary folder before that); none may land in the working directory."""
    def artifacts():
        return {e.name: e.stat().st_mtime_ns for e in os.scandir() if e.name.endswith((".ptx", ".cubin"))}

    before = artifacts()
    yield
    written = sorted(name for name, mtime in artifacts().items() if before.get(name) != mtime)
    assert not written, f"compile artifacts written into {os.getcwd()}: {written}"


@pytest.mark.parametrize(
    "dtype,s_q,h_q,h_kv,causal,evict_first",
    [
        ("bfloat16", 1, 128, 1, False, False),
        ("float16", 2, 64, 1, True, False),
        ("bfloat16", 4, 9, 3, True, True),
    ],
)
def test_dense_serial_uses_wgmma_tma_mbarriers_without_spills(dtype, s_q, h_q, h_kv, causal, evict_first, capfd):
    """The serial baseline (a TMA producer warpgroup handing its registers to two consumers), built from the
    config an experiment rewrites the resolver's into (``kernel="serial"``, one CTA a cluster)."""
    from mla_cute.kernels.build import compile_dense
    from mla_cute.kernels.constants import L2_EVICT_FIRST

    step = _dense_step(dtype, s_q, h_q, h_kv, causal, kernel="serial", cluster_ctas=1, cross_term_first=False,
                       evict_first=evict_first)
    ptx = compile_dense(step, options=OPTIONS).__ptx__
    assert ptx, "no PTX kept"
    # QK^T over 576 = 36 k-steps of 16, PV over 64 tokens = 4.
    assert ptx.count("wgmma.mma_async") >= 40
    assert "cp.async.bulk.tensor" in ptx
    assert "mbarrier.try_wait" in ptx
    assert "setmaxnreg" in ptx
    # Evict-first loads take the EVICT_FIRST cache policy (as an immediate); without it no load does.
    assert (str(L2_EVICT_FIRST) in ptx) == evict_first, "evict-first loads carry the EVICT_FIRST policy"
    assert "ld.local" not in ptx and "st.local" not in ptx
    err = capfd.readouterr().err
    _assert_wgmma_not_serialized(err)
    spills, regs = _ptxas_report(err)
    assert spills, "ptxas printed no resource report"
    assert all(s == (0, 0, 0) for s in spills), f"stack frame / spills: {spills}"
    assert max(regs) <= 168, f"registers {regs} exceed the 384-thread, 1-CTA budget"
    _check_register_split(ptx, regs, inc_warpgroups=2)


@pytest.mark.parametrize("s_q,h_q,causal,cluster_ctas,cross_first",
                         [(2, 128, True, 2, True), (1, 64, False, 1, True), (2, 64, True, 1, False),
                          (1, 128, False, 2, False)])
def test_dense_seesaw_splits_tiles_into_sub_tile_copies_without_spills(s_q, h_q, causal, cluster_ctas, cross_first,
                                                                       capfd):
    """The seesaw kernel: 9 TMA sub-tile copies per tile with their own barriers, S = Q K^T partly with
    Q's RoPE part from registers, P V from registers and from shared memory, no WGMMA serialization; the
    cross term first with one M tile or with tile multicast (h_q = 128), FlashMLA's step order with two
    unpaired M tiles (the resolver's choices), and FlashMLA's order on pairs (an experiment's).  A load
    warpgroup issues the copies, its registers given to the two consumer warpgroups (setmaxnreg within the
    CTA's launch allocation, or the increase never returns)."""
    from mla_cute.kernels.barriers import SeesawBarrier
    from mla_cute.kernels.build import compile_dense

    step = _dense_step("bfloat16", s_q, h_q, 1, causal, cluster_ctas=cluster_ctas, cross_term_first=cross_first)
    ptx = compile_dense(step, options=OPTIONS).__ptx__
    named = {int(b) for b in re.findall(r"bar(?:rier)?\.(?:sync|arrive)(?:\.aligned)? (\d+),", ptx)}
    assert (int(SeesawBarrier.P0_READ) in named) == cross_first
    assert (int(SeesawBarrier.P1_ISSUED) in named) != cross_first
    assert ptx.count("wgmma.mma_async") >= 4 * 36
    assert ptx.count("cp.async.bulk.tensor") >= 1 + 9 + 9
    assert ptx.count("mbarrier.arrive.expect_tx") >= 19
    # P and Q's RoPE columns as register A operands (the .f32.bf16.bf16 form with {...} A registers).
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n256k16\.f32\.bf16\.bf16\s+\{[^}]*\},\s*\{", ptx)
    assert "setmaxnreg" in ptx
    multicast = re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::cluster\.global\.\S*multicast::cluster", ptx)
    assert bool(multicast) == (cluster_ctas > 1)
    regs = _assert_seesaw_build_clean(ptx, capfd)
    assert max(regs) <= 168, f"registers {regs} exceed the 384-thread, 1-CTA budget"
    _check_register_split(ptx, regs, inc_warpgroups=2)


@pytest.mark.parametrize("evict_first", [False, True])
def test_dense_tile_multicast_loads_each_sub_tile_once_for_the_pair(evict_first, capfd):
    """``cluster_ctas=2``: a 2-CTA cluster, each CTA loading half of every sub-tile into both (TMA
    multicast), handing its copy of a buffer half back to the peer (remote mbarrier arrival), and a
    cluster barrier after the barriers' initialisation and before exit; with normal and evict-first loads
    (the resolver picks them per plan)."""
    from mla_cute.kernels.build import compile_dense
    from mla_cute.kernels.constants import L2_EVICT_FIRST

    step = _dense_step("bfloat16", 1, 128, 1, False, evict_first=evict_first)
    assert step.split.cluster_ctas == 2 and step.split.cross_term_first, step.split
    ptx = compile_dense(step, options=OPTIONS).__ptx__
    copies = re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::cluster\.global\.\S+", ptx)
    multicast = [copy for copy in copies if "multicast::cluster" in copy]
    assert len(multicast) >= 9 + 9  # a request's first two tiles, then each refill
    # Evict-first: the tile copies take the EVICT_FIRST cache policy (as an immediate); without it no copy does.
    assert (str(L2_EVICT_FIRST) in ptx) == evict_first
    assert "mbarrier.arrive.shared::cluster" in ptx
    assert ptx.count("barrier.cluster.arrive") >= 2 and ptx.count("barrier.cluster.wait") >= 2
    _assert_seesaw_build_clean(ptx, capfd)


def test_dense_quad_multicast_loads_a_quarter_of_each_sub_tile_into_four(capfd):
    """``cluster_ctas=4`` (s_q = 2, h_q = 128: four M tiles): every sub-tile copy multicasts into the four
    CTAs (mask 0b1111), each hand-back reaches the three peers, each buffer half's barrier counts four
    hand-backs, and the kernel keeps its registers without spills."""
    from mla_cute.kernels.build import compile_dense

    ptx = compile_dense(_dense_step("bfloat16", 2, 128, 1, True, cluster_ctas=4), options=OPTIONS).__ptx__
    multicast = re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::cluster\.global\.\S*multicast::cluster", ptx)
    assert len(multicast) >= 9 + 9
    masks = set(re.findall(r"mov\.b16\s+%rs\d+, (\d+);", ptx))
    assert masks == {"15"}, masks
    assert re.search(r"mov\.b32\s+(%r\d+), 4;\s*mbarrier\.init\.shared\.b64\s+\[%r\d+\+\d+\], \1;", ptx)
    # Three peers at each of the hand-back sites (pairs: one).
    assert ptx.count("mapa.shared::cluster") >= 3 * 4
    assert max(_assert_seesaw_build_clean(ptx, capfd)) <= 168


def test_dense_smem_bytes_match_the_planned_occupancy():
    """The device's cluster counts (``mla_cute.device.device_facts``, which the resolver plans 4-CTA clusters
    and the idle-SM fill with) come from an occupancy query for ``DENSE_SMEM_BYTES`` of shared memory and
    ``DENSE_THREADS`` threads: the seesaw kernel, traced for a 4-CTA cluster as ``compile_dense`` traces it,
    takes exactly that."""
    import cutlass.cute as cute

    from mla_cute.jit import compile_options
    from mla_cute.kernels.signatures import dense_decode_signature
    from mla_cute.kernels.constants import DTYPES
    from mla_cute.kernels.dense_seesaw import DenseSeesawKernel
    from mla_cute.schedules.resolve import DENSE_SMEM_BYTES, DENSE_THREADS

    split = _dense_step("float16", 1, 256, 1, False, cluster_ctas=4).split
    kernel = DenseSeesawKernel(split)
    args = dense_decode_signature(DTYPES[split.dtype], split.s_q, split.group * split.h_kv, split.h_kv, split.page)
    cute.compile(kernel, *args, options=compile_options(""))
    assert kernel.smem_bytes == DENSE_SMEM_BYTES, (kernel.smem_bytes, DENSE_SMEM_BYTES)
    assert kernel.num_threads == DENSE_THREADS


def test_dense_idle_sm_fill_orders_its_two_split_kernels(capfd):
    """The idle-SM fill's step (``kernels/fill.py``): the 4-CTA clusters' kernel (mask 0b1111) lets the next
    kernel launch as each CTA starts, before its first copy; the pairs' kernel (mask 0b11) waits for it after its
    last cluster barrier; the combine waits as usual; neither split kernel spills.  The step without fill has
    no programmatic launch in its split kernel."""
    from mla_cute.kernels.build import compile_dense, compile_scheduler
    from mla_cute.schedules import SchedulerConfig

    ptx = compile_dense(_dense_step("bfloat16", 2, 128, 1, True, cluster_ctas=4, with_combine=True, fill=True),
                        options=OPTIONS).__ptx__
    bodies = ptx.split(".entry")[1:]
    split = [body for body in bodies if "wgmma.mma_async" in body]
    assert len(bodies) == 4 and len(split) == 2
    clusters = next(body for body in split if "griddepcontrol.launch_dependents" in body)
    fill = next(body for body in split if body is not clusters)
    assert "griddepcontrol.wait" not in clusters and "griddepcontrol.launch_dependents" not in fill
    assert clusters.index("griddepcontrol.launch_dependents") < clusters.index("cp.async.bulk.tensor")
    assert fill.count("griddepcontrol.wait") == 1
    assert fill.rindex("barrier.cluster.wait") < fill.index("griddepcontrol.wait")
    for body, mask in ((clusters, "15"), (fill, "3")):
        assert set(re.findall(r"mov\.b16\s+%rs\d+, (\d+);", body)) == {mask}
    assert max(_assert_seesaw_build_clean(ptx, capfd)) <= 168
    plain = compile_dense(_dense_step("bfloat16", 2, 128, 1, True, cluster_ctas=4), options=OPTIONS).__ptx__
    assert "griddepcontrol" not in plain
    compile_scheduler(SchedulerConfig(5, 16, 16, 3, 11), options=OPTIONS)
    spills, _ = _ptxas_report(capfd.readouterr().err)
    assert spills and all(sp == (0, 0, 0) for sp in spills), spills
    with pytest.raises(ValueError, match="4-CTA clusters"):
        compile_dense(_dense_step("bfloat16", 2, 128, 1, True, fill=True))


def test_sparse_16bit_partials_leave_through_staged_rows_without_spills(capfd):
    """With ``partials_16bit`` (small plans: the crossover without producer halves) a split's rows are staged
    like the final rows and leave the same way, 16-byte loads and stores by the follower's threads; the
    combine loads 16-bit vectors, no spills."""
    from mla_cute.kernels.build import compile_sparse

    step = _sparse_step(2, 128, with_combine=True, producer_halves=False, partials_16bit=True)
    assert step.split.crossover
    ptx = compile_sparse(step, options=OPTIONS).__ptx__
    assert "cp.async.bulk.global.shared" not in ptx
    # The follower's threads copy the rows out and meet at OUT_COPIED: final rows and partials.
    assert ptx.count(_out_copied_sync()) == 2 and ptx.count("st.global.v4.b32") >= 2
    assert re.search(r"ld\.global(\.\w+)*\.v2\.b32", ptx), "the combine's 16-bit partial vectors (4 x 16 bits)"
    assert "ld.local" not in ptx and "st.local" not in ptx
    err = capfd.readouterr().err
    _assert_wgmma_not_serialized(err)
    spills, _ = _ptxas_report(err)
    assert spills and all(sp == (0, 0, 0) for sp in spills), spills


def test_combine_and_scheduler_compile_without_spills(capfd):
    from mla_cute.kernels.build import compile_combine, compile_scheduler
    from mla_cute.schedules import CombineConfig, SchedulerConfig

    ptx = compile_combine(CombineConfig("bfloat16", 64, 2), h_kv=1, options=OPTIONS).__ptx__
    # Two kernels: rows / column chunks a warp each, and the spread chunks, whose warps meet at a barrier.
    assert ptx.count(".entry") == 2 and "spread_kernel" in ptx and "bar.sync" in ptx
    compile_scheduler(SchedulerConfig(5), options=OPTIONS)
    compile_scheduler(SchedulerConfig(5, 12), options=OPTIONS)  # with the search for a plan of whole requests
    compile_scheduler(SchedulerConfig(5, 0, 4), options=OPTIONS)  # for a plan of even pieces
    compile_scheduler(SchedulerConfig(5, 12, 4), options=OPTIONS)  # both
    spills, _ = _ptxas_report(capfd.readouterr().err)
    assert len(spills) == 6 and all(s == (0, 0, 0) for s in spills), spills


def test_combine_waits_for_the_split_kernel_before_the_partials(capfd):
    """Each combine kernel (a programmatic dependent launch) reads the split counts, then waits for the split
    grid (every thread, split request or not) before its first load of a partial; with a sink, as sparse
    decode's combine takes it."""
    from mla_cute.kernels.build import compile_combine
    from mla_cute.schedules import CombineConfig

    ptx = compile_combine(CombineConfig("bfloat16", 128, 1, has_sink=True), h_kv=1, options=OPTIONS).__ptx__
    kernels = ptx.split(".entry")[1:]
    assert len(kernels) == 2
    for body in kernels:
        wait = body.index("griddepcontrol.wait")
        assert body.count("griddepcontrol.wait") == 1
        assert body.index("ld.global") < wait, "the split counts are read before the wait"
        assert wait < body.index("ld.global.v4"), "a partial read before the wait"
    assert "griddepcontrol.launch_dependents" not in ptx
    spills, _ = _ptxas_report(capfd.readouterr().err)
    assert len(spills) == 2 and all(sp == (0, 0, 0) for sp in spills), spills


def _check_register_split(ptx: str, regs: list, inc_warpgroups: int = 1) -> None:
    """setmaxnreg moves registers inside the CTA's launch allocation (3 warpgroups): the budgets must fit
    in regs x 384, or an increase never returns (a hang, not an error).  The sparse kernel has one
    setmaxnreg per warpgroup; the dense kernels' increase is executed by both consumer warpgroups
    (``inc_warpgroups=2``).  A warpgroup without one keeps the launch count."""
    dec = [int(m) for m in re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+)", ptx)]
    inc = [int(m) for m in re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+)", ptx)] * inc_warpgroups
    assert inc and dec and len(dec) + len(inc) <= 3, (dec, inc)
    budgets = dec + inc + [max(regs)] * (3 - len(dec) - len(inc))
    assert sum(budgets) <= max(regs) * 3, f"setmaxnreg {budgets} exceeds {max(regs)} x 384"


@pytest.mark.parametrize("s_q,h_q,sink", [(2, 128, True), (1, 64, False), (1, 16, False)])
def test_sparse_decode_gathers_with_vector_loads_without_spills(s_q, h_q, sink, capfd):
    """The whole-tile gather (each CTA gathers all 64 rows of a token tile: the resolver's kernel where the
    64-head tiles do not pair, forced at h_q = 128)."""
    from mla_cute.kernels.build import compile_sparse

    step = _sparse_step(s_q, h_q, sink, crossover=False, producer_halves=False)
    ptx = compile_sparse(step, options=OPTIONS).__ptx__
    assert ptx.count("wgmma.mma_async") >= 40
    assert "cp.async.bulk.tensor" in ptx  # Q
    # 6 x 16-byte loads per gathered row, 4 rows per thread per tile, each asking L2 for the 256 bytes around it.
    assert ptx.count("ld.global.L2::256B.v4.b32") >= 24
    assert "cvt.rn.f16x2.e4m3x2" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    # Final rows leave through shared memory, copied out by the follower's threads in 16-byte pieces, which
    # meet at a barrier of their own before the next Q overwrites them.
    assert "ld.shared.v4.b32" in ptx and "st.global.v4.b32" in ptx and _out_copied_sync() in ptx
    assert "cp.async.bulk.global.shared" not in ptx
    # The follower prefetches the next request's Q into L2 (one TMA prefetch per 64-column box of Q).
    assert "cp.async.bulk.prefetch.tensor" in ptx
    err = capfd.readouterr().err
    _assert_wgmma_not_serialized(err)
    spills, regs = _ptxas_report(err)
    assert spills and all(s == (0, 0, 0) for s in spills), f"stack frame / spills: {spills}"
    assert max(regs) <= 168
    _check_register_split(ptx, regs)


@pytest.mark.parametrize("fmt,s_q,h_q,crossover", [("V32_NO_ROPE", 2, 128, True), ("V4", 2, 128, True),
                                                   ("V41", 1, 64, False), ("V4", 1, 32, False),
                                                   ("V41_PAGED", 2, 128, True), ("V41_PAGED", 1, 64, False)])
def test_sparse_decode_reads_each_cache_format_without_spills(fmt, s_q, h_q, crossover, capfd):
    """The d_qk-512 formats: S takes 32 k-blocks a 64-head tile, no bf16 RoPE block (V4's RoPE is converted to
    fp16 with the latent); the tokens' bytes arrive with 16-byte loads and dequantize from e4m3."""
    from mla_cute.kernels.build import compile_sparse

    step = _sparse_step(s_q, h_q, crossover=crossover, producer_halves=False, kv_format=fmt)
    assert step.split.kv_format == fmt and step.split.d_qk == 512
    ptx = compile_sparse(step, options=OPTIONS).__ptx__
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16" not in ptx  # no bf16 RoPE k-block
    assert ptx.count("ld.global.L2::256B.v4.b32") >= 10 and "cvt.rn.f16x2.e4m3x2" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    err = capfd.readouterr().err
    _assert_wgmma_not_serialized(err)
    spills, regs = _ptxas_report(err)
    assert spills and all(s == (0, 0, 0) for s in spills), f"stack frame / spills: {spills}"
    _check_register_split(ptx, regs)


@pytest.mark.parametrize("fmt,extra,h_q,crossover,halves,max_spill", [
    ("V4", "V4", 128, True, True, 0), ("V32", "V32", 128, True, False, 0), ("V32", "V32", 64, False, False, 0),
    ("V4", "V4", 64, False, False, 64), ("V41", "V41_FP4", 128, True, True, 0), ("V41", "V41_FP4", 64, False, False, 64),
    ("V41_PAGED", "V41_FP4", 128, True, False, 0)])
def test_sparse_decode_over_two_caches_compiles(fmt, extra, h_q, crossover, halves, max_spill, capfd):
    """The kernel over an extra cache: its rows and indices are loaded beside the main cache's (two index
    streams, rows from both caches; V41_FP4's through its own codec: 8-byte code loads, prmt table lookups);
    the d_qk-512 formats' whole-tile gather spills a little (at most ``max_spill`` bytes), the rest none."""
    from mla_cute.kernels.build import compile_sparse

    step = _sparse_step(2, h_q, True, kv_format=fmt, extra_cache=extra, crossover=crossover, producer_halves=halves)
    assert step.split.extra_cache == extra and step.split.has_topk_length
    ptx = compile_sparse(step, options=OPTIONS).__ptx__
    assert ptx.count("ld.global.L2::256B.v4.b32") >= 12 and "cvt.rn.f16x2.e4m3x2" in ptx
    assert ("prmt.b32" in ptx and "ld.global.v2.b32" in ptx) == (extra == "V41_FP4")
    err = capfd.readouterr().err
    _assert_wgmma_not_serialized(err)
    spills, regs = _ptxas_report(err)
    assert spills and all(s[1] <= max_spill and s[2] <= max_spill for s in spills), f"spills: {spills}"
    _check_register_split(ptx, regs)


@pytest.mark.parametrize("halves", [True, False])
def test_sparse_crossover_hands_the_peer_its_rows(halves, capfd):
    """The crossover writes into the peer CTA's stage through the cluster with bulk copies, completing bytes
    on its transaction barrier; with the producer halves (plans that are not small) and without (small
    plans)."""
    from mla_cute.kernels.build import compile_sparse

    ptx = compile_sparse(_sparse_step(2, 128, producer_halves=halves), options=OPTIONS).__ptx__
    assert ptx.count("wgmma.mma_async") >= 40
    bulk_copies = ptx.count("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes")
    stores = ptx.count("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32")
    # Two lanes of each producer warp copy its rows of a 64-column block (or their bias) to the peer's
    # addresses (mapa) as soon as two blocks are stored (8 rows, or 16 with the producer halves): four
    # hand-overs of latent blocks and one of the RoPE block and the bias, six copy instructions in the code.
    assert bulk_copies == 6 and stores == 0 and "mapa.shared::cluster" in ptx
    assert "mbarrier.arrive.expect_tx" in ptx
    assert "mbarrier.arrive.shared::cluster" in ptx  # consumers release the peer's stage too
    assert "barrier.cluster.arrive" in ptx and "barrier.cluster.wait" in ptx
    err = capfd.readouterr().err
    _assert_wgmma_not_serialized(err)
    spills, regs = _ptxas_report(err)
    assert spills and all(s == (0, 0, 0) for s in spills), f"stack frame / spills: {spills}"
    _check_register_split(ptx, regs)


def test_sparse_producer_halves(capfd):
    """``producer_halves``: each half of the producer warpgroup gathers every other tile, 4 rows a thread, and
    each of its warps copies its 16 rows of a 64-column block (2 KiB) or their bias (64 bytes) to the peer; a
    stage's full barrier counts the 64 threads of one half."""
    from mla_cute.kernels.build import compile_sparse

    # s_q = 4: a kernel no other test here builds, so ptxas reports on it.
    step = _sparse_step(4, 128)
    assert step.split.crossover and step.split.producer_halves, step.split
    ptx = compile_sparse(step, options=OPTIONS).__ptx__

    def value(operand):  # an immediate, or the constant a register was set to
        if operand.isdigit():
            return int(operand)
        found = re.findall(rf"mov\.b32\s+{re.escape(operand)}, (\d+);", ptx)
        return int(found[0]) if len(found) == 1 else None

    sizes = re.findall(r"cp\.async\.bulk\.shared::cluster\.shared::cta\.mbarrier::complete_tx::bytes"
                       r"\s+\[[^]]+\], \[[^]]+\], ([%\w]+), \[", ptx)
    assert len(sizes) == 6 and {value(x) for x in sizes} == {2048, 64}, sizes
    counts = [value(x) for x in re.findall(r"mbarrier\.init\.shared(?:::cta)?\.b64\s+\[[^]]+\], ([%\w]+);", ptx)]
    assert 64 in counts and 512 in counts, counts  # a stage's full barrier: one half; empty: both CTAs' consumers
    assert ptx.count("wgmma.mma_async") >= 40
    err = capfd.readouterr().err
    _assert_wgmma_not_serialized(err)
    spills, regs = _ptxas_report(err)
    assert spills and all(s == (0, 0, 0) for s in spills), f"stack frame / spills: {spills}"
    _check_register_split(ptx, regs)


@pytest.mark.parametrize("crossover", [True, False])
def test_sparse_operand_types(crossover, capfd):
    """fp16 operands: one conversion and one multiply an fp8 pair, fp16 MMAs for S's latent k-blocks and
    P V, bf16 MMAs for S's RoPE k-blocks; Q's readers (the leader's 128 threads) convert it behind a barrier
    of their own."""
    from mla_cute.kernels.barriers import SparseBarrier
    from mla_cute.kernels.build import compile_sparse

    # s_q = 3: kernels no other test here builds, so ptxas reports on each (a cached kernel reports nothing).
    step = _sparse_step(3, 128, crossover=crossover, producer_halves=crossover)
    ptx = compile_sparse(step, options=OPTIONS).__ptx__
    f16 = len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.f16\.f16", ptx))
    bf16 = len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16", ptx))
    converted = re.search(rf"bar\.sync\s+{int(SparseBarrier.Q_CONVERTED)}, 128;", ptx) is not None
    assert f16 > 0 and bf16 > 0 and f16 > 4 * bf16, (f16, bf16)
    assert "cvt.rn.f16x2.e4m3x2" in ptx and "mul.f16x2" in ptx and converted
    err = capfd.readouterr().err
    _assert_wgmma_not_serialized(err)
    spills, regs = _ptxas_report(err)
    assert spills and all(s == (0, 0, 0) for s in spills), f"stack frame / spills: {spills}"
    _check_register_split(ptx, regs)


def test_sparse_decode_without_topk_length_loads_no_lengths():
    """Without topk_length every request attends to topk tokens: the kernel built for such calls takes
    None for the lengths, so the loads of a request's length (each role's, a request ahead) are gone."""
    from mla_cute.kernels.build import compile_sparse

    loads = {}
    for given in (True, False):
        fn = compile_sparse(_sparse_step(2, 128, has_topk_length=given), options=OPTIONS)
        loads[given] = len(re.findall(r"\bld\.global\b", fn.__ptx__))
    assert loads[False] < loads[True], loads


@pytest.mark.parametrize("fields", [
    dict(s_q=1, group=64, cluster_ctas=2),  # one M tile: nothing to pair
    dict(s_q=2, group=64, causal=True, cluster_ctas=2),  # causal pairs need 128 heads a KV head
    dict(s_q=1, group=128, cluster_ctas=4),  # two M tiles cannot fill 4 CTAs
    dict(s_q=1, group=128, cluster_ctas=3),
    dict(s_q=1, group=128, cluster_ctas=2, kernel="serial"),
])
def test_dense_kernels_refuse_clusters_their_m_tiles_cannot_fill(fields):
    """A config the resolver would never make (an experiment's rewrite can) is refused when the kernel is built."""
    from mla_cute.kernels.dense_seesaw import DenseSeesawKernel
    from mla_cute.kernels.dense_serial import DenseSerialKernel
    from mla_cute.schedules import DenseSplitConfig

    base = dict(dtype="bfloat16", h_kv=1, causal=False, page=64, cross_term_first=True, evict_first=False)
    config = DenseSplitConfig(**{**base, **fields})
    kernel = DenseSerialKernel if config.kernel == "serial" else DenseSeesawKernel
    with pytest.raises(ValueError, match="cluster|CTAs"):
        kernel(config)


@pytest.mark.parametrize("d_qk,has_sink,has_topk_length", [(576, False, False), (512, True, True)])
def test_sparse_prefill_compiles_clean(capfd, d_qk, has_sink, has_topk_length):
    """The prefill kernel: Q by TMA, the rows gathered by 16-byte cp.async with zero-fill (a register source
    size), a commit group a sub-tile, each waited for and fenced for the async proxy before its arrival; S over
    9 sub-tiles (8 without RoPE) of 4 k-blocks and P V over 4 k-blocks, in both warpgroups; no local memory, no
    spills, WGMMA not serialized."""
    from mla_cute.kernels.build import compile_sparse_prefill
    from mla_cute.schedules import resolve_sparse_prefill

    call = resolve_sparse_prefill(s_q=4096, h_q=128, d_qk=d_qk, has_sink=has_sink, has_topk_length=has_topk_length)
    ptx = compile_sparse_prefill(call.config, options=OPTIONS).__ptx__
    subs = 9 if d_qk == 576 else 8
    assert "cp.async.bulk.tensor" in ptx
    copies = re.findall(r"cp\.async\.cg\.shared\.global(?:\.L2::\w+)? \[[^]]+\], \[[^]]+\], 16, %r\d+;", ptx)
    assert len(copies) == 4 * 4 * subs, len(copies)  # 4 rows a thread, per sub-tile, in 4 places of the loop
    assert ptx.count("cp.async.commit_group") == 4 * subs and "cp.async.mbarrier.arrive" not in ptx
    assert len(re.findall(r"cp\.async\.wait_group\s+\d+;\s*fence\.proxy\.async\.shared::cta", ptx)) == 4 * subs
    assert ptx.count("wgmma.mma_async") >= 2 * (subs * 4 + 4 * 4)
    assert "ld.local" not in ptx and "st.local" not in ptx
    err = capfd.readouterr().err
    _assert_wgmma_not_serialized(err)
    spills, _ = _ptxas_report(err)
    assert spills and all(sp == (0, 0, 0) for sp in spills), spills


@pytest.mark.parametrize("h_q,has_sink,has_topk_length", [(128, True, True), (32, False, False)])
def test_sparse_prefill_from_the_fp8_cache_compiles_clean(capfd, h_q, has_sink, has_topk_length):
    """Prefill from the FP8 cache is the sparse decode kernel with max_logits: gathered rows dequantized as in
    decode, final rows only (no fp32 partial stores, no combine), max_logits a second fp32 store beside lse,
    within the leader's register budget: no local memory, no spills, WGMMA not serialized."""
    from mla_cute.kernels.build import compile_sparse
    from mla_cute.schedules import resolve_sparse_prefill_fp8

    step = resolve_sparse_prefill_fp8(s_q=4096, h_q=h_q, has_sink=has_sink, has_topk_length=has_topk_length).step
    plain = dataclasses.replace(step, split=dataclasses.replace(step.split, max_logits=False))
    ptx = compile_sparse(step, options=OPTIONS).__ptx__
    assert "cvt.rn.f16x2.e4m3x2" in ptx and "cp.async.bulk.tensor" in ptx
    assert ptx.count("wgmma.mma_async") >= 40
    assert "ld.local" not in ptx and "st.local" not in ptx
    err = capfd.readouterr().err
    _assert_wgmma_not_serialized(err)
    spills, regs = _ptxas_report(err)
    assert spills and all(sp == (0, 0, 0) for sp in spills), spills
    _check_register_split(ptx, regs)
    # Two more 32-bit stores than the same kernel without max_logits: the leader's, beside lse, for each of a
    # thread's two rows.
    plain_ptx = compile_sparse(plain, options=OPTIONS).__ptx__
    capfd.readouterr()
    assert ptx.count("st.global.b32") == plain_ptx.count("st.global.b32") + 2


@pytest.mark.parametrize("fmt,dtype,slot_dtype", [("V32", "bfloat16", "int32"), ("V32_NO_ROPE", "float16", "int64"),
                                                  ("V4", "bfloat16", "int64"), ("V41", "float32", "int32"),
                                                  ("V41_PAGED", "bfloat16", "int32"), ("V41_FP4", "bfloat16", "int32")])
def test_cache_writer_compiles_clean(fmt, dtype, slot_dtype, capfd):
    """The cache writer: 16-byte row loads, 16-byte stores of a lane's e4m3 bytes (8-byte of its fp4 codes),
    e4m3 conversions in pairs, IEEE divisions only for fp4 (scale and values), no local memory, no spills."""
    from mla_cute.kernels.build import compile_write_cache
    from mla_cute.schedules.configs import WriteCacheConfig

    ptx = compile_write_cache(WriteCacheConfig(fmt, dtype, slot_dtype), options=OPTIONS).__ptx__
    assert "ld.global.v4.b32" in ptx
    assert ("st.global.v2.b32" if fmt == "V41_FP4" else "st.global.v4.b32") in ptx
    assert ptx.count("cvt.rn.satfinite.e4m3x2.f32") == (1 if fmt == "V41_FP4" else 8)
    assert ptx.count("div.rn.f32") == (17 if fmt == "V41_FP4" else 0)
    assert "ld.local" not in ptx and "st.local" not in ptx
    spills, _ = _ptxas_report(capfd.readouterr().err)
    assert spills and all(sp == (0, 0, 0) for sp in spills), spills


@pytest.mark.parametrize("dtype,has_sink", [("bfloat16", True), ("float32", False)])
def test_merge_kernel_compiles_clean(dtype, has_sink, capfd):
    """The merge of partial results: 16-byte loads of each part's row piece and 16-byte stores of the merged one,
    no local memory, no spills."""
    from mla_cute.kernels.build import compile_merge
    from mla_cute.schedules.configs import MergeConfig

    ptx = compile_merge(MergeConfig(dtype, 512, has_sink), options=OPTIONS).__ptx__
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    spills, _ = _ptxas_report(capfd.readouterr().err)
    assert spills and all(sp == (0, 0, 0) for sp in spills), spills


def test_compile_kernel_adds_the_pipeline_switch_and_keeps_the_option_string(monkeypatch):
    """``compile_kernel`` compiles with ``PIPELINE`` among the DSL's raw compiler options, and the option string
    a caller gives (``--keep-ptx``) still applies."""
    from cutlass.base_dsl.compiler import CompileCallable, EnableTVMFFI, ExtraCompilerOpts, KeepPTX

    from mla_cute.kernels import signatures

    seen = []
    monkeypatch.setattr(CompileCallable, "__call__", lambda self, *a, **k: seen.append(self._compile_options))
    signatures.compile_kernel(object(), (), "--keep-ptx")
    signatures.compile_kernel(object(), ())
    keep, plain = seen
    for options in seen:
        assert signatures.PIPELINE in options.options[ExtraCompilerOpts].value.split()
        assert options.options[EnableTVMFFI].value is True
    assert keep.options[KeepPTX].value is True
    assert plain.options[KeepPTX].value is False
