"""Benchmark rows timed beside FlashMLA: what bench_decode.py, bench_sparse.py, side_by_side.py and ab_compare.py share.

Where ``flash_mla`` (FlashMLA's SM90 kernels, every call ``use_legacy=True``) imports, FlashMLA runs on the same
inputs in the same process: each round times it and every mla-cute schedule once, the order rotated from round to
round; a row reports each one's median over the rounds, ``ratio`` = FlashMLA's median / ours (above 1: mla-cute
faster) and ``ratio_from`` = "this run".  Where it does not import, FlashMLA's time is the remembered one of the
anchor files (benchmarks/results/anchor_flashmla_*.json, timed on another board) and ``ratio_from`` says
"remembered, another board".

A kind is the module bench_decode or bench_sparse, which holds: NAME, KEYS (a row's fields), CONFIGS, QUICK, ANCHOR,
REPS, make_inputs(*row), call(row, inputs, schedule) and flash_call(flash_mla, row, inputs) (the whole decode call),
reference(row, inputs) (the torch reference's out, or None where it costs too much), work(*row) (FLOPs, bytes),
schedule_named(name), bench(fn, warmup, rep) (ms) and warm_gpu().
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics

import torch

FLASHMLA = "flashmla"
THIS_RUN = "this run"
REMEMBERED = "remembered, another board"


def flash_mla():
    """FlashMLA's package, or None where it does not import."""
    try:
        import flash_mla
    except ImportError:
        return None
    return flash_mla


def describe(fm) -> str:
    """Where the ratios come from, for the output's first line."""
    if fm is not None:
        return "FlashMLA: flash_mla imports, timed in the same rounds"
    return f"FlashMLA: flash_mla does not import; ratios against the anchor files ({REMEMBERED})"


def remembered(path: str, keys: tuple) -> dict:
    """FlashMLA's remembered times (us) by row, from an anchor file ({} where there is none)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {tuple(r[k] for k in keys): r["us"] for r in json.load(f)}


def rotated(names: list, r: int) -> list:
    """``names`` in round ``r``'s order: each round starts one further along."""
    k = r % len(names)
    return names[k:] + names[:k]


def interleaved(fns: dict, rounds: int, time_us) -> dict:
    """name -> its ``time_us(fn)`` in each of ``rounds`` rounds; a round times every call once, in rotated order."""
    times = {name: [] for name in fns}
    for r in range(rounds):
        for name in rotated(list(fns), r):
            times[name].append(time_us(fns[name]))
    return times


def median(times: list) -> float:
    return statistics.median(times) if times else math.nan


def set_ratio(rec: dict, flash_us, remembered_us) -> dict:
    """Sets ``rec``'s ``flashmla_us``, ``ratio`` (FlashMLA's time / ``rec["us"]``) and ``ratio_from``: from FlashMLA's
    time of this run where there is one, else from the remembered one, else none (ratio NaN)."""
    if flash_us is not None:
        us, source = flash_us, THIS_RUN
    elif remembered_us is not None:
        us, source = remembered_us, REMEMBERED
    else:
        us, source = None, None
    rec.update(flashmla_us=us, ratio=us / rec["us"] if us is not None else math.nan, ratio_from=source)
    return rec


def rel_err(out: torch.Tensor, ref) -> float:
    """Relative error (Frobenius) of ``out`` against ``ref``; NaN without ``ref``."""
    if ref is None:
        return math.nan
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def run_row(kind, row: tuple, schedules: dict, rounds: int, fm, anchor: dict) -> list:
    """One record per schedule of ``schedules`` (name -> schedule) on one draw of ``row``'s inputs, FlashMLA (``fm``,
    or None) timed in the same rounds.  The first calls are checked for NaN and against the torch reference and
    FlashMLA's out; ``rounds`` = 0 checks only (times NaN).  ``anchor``: the remembered times, used without ``fm``."""
    torch.manual_seed(row[0] * 7 + row[1] * 3 + row[2] + row[-1])
    inputs = kind.make_inputs(*row)
    fns = {name: kind.call(row, inputs, schedule) for name, schedule in schedules.items()}
    if fm is not None:
        fns[FLASHMLA] = kind.flash_call(fm, row, inputs)
    outs = {name: fn()[0] for name, fn in fns.items()}
    for name, out in outs.items():
        if torch.isnan(out).any():
            raise ValueError(f"{kind.NAME} {row} {name}: NaN in the output")
    ref = kind.reference(row, inputs)
    errs = {name: (rel_err(outs[name], ref), rel_err(outs[name], outs.get(FLASHMLA))) for name in schedules}
    del outs, ref
    if rounds:
        kind.warm_gpu()
    times = interleaved(fns, rounds, lambda fn: kind.bench(fn, **kind.REPS) * 1e3)
    flash_us = median(times[FLASHMLA]) if fm is not None else None
    flops, nbytes = kind.work(*row)
    recs = []
    for name in schedules:
        us = median(times[name])
        rec = dict(kind=kind.NAME, **dict(zip(kind.KEYS, row)), schedule=name, us=us, us_rounds=times[name],
                   tflops=flops / us / 1e6, gbps=nbytes / us / 1e3, rel_err=errs[name][0],
                   rel_err_vs_flashmla=errs[name][1])
        recs.append(set_ratio(rec, flash_us, anchor.get(tuple(row))))
    return recs


