"""Run the GPU tests in parallel processes on one GPU (kernels compile on the CPU, one per process).

    python tests/shards.py N LOGDIR [--stop-after SECONDS] [--skip-passed OLDLOGDIR] [pytest arguments, e.g. -m gpu tests/]

Collects the test ids, groups those that build the same kernels (the dense grid's cases by s_q, h_q, h_kv
and causal, the prefill grids' by d_qk (the FP8 cache's: 576), h_q and options, the format grid's by format, s_q and h_q, the extra-cache tests' case by case; any other test by its function), deals the groups
to N processes, largest first, runs them at once and prints each process's summary; exits non-zero when any process fails.  Logs go to LOGDIR.
``--skip-passed``: leave out the tests an earlier run's logs (OLDLOGDIR) report as passed.  ``--stop-after``:
interrupt the processes still running after SECONDS (as Ctrl-C would), so each still writes pytest's summary, with
the failures' reasons, before a time limit kills them.
"""

from __future__ import annotations

import collections
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

# What groups a parametrized test's cases (those that build the same kernels): its id's pattern, and the group
# named from the pattern's fields.
GROUPS = [
    (re.compile(r"test_dense_grid\[(\d+)-(\d+)-(\d+)-(\d+)-(\d+)-(\w+)-(\w+)\]"),
     lambda _b, s_q, _s_k, h_q, h_kv, _dtype, causal: f"grid s_q={s_q} h_q={h_q} h_kv={h_kv} causal={causal}"),
    (re.compile(r"test_prefill_grid\[(\d+)-(\d+)-\d+-\d+-\d+-([\w+]+)\]"),
     lambda d_qk, h_q, options: f"prefill grid d_qk={d_qk} h_q={h_q} {options}"),
    (re.compile(r"test_prefill_fp8_grid\[(\d+)-\d+-\d+-\d+-([\w+]+)\]"),
     lambda h_q, options: f"fp8 prefill grid h_q={h_q} {options}"),
    (re.compile(r"test_format_grid\[(\w+)-\d+-(\d+)-(\d+)-"),
     lambda fmt, s_q, h_q: f"format grid {fmt} s_q={s_q} h_q={h_q}"),
    (re.compile(r"(test_extra_(?:fp4_)?cache_\w+\[[^\]]+\])"), lambda case: case),  # case by case
]


def group_of(test_id: str) -> str:
    for pattern, name in GROUPS:
        m = pattern.search(test_id)
        if m:
            return name(*m.groups())
    return test_id.split("[")[0]


def main() -> int:
    n, logdir, pytest_args = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    passed = set()
    stop_after = None
    if pytest_args[:1] == ["--stop-after"]:
        stop_after, pytest_args = float(pytest_args[1]), pytest_args[2:]
    if pytest_args[:1] == ["--skip-passed"]:
        for log in Path(pytest_args[1]).glob("shard*.log"):
            passed |= {line.split(" PASSED")[0] for line in log.read_text().splitlines() if " PASSED" in line}
        pytest_args = pytest_args[2:]
    logdir.mkdir(parents=True, exist_ok=True)
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *pytest_args],
                            capture_output=True, text=True)
    ids = [line for line in listed.stdout.splitlines() if "::" in line and line not in passed]
    if not ids and not passed:
        print(listed.stdout[-3000:], listed.stderr[-3000:])
        return 1
    groups = collections.defaultdict(list)
    for test_id in ids:
        groups[group_of(test_id)].append(test_id)
    shards = [[] for _ in range(n)]
    for members in sorted(groups.values(), key=len, reverse=True):
        min(shards, key=len).extend(members)
    procs = []
    for i, shard in enumerate(s for s in shards if s):
        (logdir / f"shard{i}.ids").write_text("\n".join(shard))
        log = open(logdir / f"shard{i}.log", "w")
        cmd = [sys.executable, "-m", "pytest", "-v", "-rfE", "-p", "no:cacheprovider", *shard]
        procs.append((i, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
    failed = 0
    deadline = None if stop_after is None else time.monotonic() + stop_after
    for i, proc, log in procs:
        try:
            proc.wait(None if deadline is None else max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            for _, other, _ in procs:
                if other.poll() is None:
                    other.send_signal(signal.SIGINT)
            proc.wait()
        log.close()
        tail = (logdir / f"shard{i}.log").read_text().strip().splitlines()[-1:]
        print(f"shard {i}: exit {proc.returncode}: {tail[0] if tail else ''}", flush=True)
        failed += proc.returncode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
