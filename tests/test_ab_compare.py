"""The A/B benchmark's spec reading and summary, on the CPU (the timing itself needs the GPU)."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))


def _spec(tmp_path, rows):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(rows))
    return str(path)


def test_spec_rows_and_variants_resolve(tmp_path):
    import ab_compare

    from mla_cute.schedules import DEFAULT_DENSE_SCHEDULE, DEFAULT_SPARSE_SCHEDULE

    rows = ab_compare.load_spec(_spec(tmp_path, [
        {"kind": "dense", "row": [1, 1, 128, 131072], "variants": ["default", "serial:split_fixed_cost=3"]},
        {"kind": "sparse", "row": [2, 2, 128, 32768, 2048],
         "variants": ["default", "default:num_sm_parts=16,small_plan_tiles=0"]},
    ]))
    (dense_kind, dense_row, dense), (sparse_kind, sparse_row, sparse) = rows
    assert (dense_kind, dense_row, sparse_kind, sparse_row) == ("dense", (1, 1, 128, 131072), "sparse",
                                                                (2, 2, 128, 32768, 2048))
    assert dense["default"].schedule == DEFAULT_DENSE_SCHEDULE and dense["default"].experiment == ""
    assert dense["serial:split_fixed_cost=3"].experiment == "serial"
    assert dense["serial:split_fixed_cost=3"].schedule.split_fixed_cost == 3
    assert sparse["default"] == DEFAULT_SPARSE_SCHEDULE
    assert sparse["default:num_sm_parts=16,small_plan_tiles=0"].small_plan_tiles == 0


@pytest.mark.parametrize("rows,match", [
    ([], "non-empty JSON list"),
    ([{"kind": "prefill", "row": [1, 1, 1, 1], "variants": ["default"]}], "kind must be one of"),
    ([{"kind": "dense", "row": [1, 1, 128], "variants": ["default"]}], "row must be 4 positive ints"),
    ([{"kind": "sparse", "row": [2, 2, 128, 32768], "variants": ["default"]}], "row must be 5 positive ints"),
    ([{"kind": "dense", "row": [1, 1, 128, 0], "variants": ["default"]}], "row must be 4 positive ints"),
    ([{"kind": "dense", "row": [1, 1, 128, 4096], "variants": []}], "variants must be a non-empty list"),
    ([{"kind": "dense", "row": [1, 1, 128, 4096], "variants": ["fastest"]}], "variant 'fastest'"),
    ([{"kind": "dense", "row": [1, 1, 128, 4096], "variants": ["default:no_such_field=1"]}], "no_such_field"),
    ([{"kind": "dense", "row": [1, 1, 128, 4096], "variants": ["default:split_fixed_cost=-1"]}],
     "split_fixed_cost must be an int >= 0"),
])
def test_malformed_spec_is_rejected(tmp_path, rows, match):
    import ab_compare

    with pytest.raises(ValueError, match=match):
        ab_compare.load_spec(_spec(tmp_path, rows))


def _timings(variant, times, row=(1, 1, 128, 4096)):
    return [dict(kind="dense", row=list(row), variant=variant, round=r, us=us) for r, us in enumerate(times)]


def test_summary_reports_median_and_range():
    import ab_compare

    meds = ab_compare.medians(_timings("default", (18.0, 18.4, 17.9)), {"dense": {}})
    assert ab_compare.summary(meds) == ("dense (1, 1, 128, 4096) default: median 18.0 us, range 17.9-18.4 "
                                        "(18.0 18.4 17.9)")


def test_ratio_to_flashmla_of_the_same_run():
    import ab_compare

    results = _timings("default", (18.0, 18.4, 17.9)) + _timings("flashmla", (20.0, 19.0, 21.0))
    default, flash = ab_compare.medians(results, {"dense": {(1, 1, 128, 4096): 99.0}})
    assert (default["ratio"], default["flashmla_us"], default["ratio_from"]) == (20.0 / 18.0, 20.0, "this run")
    assert "ratio" not in flash
    assert ab_compare.summary([default, flash]).splitlines() == [
        "dense (1, 1, 128, 4096) default: median 18.0 us, range 17.9-18.4 (18.0 18.4 17.9), ratio 1.111 (this run)",
        "dense (1, 1, 128, 4096) flashmla: median 20.0 us, range 19.0-21.0 (20.0 19.0 21.0)"]


def test_ratio_without_flashmla_is_remembered_and_marked():
    import ab_compare

    results = _timings("default", (18.0,)) + _timings("default", (30.0,), row=(2, 1, 128, 4096))
    kept, lacking = ab_compare.medians(results, {"dense": {(1, 1, 128, 4096): 27.0}})
    assert (kept["ratio"], kept["ratio_from"]) == (1.5, "remembered, another board")
    assert lacking["ratio_from"] is None
    assert ab_compare.summary([kept, lacking]).splitlines() == [
        ("dense (1, 1, 128, 4096) default: median 18.0 us, range 18.0-18.0 (18.0), ratio 1.500 "
         "(remembered, another board)"),
        "dense (2, 1, 128, 4096) default: median 30.0 us, range 30.0-30.0 (30.0)"]
