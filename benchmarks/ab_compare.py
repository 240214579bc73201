"""A/B comparison of schedule variants in one process (run on the GPU machine), FlashMLA among them.

    python benchmarks/ab_compare.py SPEC.json [--rounds 3] [--out rows.json]

SPEC is a JSON list of rows, each comparing variants on one configuration:

    [{"kind": "dense", "row": [1, 1, 128, 131072], "variants": ["default", "serial"]},
     {"kind": "sparse", "row": [2, 2, 128, 32768, 2048], "variants": ["default", "default:small_plan_tiles=0"]}]

``row`` is ``(b, s_q, h_q, s_k)`` for dense decode and ``(b, s_q, h_q, s_k, topk)`` for sparse decode;
variants are the schedule names of ``bench_decode.py`` / ``bench_sparse.py`` (``base:field=value,...``).
Where ``flash_mla`` imports, FlashMLA's SM90 kernel (``use_legacy=True``) is one more variant of every row,
named "flashmla", and each variant's ``ratio`` is FlashMLA's median / its median; where it does not, the ratio
is against the anchor files' time of the row (where they have the row), marked "remembered, another board".
Machines differ by several percent, so builds and variants are compared within one run: each round
draws the row's inputs once and times every variant on them, the order rotated from round to round;
each time is the benchmarks' own (0.5 s of GPU work, then the median of do_bench over the whole call).
In the first round each variant's output is checked against the torch reference (where the reference
is affordable) and for NaN.  ``--out``: ``timings`` (every timing) and ``medians`` (a variant of a row each,
with the ratio).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

import bench_decode  # noqa: E402  (the benchmarks' own calls, checks and timing)
import bench_sparse  # noqa: E402
from flashmla_side import FLASHMLA, describe, flash_mla, median, rel_err, remembered, rotated, set_ratio  # noqa: E402

MODULES = {"dense": bench_decode, "sparse": bench_sparse}


def load_spec(path: str) -> list:
    """The spec's rows with their schedules resolved (raises ValueError on a malformed row or variant)."""
    spec = json.load(open(path))
    if not isinstance(spec, list) or not spec:
        raise ValueError(f"{path}: expected a non-empty JSON list of rows")
    rows = []
    for i, item in enumerate(spec):
        kind = item.get("kind") if isinstance(item, dict) else None
        if kind not in MODULES:
            raise ValueError(f"{path} row {i}: kind must be one of {sorted(MODULES)}, got {kind!r}")
        row, variants, size = item.get("row"), item.get("variants"), len(MODULES[kind].KEYS)
        if not (isinstance(row, list) and len(row) == size and all(type(x) is int and x > 0 for x in row)):
            raise ValueError(f"{path} row {i}: row must be {size} positive ints, got {row!r}")
        if not (isinstance(variants, list) and variants and all(isinstance(v, str) for v in variants)):
            raise ValueError(f"{path} row {i}: variants must be a non-empty list of schedule names")
        named = MODULES[kind].schedule_named
        schedules = {}
        for name in variants:
            try:
                schedules[name] = named(name)
                getattr(schedules[name], "schedule", schedules[name]).validate()  # a dense Variant's, or the schedule
            except (KeyError, TypeError, ValueError, SyntaxError) as e:
                raise ValueError(f"{path} row {i}: variant {name!r}: {e}") from e
        rows.append((kind, tuple(row), schedules))
    return rows


def run(rows: list, rounds: int, fm=None) -> list:
    """Every timing of ``rounds`` rounds over ``rows`` (from ``load_spec``), FlashMLA (``fm``, or None) a variant."""
    results = []
    for r in range(rounds):
        for kind, row, schedules in rows:
            bench = MODULES[kind]
            torch.manual_seed(1000 * r + sum(row))
            inputs = bench.make_inputs(*row)
            ref = bench.reference(row, inputs) if r == 0 else None
            names = list(schedules) + ([FLASHMLA] if fm is not None else [])
            for name in rotated(names, r):
                fn = bench.flash_call(fm, row, inputs) if name == FLASHMLA else bench.call(row, inputs, schedules[name])
                out = fn()[0]
                err = rel_err(out, ref)
                bench.warm_gpu()
                us = bench.bench(fn, **bench.REPS) * 1e3
                rec = dict(kind=kind, row=list(row), variant=name, round=r, us=us, rel_err=err,
                           nan=bool(torch.isnan(out).any()))
                results.append(rec)
                print(json.dumps(rec), flush=True)
            del inputs, ref
            torch.cuda.empty_cache()
    return results


def medians(results: list, anchors: dict) -> list:
    """A record per variant of a row: its median time, its times, and (but FlashMLA's) the ratio to FlashMLA's
    median of the same row, or where FlashMLA was not timed to ``anchors[kind]`` (remembered times by row)."""
    by = {}
    for x in results:
        by.setdefault((x["kind"], tuple(x["row"]), x["variant"]), []).append(x["us"])
    meds = []
    for (kind, row, name), ts in by.items():
        rec = dict(kind=kind, row=list(row), variant=name, us=median(ts), rounds=ts)
        if name != FLASHMLA:
            flash = by.get((kind, row, FLASHMLA))
            set_ratio(rec, median(flash) if flash else None, anchors[kind].get(row))
        meds.append(rec)
    return meds


def summary(meds: list) -> str:
    lines = []
    for m in meds:
        ts = m["rounds"]
        text = (f"{m['kind']} {tuple(m['row'])} {m['variant']}: median {m['us']:.1f} us, "
                f"range {min(ts):.1f}-{max(ts):.1f} ({' '.join(f'{t:.1f}' for t in ts)})")
        if m.get("ratio_from"):
            text += f", ratio {m['ratio']:.3f} ({m['ratio_from']})"
        lines.append(text)
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("spec")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="write every timing and the medians as JSON here")
    args = ap.parse_args()
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    rows = load_spec(args.spec)
    fm = flash_mla()
    print(describe(fm), flush=True)
    results = run(rows, args.rounds, fm)
    meds = medians(results, {kind: remembered(m.ANCHOR, m.KEYS) for kind, m in MODULES.items()})
    print(summary(meds))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(timings=results, medians=meds), f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
