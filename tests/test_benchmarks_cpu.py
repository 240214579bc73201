"""The benchmarks' row selection, FlashMLA timing rounds, ratios and their fallback marking, on the CPU: the kinds'
calls and the timing function are fakes (tensors on the CPU, scripted times)."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import ab_compare  # noqa: E402
import bench_decode  # noqa: E402
import bench_sparse  # noqa: E402
import flashmla_side as side  # noqa: E402
import side_by_side  # noqa: E402

ROW = (4, 1, 8, 256)


class Call:
    """A decode call: out = the inputs times ``scale``."""

    def __init__(self, name, inputs, scale):
        self.name, self.inputs, self.scale = name, inputs, scale

    def __call__(self):
        return self.inputs * self.scale, None


class FakeKind:
    """A kind (as ``flashmla_side`` describes it) on CPU tensors; ``times_ms``: name -> the times ``bench`` returns,
    in order; a schedule is the scale of its out (the reference's is 1, FlashMLA's ``flash_scale``)."""

    NAME, KEYS, CONFIGS, QUICK, ANCHOR = "dense", ("b", "s_q", "h_q", "s_k"), [ROW], [ROW], "no such file"
    REPS = dict(warmup=3, rep=7)

    def __init__(self, times_ms, flash_scale=1.0):
        self.times_ms = {name: list(ts) for name, ts in times_ms.items()}
        self.flash_scale, self.order, self.warmed = flash_scale, [], 0

    def make_inputs(self, *row):
        return torch.ones(row[0], row[2])

    def call(self, row, inputs, schedule):
        return Call(f"scale {schedule}", inputs, schedule)

    def flash_call(self, fm, row, inputs):
        assert fm == "flash_mla", "FlashMLA called without flash_mla"
        return Call(side.FLASHMLA, inputs, self.flash_scale)

    def reference(self, row, inputs):
        return inputs

    def work(self, b, s_q, h_q, s_k):
        return 2e9, 3e6

    def schedule_named(self, name):
        return {"a": 1.1, "b": 1.2}[name]

    def warm_gpu(self):
        self.warmed += 1

    def bench(self, fn, warmup, rep):
        assert (warmup, rep) == (3, 7)
        name = side.FLASHMLA if fn.name == side.FLASHMLA else {"scale 1.1": "a", "scale 1.2": "b"}[fn.name]
        self.order.append(name)
        return self.times_ms[name].pop(0)


def test_flashmla_is_timed_in_the_same_rotated_rounds():
    kind = FakeKind({"a": [0.10, 0.12, 0.11], "b": [0.40, 0.50, 0.30], side.FLASHMLA: [0.20, 0.21, 0.19]},
                    flash_scale=1.05)
    a, b = side.run_row(kind, ROW, {"a": 1.1, "b": 1.2}, 3, "flash_mla", {ROW: 999.0})
    assert kind.order == ["a", "b", "flashmla", "b", "flashmla", "a", "flashmla", "a", "b"]
    assert kind.warmed == 1
    assert a["us_rounds"] == pytest.approx([100, 120, 110]) and a["us"] == pytest.approx(110)
    assert a["flashmla_us"] == pytest.approx(200) and b["us"] == pytest.approx(400)
    assert a["ratio"] == pytest.approx(200 / 110) and b["ratio"] == pytest.approx(0.5)
    assert a["ratio_from"] == b["ratio_from"] == "this run"
    assert a["rel_err"] == pytest.approx(0.1) and b["rel_err"] == pytest.approx(0.2)
    assert a["rel_err_vs_flashmla"] == pytest.approx(0.05 / 1.05, rel=1e-5)
    assert (a["schedule"], a["kind"], a["b"], a["s_k"]) == ("a", "dense", 4, 256)
    assert a["tflops"] == pytest.approx(2e9 / 110 / 1e6) and a["gbps"] == pytest.approx(3e6 / 110 / 1e3)
    assert side.line(a, FakeKind.KEYS).endswith("| 200.0 | 1.818 | this run |")


def test_without_flash_mla_the_ratio_is_remembered_and_marked():
    kind = FakeKind({"a": [0.10, 0.11], "b": [0.30, 0.20]})
    a, b = side.run_row(kind, ROW, {"a": 1.1, "b": 1.2}, 2, None, {ROW: 220.0})
    assert kind.order == ["a", "b", "b", "a"]
    assert a["flashmla_us"] == 220.0 and a["ratio"] == pytest.approx(220 / 105) and b["ratio"] == pytest.approx(0.88)
    assert a["ratio_from"] == b["ratio_from"] == "remembered, another board"
    assert math.isnan(a["rel_err_vs_flashmla"]) and a["rel_err"] == pytest.approx(0.1)
    assert side.line(b, FakeKind.KEYS).endswith("| 220.0 | 0.880 | remembered, another board |")


def test_a_row_the_anchor_lacks_has_no_ratio():
    (a,) = side.run_row(FakeKind({"a": [0.1]}), ROW, {"a": 1.1}, 1, None, {(1, 1, 1, 1): 50.0})
    assert a["flashmla_us"] is None and a["ratio_from"] is None and math.isnan(a["ratio"])
    assert side.line(a, FakeKind.KEYS).endswith("| - | nan | - |")


def test_zero_rounds_check_only():
    kind = FakeKind({})
    (a,) = side.run_row(kind, ROW, {"a": 1.1}, 0, "flash_mla", {})
    assert kind.order == [] and kind.warmed == 0 and math.isnan(a["us"])
    assert a["rel_err_vs_flashmla"] == pytest.approx(0.1)


def test_nan_in_an_output_stops_the_row():
    with pytest.raises(ValueError, match="flashmla: NaN in the output"):
        side.run_row(FakeKind({}, flash_scale=math.nan), ROW, {"a": 1.1}, 1, "flash_mla", {})


def test_set_ratio_prefers_this_run():
    assert side.set_ratio(dict(us=100.0), 200.0, 150.0) == dict(us=100.0, flashmla_us=200.0, ratio=2.0,
                                                                ratio_from="this run")
    assert side.set_ratio(dict(us=100.0), None, 150.0)["ratio"] == 1.5
    assert side.set_ratio(dict(us=100.0), None, 150.0)["ratio_from"] == "remembered, another board"


def test_flash_mla_that_does_not_import_is_none(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_mla", None)  # makes `import flash_mla` raise ImportError
    assert side.flash_mla() is None
    assert "remembered, another board" in side.describe(None)


def test_main_prints_marked_rows(monkeypatch, capsys):
    monkeypatch.setattr(side, "flash_mla", lambda: None)
    kind = FakeKind({"a": [0.1], "b": [0.4]})
    args = side.parser("").parse_args(["--schedules", "b,a", "--rounds", "1"])
    recs = side.main([kind], args)
    assert [r["schedule"] for r in recs] == ["b", "a"] and all(r["ratio_from"] is None for r in recs)
    out = capsys.readouterr().out
    assert "does not import" in out and "| ratio from |" in out and out.count("| 4 | 1 | 8 | 256 |") == 2


@pytest.mark.parametrize("bench,quick", [
    (bench_decode, [(128, 1, 128, 4096), (128, 1, 64, 8192), (1, 1, 128, 131072)]),
    (bench_sparse, [(2, 2, 128, 32768, 2048), (128, 2, 128, 32768, 2048), (128, 2, 64, 32768, 2048)]),
])
def test_row_selection(bench, quick):
    def pick(*argv):
        return side.pick_rows(bench.CONFIGS, bench.QUICK, side.parser("").parse_args(list(argv)))

    assert pick("--quick") == quick
    assert pick("--rows", "3,0") == [bench.CONFIGS[3], bench.CONFIGS[0]]
    assert pick("--rows", "1", "--quick") == [bench.CONFIGS[1]]
    assert pick() == bench.CONFIGS and len(bench.CONFIGS) > 3


@pytest.mark.parametrize("bench", [bench_decode, bench_sparse])
def test_every_row_has_a_remembered_time(bench):
    anchor = side.remembered(bench.ANCHOR, bench.KEYS)
    assert sorted(anchor) == sorted(bench.CONFIGS)
    assert side.remembered("no such file", bench.KEYS) == {}


def test_remembered_times_are_the_anchor_files():
    assert side.remembered(bench_decode.ANCHOR, bench_decode.KEYS)[(128, 1, 128, 4096)] == pytest.approx(247.36, 1e-4)
    assert side.remembered(bench_sparse.ANCHOR, bench_sparse.KEYS)[(2, 2, 128, 32768, 2048)] == pytest.approx(22.016)


def test_side_by_side_kinds_and_options():
    assert side_by_side.KINDS["all"] == [bench_decode, bench_sparse] and side_by_side.KINDS["sparse"] == [bench_sparse]
    args = side.parser("", rounds=5).parse_args([])
    assert (args.rounds, args.schedules, args.rows, args.anchor) == (5, "default", None, None)


def test_schedule_list():
    assert side.schedule_list("default,serial") == ["default", "serial"]
    assert side.schedule_list("seesaw;seesaw:kv_evict_first=False,num_sm_parts=64") == [
        "seesaw", "seesaw:kv_evict_first=False,num_sm_parts=64"]


@pytest.mark.parametrize("fm,names", [("flash_mla", ["a", "b", "flashmla"]), (None, ["a", "b"])])
def test_ab_compare_times_flashmla_as_one_more_variant(monkeypatch, fm, names):
    kind = FakeKind({n: [0.1] * 3 for n in names})
    monkeypatch.setattr(ab_compare, "MODULES", {"dense": kind})
    results = ab_compare.run([("dense", ROW, {"a": 1.1, "b": 1.2})], 3, fm)
    assert kind.order == names + names[1:] + names[:1] + names[2:] + names[:2]
    assert [x["variant"] for x in results] == kind.order and kind.warmed == 3 * len(names)
    errs = {x["variant"]: x["rel_err"] for x in results if x["round"] == 0}
    assert errs["a"] == pytest.approx(0.1) and errs["b"] == pytest.approx(0.2)
    assert all(math.isnan(x["rel_err"]) for x in results if x["round"] > 0)

