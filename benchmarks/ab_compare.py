"""A/B comparison of schedule variants in one process (run on the GPU machine).

    python benchmarks/ab_compare.py SPEC.json [--rounds 3] [--out rows.json]

SPEC is a JSON list of rows, each comparing variants on one configuration:

    [{"kind": "dense", "row": [1, 1, 128, 131072], "variants": ["default", "default:partials_16bit=False"]},
     {"kind": "sparse", "row": [2, 2, 128, 32768, 2048], "variants": ["default", "default:small_plan_tiles=0"]}]

``row`` is ``(b, s_q, h_q, s_k)`` for dense decode and ``(b, s_q, h_q, s_k, topk)`` for sparse decode;
variants are the schedule names of ``bench_decode.py`` / ``bench_sparse.py`` (``base:field=value,...``).
Machines differ by several percent, so builds and variants are compared within one run: each round
draws the row's inputs once and times every variant on them, the order rotated from round to round;
each time is the benchmarks' own (0.5 s of GPU work, then the median of do_bench over the whole call).
In the first round each variant's output is checked against the torch reference (where the reference
is affordable) and for NaN.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

import mla_cute

sys.path.insert(0, os.path.dirname(__file__))

import bench_decode  # noqa: E402  (the benchmarks' own calls, checks and timing)
import bench_sparse  # noqa: E402

KINDS = {"dense": 4, "sparse": 5}


def load_spec(path: str) -> list:
    """The spec's rows with their schedules resolved (raises ValueError on a malformed row or variant)."""
    spec = json.load(open(path))
    if not isinstance(spec, list) or not spec:
        raise ValueError(f"{path}: expected a non-empty JSON list of rows")
    rows = []
    for i, item in enumerate(spec):
        kind = item.get("kind") if isinstance(item, dict) else None
        if kind not in KINDS:
            raise ValueError(f"{path} row {i}: kind must be one of {sorted(KINDS)}, got {kind!r}")
        row, variants = item.get("row"), item.get("variants")
        if not (isinstance(row, list) and len(row) == KINDS[kind] and all(type(x) is int and x > 0 for x in row)):
            raise ValueError(f"{path} row {i}: row must be {KINDS[kind]} positive ints, got {row!r}")
        if not (isinstance(variants, list) and variants and all(isinstance(v, str) for v in variants)):
            raise ValueError(f"{path} row {i}: variants must be a non-empty list of schedule names")
        named = bench_decode.schedule_named if kind == "dense" else bench_sparse.schedule_named
        schedules = {}
        for name in variants:
            try:
                schedules[name] = named(name)
                schedules[name].validate()
            except (KeyError, TypeError, ValueError, SyntaxError) as e:
                raise ValueError(f"{path} row {i}: variant {name!r}: {e}") from e
        rows.append((kind, tuple(row), schedules))
    return rows


def make_call(kind: str, row: tuple, schedule, inputs):
    """The whole decode call on ``inputs`` under ``schedule``, with fresh metadata (its plan is made at the first call)."""
    meta, _ = mla_cute.get_mla_metadata()
    if kind == "dense":
        return bench_decode.decode_call(inputs, row[1], schedule, meta)
    return bench_sparse.sparse_call(inputs, schedule, meta)


def check(kind: str, row: tuple, inputs, out) -> float:
    """Relative error (Frobenius) against the torch reference, or NaN where the reference is too costly."""
    if kind == "dense":
        return bench_decode.rel_err(*row, *inputs, out)
    return bench_sparse.rel_err(*row[:2], *inputs, out)


def run(rows: list, rounds: int) -> list:
    results = []
    for r in range(rounds):
        for kind, row, schedules in rows:
            torch.manual_seed(1000 * r + sum(row))
            inputs = bench_decode.make_inputs(*row) if kind == "dense" else bench_sparse.make_inputs(*row)
            names = list(schedules)
            for name in names[r % len(names):] + names[:r % len(names)]:
                fn = make_call(kind, row, schedules[name], inputs)
                out = fn()[0]
                torch.cuda.synchronize()
                err = check(kind, row, inputs, out) if r == 0 else float("nan")
                bench_decode.warm_gpu()
                us = bench_decode.bench(fn, **(bench_decode if kind == "dense" else bench_sparse).REPS) * 1e3
                rec = dict(kind=kind, row=list(row), variant=name, round=r, us=us, rel_err=err,
                           nan=bool(torch.isnan(out).any()))
                results.append(rec)
                print(json.dumps(rec), flush=True)
            del inputs
            torch.cuda.empty_cache()
    return results


def summary(results: list) -> str:
    by = {}
    for x in results:
        by.setdefault((x["kind"], tuple(x["row"]), x["variant"]), []).append(x["us"])
    return "\n".join(f"{kind} {row} {name}: median {statistics.median(ts):.1f} us, "
                     f"range {min(ts):.1f}-{max(ts):.1f} ({' '.join(f'{t:.1f}' for t in ts)})"
                     for (kind, row, name), ts in by.items())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("spec")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="write every timing as JSON here")
    args = ap.parse_args()
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    rows = load_spec(args.spec)
    results = run(rows, args.rounds)
    print(summary(results))
    if args.out:
        json.dump(results, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    sys.exit(main())
