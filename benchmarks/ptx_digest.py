"""Digests of the PTX of every kernel ``mla_cute.precompile`` builds for the benchmarks' configurations (CPU,
sm_90a): a refactoring that should leave the generated code alone is checked by comparing two runs.

    python benchmarks/ptx_digest.py OUT.json [--ptx-dir DIR] [--jobs N]
    python benchmarks/ptx_digest.py --compare BEFORE.json AFTER.json

Each kernel's PTX is normalized (the mangled kernel names, which hold module and class names, become K0, K1, ...;
the header comments go) and hashed.  ``--compare`` lists the digests of AFTER that BEFORE lacks, by description:
an empty list means every kernel built now is byte-identical to one built before.  Kernels BEFORE built and AFTER
does not (variants removed) are counted, not failed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import re
import sys

DENSE = [(1, 128), (2, 128), (1, 64), (1, 32), (1, 16), (4, 16)]  # bench_decode's (s_q, h_q), h_kv = 1
SPARSE = [(2, 128), (1, 128), (2, 64)]  # bench_sparse's (s_q, h_q)


def configs() -> list[dict]:
    import torch

    out = [dict(dtype=torch.bfloat16, s_q=s_q, h_q=h_q, h_kv=1, causal=s_q > 1) for s_q, h_q in DENSE]
    return out + [dict(sparse=True, s_q=s_q, h_q=h_q) for s_q, h_q in SPARSE]


def normalize(ptx: str) -> str:
    names: dict[str, str] = {}

    def rename(m: re.Match) -> str:
        base, param = m.group(1), m.group(2) or ""
        return names.setdefault(base, f"K{len(names)}") + param

    body = "\n".join(line for line in ptx.splitlines() if not line.startswith("//"))
    return re.sub(r"\b(kernel_cutlass_\w+?)(_param_\d+)?\b(?!\w)", rename, body)


_found: dict = {}


def _record_compiles(ptx_dir: str | None) -> None:
    """Route this process's compiles through a recorder of their normalized PTX digests (once)."""
    import mla_cute.kernels.build as build
    import mla_cute.kernels.signatures as sig

    if getattr(build.cached_compile, "records_ptx", False):
        return
    plain, keep = build.cached_compile, sig.compile_options

    def recording(key, fn, *, describe="", persistent=True):
        compiled = plain(key, fn, describe=describe, persistent=False)
        ptx = normalize(compiled.__ptx__)
        digest = hashlib.sha256(ptx.encode()).hexdigest()[:16]
        _found[describe or repr(key)] = digest
        if ptx_dir:
            with open(os.path.join(ptx_dir, digest + ".ptx"), "w") as f:
                f.write(ptx)
        return compiled

    recording.records_ptx = True
    build.cached_compile = recording
    sig.compile_options = lambda extra="": keep((extra + " --keep-ptx").strip())


def digest_config(index: int, ptx_dir: str | None) -> dict:
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    os.environ["MLA_CUTE_DISK_CACHE"] = "0"
    import mla_cute

    _record_compiles(ptx_dir)
    _found.clear()
    mla_cute.precompile([configs()[index]])
    return dict(_found)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?")
    ap.add_argument("--ptx-dir")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    args = ap.parse_args()
    if args.compare:
        before, after = (json.load(open(p)) for p in args.compare)
        known = set(before.values())
        new = {d: h for d, h in after.items() if h not in known}
        print(json.dumps(new, indent=1))
        print(f"{len(after) - len(new)} of {len(after)} kernels byte-identical to one before; "
              f"{len(set(known) - set(after.values()))} kernels of before not built now")
        return 1 if new else 0
    if args.ptx_dir:
        os.makedirs(args.ptx_dir, exist_ok=True)
    n = len(configs())
    found = {}
    with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
        for part in pool.map(digest_config, range(n), [args.ptx_dir] * n):
            found.update(part)
    with open(args.out, "w") as f:
        json.dump(found, f, indent=1, sort_keys=True)
    print(f"{len(found)} kernels")
    return 0


if __name__ == "__main__":
    sys.exit(main())