COLUMNS = ("us", "TFLOP/s", "GB/s", "rel_err", "vs FlashMLA", "FlashMLA us", "ratio", "ratio from")


def header(keys: tuple) -> str:
    head = ["schedule", *keys, *COLUMNS]
    return "| " + " | ".join(head) + " |\n|" + "---|" * len(head)


def line(rec: dict, keys: tuple) -> str:
    """``rec`` as a row of ``header``'s table (the last column says where FlashMLA's time comes from)."""
    flash = f"{rec['flashmla_us']:.1f}" if rec["flashmla_us"] is not None else "-"
    cells = [rec["schedule"], *(str(rec[k]) for k in keys), f"{rec['us']:.1f}", f"{rec['tflops']:.0f}",
             f"{rec['gbps']:.0f}", f"{rec['rel_err']:.2e}", f"{rec['rel_err_vs_flashmla']:.2e}", flash,
             f"{rec['ratio']:.3f}", rec["ratio_from"] or "-"]
    return "| " + " | ".join(cells) + " |"


def schedule_list(text: str) -> list:
    """The names of ``--schedules``: ',' between names, ';' once a name changes fields (which use ',')."""
    return text.split(";" if ";" in text or ":" in text else ",")


def pick_rows(configs: list, quick: list, args) -> list:
    """The rows ``--rows`` (numbers into ``configs``) or ``--quick`` select; all by default."""
    if args.rows:
        return [configs[int(i)] for i in args.rows.split(",")]
    return quick if args.quick else configs


def parser(schedules_help: str, rounds: int = 3) -> argparse.ArgumentParser:
    """The options bench_decode.py, bench_sparse.py and side_by_side.py share."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--anchor", default=None, help="FlashMLA's remembered times, used where flash_mla does not "
                    "import (default: benchmarks/results/anchor_flashmla_<kind>_h200.json)")
    ap.add_argument("--quick", action="store_true", help="three rows only")
    ap.add_argument("--rows", default=None, help="comma list of row numbers of CONFIGS (0-based)")
    ap.add_argument("--schedules", default="default", help=schedules_help)
    ap.add_argument("--rounds", type=int, default=rounds,
                    help="rounds, each timing FlashMLA and every schedule once (0: compile and check only)")
    return ap


def main(kinds: list, args) -> list:
    """Times the rows ``args`` select of each kind, prints a table a kind, writes ``--out``; returns the records."""
    fm = flash_mla()
    print(describe(fm), flush=True)
    recs = []
    for kind in kinds:
        schedules = {name: kind.schedule_named(name) for name in schedule_list(args.schedules)}
        anchor = remembered(args.anchor or kind.ANCHOR, kind.KEYS)
        print(f"\n{kind.NAME}\n{header(kind.KEYS)}", flush=True)
        for row in pick_rows(kind.CONFIGS, kind.QUICK, args):
            for rec in run_row(kind, tuple(row), schedules, args.rounds, fm, anchor):
                print(line(rec, kind.KEYS), flush=True)
                recs.append(rec)
            torch.cuda.empty_cache()
    if args.out:
        reps = ", ".join(f"{k.NAME} warmup={k.REPS['warmup']} rep={k.REPS['rep']}" for k in kinds)
        method = (f"0.5 s of GPU work right before each row, then {args.rounds} rounds, each timing FlashMLA and every "
                  f"schedule once (order rotated) by the median of triton.testing.do_bench ({reps}), whole call; "
                  "us = the median over the rounds")
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, python=platform.python_version(),
                    method=method, flashmla=THIS_RUN if fm is not None else REMEMBERED)
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=recs), f, indent=1)
    return recs
