"""Batch-invariant decode (``enable_batch_invariant=True``) on the CPU: the plan cuts each request by its own length
alone, every batch size resolves to the same kernels, and the public call takes the flag on both backends.  The
bits themselves are checked on the GPU (``test_batch_invariance_gpu.py``)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import mla_cute
from mla_cute.schedules import (DEFAULT_DENSE_SCHEDULE, DEFAULT_SPARSE_SCHEDULE, RECORD_FIELDS, DenseDecodeSchedule,
                                SparseDecodeSchedule, call_invariant_plan, invariant_plan, resolve_dense_invariant,
                                resolve_sparse_invariant)
from mla_cute.schedules.planner import invariant_pieces


def _request_records(records: torch.Tensor, num_splits: torch.Tensor, r: int, bound: int) -> list:
    """Request ``r``'s used records (request index dropped), from its ``bound`` parts."""
    rows = records.view(-1, bound, len(RECORD_FIELDS))[r].tolist()
    used = [row for row in rows if row[0] <= row[1]]
    assert all(row[0] == row[1] == r for row in used)
    assert len(used) == num_splits[r + 1] - num_splits[r]
    return [row[2:] for row in used]


@pytest.mark.parametrize("seed", range(6))
def test_a_request_is_cut_by_its_own_length_alone(seed):
    """Request r's pieces (tiles, split indices, flags) are the same in any batch: placed anywhere, beside any
    other lengths; together the pieces tile its blocks exactly once, each alone on a part."""
    rng = random.Random(seed)
    blocks, most, bound = rng.choice([(4, 8, 8), (32, 8, 8), (1, 3, 3), (8, 4, 2)])
    mine = rng.choice([0, 1, 63, 64, 65, rng.randrange(1, 64 * blocks * most * 2)])
    seen = []
    for _ in range(4):
        others = [rng.randrange(0, 64 * blocks * most * 2) for _ in range(rng.randrange(0, 9))]
        at = rng.randrange(len(others) + 1)
        lens = others[:at] + [mine] + others[at:]
        records, splits = invariant_plan(torch.tensor(lens, dtype=torch.int32), blocks, most, bound)
        assert records.dtype == splits.dtype == torch.int32 and records.shape == (len(lens) * bound, 8)
        for r, n in enumerate(lens):
            pieces = _request_records(records, splits, r, bound)
            tiles = -(-n // 64)
            assert len(pieces) == min(invariant_pieces(tiles, blocks, most), bound)
            assert pieces[0][0] == 0 and pieces[-1][1] == tiles
            assert all(a[1] == c[0] for a, c in zip(pieces, pieces[1:]))
            assert [p[2] for p in pieces] == list(range(len(pieces)))
            assert all(p[3] == p[4] == int(len(pieces) > 1) and p[5] == 0 for p in pieces)
        seen.append(_request_records(records, splits, at, bound))
    assert all(s == seen[0] for s in seen)


def test_pieces_follow_the_schedule():
    """``clamp(ceil(tiles / invariant_piece_blocks), 1, invariant_max_pieces)`` pieces of (nearly) equal size; an
    empty request one piece of no tiles; idle parts begin past their end."""
    records, splits = invariant_plan(torch.tensor([0, 5, 64 * 5, 64 * 40 + 3]), 4, 8, 8)
    assert splits.tolist() == [0, 1, 2, 4, 12]
    parts = records.view(4, 8, 8)
    assert parts[0, 0].tolist() == [0, 0, 0, 0, 0, 0, 0, 0]
    assert parts[2, :2, 2:4].tolist() == [[0, 2], [2, 5]]
    assert [p[3] - p[2] for p in parts[3].tolist()] == [5, 5, 5, 5, 5, 5, 5, 6]
    assert all(p[0] > p[1] for p in parts[0, 1:].tolist())


@pytest.mark.parametrize("bad", [dict(pieces_bound=0), dict(pieces_bound=5), dict(piece_blocks=0)])
def test_invariant_plan_refuses_bad_bounds(bad):
    args = dict(piece_blocks=8, max_pieces=4, pieces_bound=4) | bad
    with pytest.raises(ValueError, match="invariant_plan"):
        invariant_plan(torch.tensor([5]), **args)


@pytest.mark.parametrize("kind", [DenseDecodeSchedule, SparseDecodeSchedule])
@pytest.mark.parametrize("field", ["invariant_piece_blocks", "invariant_max_pieces"])
@pytest.mark.parametrize("value", [0, -1, True, 2.0])
def test_schedules_refuse_bad_invariant_fields(kind, field, value):
    with pytest.raises(ValueError, match=field):
        kind(**{field: value}).validate()


def test_every_batch_resolves_to_one_step():
    """The step is a shape fact (no lengths, no batch size): one combine path, a sparse kernel of plans that are not
    small (whose choice depends on b), fp32 partials."""
    dense = resolve_dense_invariant(DEFAULT_DENSE_SCHEDULE, dtype="bfloat16", s_q=2, h_q=128, h_kv=1, causal=True,
                                    page=64)
    assert dense.with_combine and dense.combine.chunked_batch == 0 and not dense.fill
    sparse = resolve_sparse_invariant(DEFAULT_SPARSE_SCHEDULE, s_q=2, h_q=64, has_sink=True, has_topk_length=True)
    assert not sparse.split.partials_16bit and sparse.with_combine and sparse.combine.chunked_batch == 0
    two = resolve_sparse_invariant(DEFAULT_SPARSE_SCHEDULE, s_q=2, h_q=64, has_sink=True, has_topk_length=True,
                                   kv_format="V4", extra_cache="V4")
    assert two.split.extra_cache == "V4" and not two.split.partials_16bit


def test_a_calls_plan_bounds_pieces_by_its_longest_request():
    """``call_invariant_plan``: the parts a request, from the longest request the shapes allow (a block-table row;
    topk; over two caches the main topk's whole tiles and the extra topk)."""
    lens = torch.tensor([100, 40000], dtype=torch.int32)
    assert call_invariant_plan(DEFAULT_DENSE_SCHEDULE, "dense", lens, 512 * 64)[0].shape == (2 * 8, 8)
    assert call_invariant_plan(DEFAULT_DENSE_SCHEDULE, "dense", lens, 64 * 64)[0].shape == (2 * 2, 8)
    assert call_invariant_plan(DEFAULT_SPARSE_SCHEDULE, "topk", lens, 2048)[0].shape == (2 * 4, 8)
    records, splits = call_invariant_plan(DEFAULT_SPARSE_SCHEDULE, "two_caches", torch.tensor([5, 128]), 128,
                                          torch.tensor([512, 1]), 512)
    assert records.shape == (2 * 2, 8) and splits.tolist() == [0, 2, 3]


# ------------------------------------------------------------------------------------ the public call
def _dense(b, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, 2, 16, 576, generator=g).bfloat16()
    cache = torch.randn(4 * b, 64, 1, 576, generator=g).bfloat16()
    table = torch.randperm(4 * b, generator=g).int().view(b, 4)
    return q, cache, table, torch.tensor(lens, dtype=torch.int32)


def test_reference_call_takes_the_flag_and_records_the_invariant_plan():
    """The reference backend (each request computed alone) fills the metadata with the kernels' plan."""
    q, cache, table, lens = _dense(3, [100, 0, 256])
    meta = mla_cute.get_mla_metadata()[0]
    out, lse = mla_cute.flash_mla_with_kvcache(q, cache, table, lens, 512, meta, causal=True,
                                               enable_batch_invariant=True)
    plain, plain_lse = mla_cute.flash_mla_with_kvcache(q, cache, table, lens, 512, mla_cute.get_mla_metadata()[0],
                                                       causal=True)
    assert torch.equal(out, plain) and torch.equal(lse, plain_lse)
    records, splits = invariant_plan(lens, 32, 8, 1)  # a 4-block table row covers 4 tiles: one piece each
    assert torch.equal(meta.tile_scheduler_metadata, records) and torch.equal(meta.num_splits, splits)
    assert meta.config.batch_invariant


def test_a_request_in_another_batch_gives_the_same_bits_on_the_reference():
    q, cache, table, lens = _dense(3, [100, 7, 256])
    one = mla_cute.flash_mla_with_kvcache(q[2:], cache, table[2:], lens[2:], 512, mla_cute.get_mla_metadata()[0],
                                          causal=True, enable_batch_invariant=True)
    three = mla_cute.flash_mla_with_kvcache(q, cache, table, lens, 512, mla_cute.get_mla_metadata()[0], causal=True,
                                            enable_batch_invariant=True)
    assert torch.equal(one[0][0], three[0][2]) and torch.equal(one[1][0], three[1][2])


def test_metadata_keeps_the_flag_of_its_first_call():
    q, cache, table, lens = _dense(2, [100, 7])
    meta = mla_cute.get_mla_metadata()[0]
    mla_cute.flash_mla_with_kvcache(q, cache, table, lens, 512, meta, enable_batch_invariant=True)
    with pytest.raises(ValueError, match="batch_invariant: True -> False"):
        mla_cute.flash_mla_with_kvcache(q, cache, table, lens, 512, meta)


def test_tensor_metadata_is_refused_with_the_flag():
    q, cache, table, lens = _dense(2, [100, 7])
    records, splits = mla_cute.get_mla_decoding_metadata(lens, 2 * 16, 1)
    with pytest.raises(ValueError, match="enable_batch_invariant=True plans each request"):
        mla_cute.flash_mla_with_kvcache(q, cache, table, lens, 512, records, splits, enable_batch_invariant=True)


def test_sparse_reference_plan_over_two_caches():
    """Over two caches a request's tiles are its main tokens' whole tiles and its extra tokens."""
    from mla_cute.kv_formats import quantize_kv_cache

    g = torch.Generator().manual_seed(3)
    b, topk, extra_topk = 2, 128, 512
    q = torch.randn(b, 1, 64, 512, generator=g).bfloat16()
    main = quantize_kv_cache(torch.randn(4, 256, 1, 512, generator=g).bfloat16(), "V4")
    extra = quantize_kv_cache(torch.randn(16, 64, 1, 512, generator=g).bfloat16(), "V4")
    idx = torch.randint(0, 4 * 256, (b, 1, topk), generator=g, dtype=torch.int32)
    extra_idx = torch.randint(0, 16 * 64, (b, 1, extra_topk), generator=g, dtype=torch.int32)
    lengths = torch.tensor([5, 128], dtype=torch.int32)
    extra_lengths = torch.tensor([512, 1], dtype=torch.int32)
    meta = mla_cute.get_mla_metadata()[0]
    out, _ = mla_cute.flash_mla_with_kvcache(q, main, None, None, 512, meta, indices=idx, topk_length=lengths,
                                             extra_k_cache=extra, extra_indices_in_kvcache=extra_idx,
                                             extra_topk_length=extra_lengths, enable_batch_invariant=True)
    # 64 + 512 and 128 + 1 tokens: 9 and 3 tiles, in pieces of 8 tiles at most 2 (10 tiles a request at most).
    records, splits = invariant_plan(torch.tensor([64 + 512, 128 + 1]), 8, 4, 2)
    assert torch.equal(meta.tile_scheduler_metadata, records) and meta.num_splits.tolist() == [0, 2, 3]
    assert torch.isfinite(out.float()).all()


# ------------------------------------------------------------------------------------ the cute host code
@pytest.fixture
def recorder(monkeypatch):
    """``compile_dense`` / ``compile_sparse`` replaced: the configs they were asked for and each run's arguments."""
    import mla_cute.api as api
    import mla_cute.kernels.build as build

    calls = {"compiled": [], "runs": []}

    def compile_kernel(config, options=""):
        calls["compiled"].append(config)
        return lambda *args: calls["runs"].append(args)

    def no_scheduler(*a, **k):
        raise AssertionError("the batch-invariant plan runs no scheduler kernel")

    monkeypatch.setattr(build, "compile_dense", compile_kernel)
    monkeypatch.setattr(build, "compile_sparse", compile_kernel)
    monkeypatch.setattr(build, "compile_scheduler", no_scheduler)
    monkeypatch.setattr(api, "select_backend", lambda device, backend=None: "cute")
    return calls


@pytest.mark.compile
def test_cute_dense_plan_and_workspace(recorder):
    """Every batch runs one step; the records are the invariant plan over the lengths as the kernel serves them
    (within the block table's tiles); the partials hold the pieces bound a request."""
    steps = []
    for b, lens in ((3, [100, 0, 20000]), (1, [20000])):
        q = torch.randn(b, 2, 128, 576).bfloat16()
        cache = torch.randn(8, 64, 1, 576).bfloat16()
        table = torch.zeros(b, 400, dtype=torch.int32)  # 400 tiles a row: 8 pieces at most
        meta = mla_cute.get_mla_metadata()[0]
        seqlens = torch.tensor(lens, dtype=torch.int32)
        mla_cute.flash_mla_with_kvcache(q, cache, table, seqlens, 512, meta, causal=True,
                                        enable_batch_invariant=True)
        steps.append(recorder["compiled"][-1])
        records, splits = invariant_plan(seqlens, 32, 8, 8)
        assert torch.equal(meta.tile_scheduler_metadata, records) and torch.equal(meta.num_splits, splits)
        *_, o_accum, lse_accum, _ = recorder["runs"][-1]
        assert o_accum.shape == (8 * b, 1, 256, 512) and o_accum.dtype == torch.float32
        assert lse_accum.shape == (8 * b, 1, 256)
        # The next call with the same lengths replays the plan: no new compile, same records.
        mla_cute.flash_mla_with_kvcache(q, cache, table, seqlens, 512, meta, causal=True,
                                        enable_batch_invariant=True)
        assert len(recorder["runs"]) == 2 * len(steps) and recorder["runs"][-1][4] is meta.tile_scheduler_metadata
    assert steps[0] == steps[1] and steps[0].combine.chunked_batch == 0
    plain = mla_cute.get_mla_metadata()[0]
    with pytest.raises(AssertionError, match="no scheduler kernel"):  # the plain plan runs the scheduler
        mla_cute.flash_mla_with_kvcache(q, cache, table, seqlens, 512, plain, causal=True)


@pytest.mark.compile
def test_cute_sparse_plan_is_the_same_kernel_for_every_batch(recorder):
    steps = []
    for b in (1, 2, 128):
        q = torch.randn(b, 2, 64, 576).bfloat16()
        cache = torch.zeros(4, 64, 1, 656, dtype=torch.uint8)
        idx = torch.zeros(b, 2, 2048, dtype=torch.int32)
        meta = mla_cute.get_mla_metadata()[0]
        mla_cute.flash_mla_with_kvcache(q, cache, None, None, 512, meta, indices=idx, enable_batch_invariant=True)
        steps.append(recorder["compiled"][-1])
        assert meta.tile_scheduler_metadata.shape == (4 * b, 8) and meta.num_splits[-1] == 4 * b
        o_accum = recorder["runs"][-1][-5]
        assert o_accum.shape == (4 * b, 1, 128, 512) and o_accum.dtype == torch.float32
    assert steps[0] == steps[1] == steps[2] and not steps[0].split.partials_16bit


def test_invariant_schedule_fields_change_the_plan():
    """A schedule's own piece size and count (``use_schedule``) reach the plan."""
    q, cache, table, lens = _dense(1, [256])
    meta = mla_cute.get_mla_metadata()[0]
    sched = dataclasses.replace(DEFAULT_DENSE_SCHEDULE, invariant_piece_blocks=1, invariant_max_pieces=3)
    mla_cute.flash_mla_with_kvcache(q, cache, table, lens, 512, meta, enable_batch_invariant=True, schedule=sched)
    assert meta.num_splits.tolist() == [0, 3] and meta.tile_scheduler_metadata.shape == (3, 8)


@pytest.mark.compile
def test_precompile_builds_the_invariant_steps(recorder):
    """``batch_invariant=True`` in a precompile configuration builds the one step such calls run (and no
    scheduler); a non-bool is refused by name."""
    import mla_cute.api as api

    assert api.precompile([dict(dtype=torch.bfloat16, s_q=2, h_q=128, h_kv=1, causal=True, batch_invariant=True),
                           dict(sparse=True, s_q=2, h_q=64, kv_format="V4", extra_cache=True, attn_sink=True,
                                batch_invariant=True)]) == 2
    dense, sparse = recorder["compiled"]
    assert dense == resolve_dense_invariant(DEFAULT_DENSE_SCHEDULE, dtype="bfloat16", s_q=2, h_q=128, h_kv=1,
                                            causal=True, page=64)
    assert sparse == resolve_sparse_invariant(DEFAULT_SPARSE_SCHEDULE, s_q=2, h_q=64, has_sink=True,
                                              has_topk_length=True, kv_format="V4", extra_cache="V4")
    with pytest.raises(TypeError, match="batch_invariant must be a bool"):
        api.precompile([dict(sparse=True, s_q=1, h_q=64, batch_invariant=1)])
