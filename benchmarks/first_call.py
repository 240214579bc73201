"""First calls in fresh processes: how long a new user waits, cold (empty disk cache) and warm.

Each row is one fresh python process: import torch, import mla_cute, build the inputs, time the first call
(synchronized), then a second one; it reports whether the DSL got imported.  ``cold`` runs with an empty disk
cache (a new temporary directory), ``warm`` with the one the cold run of the same mode wrote.

    python benchmarks/first_call.py [--modes dense1,sparse] [--out results.json]

Modes: dense1 = dense b 64, s_k 4096, s_q 1, h_q 128 (bf16, page 64); dense2 = the same with s_q 2, h_q 64,
causal; sparse = sparse V3.2 FP8 b 64, s_k 8192, s_q 1, h_q 128, topk 2048.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

DENSE = {"dense1": (1, 128), "dense2": (2, 64)}  # (s_q, h_q) of b 64, s_k 4096; causal when s_q > 1
MODES = {
    **{mode: f"dense b 64, s_k 4096, s_q {s_q}, h_q {h_q}" + (", causal" if s_q > 1 else "")
       for mode, (s_q, h_q) in DENSE.items()},
    "sparse": "sparse V32 b 64, s_k 8192, s_q 1, h_q 128, topk 2048",
}


def _child(mode: str) -> dict:
    t0 = time.perf_counter()
    import torch

    t1 = time.perf_counter()
    import mla_cute

    t2 = time.perf_counter()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if mode in DENSE:
        from bench_decode import make_inputs

        s_q, h_q = DENSE[mode]
        q, k_cache, block_table, seqlens = make_inputs(64, s_q, h_q, 4096)
        meta = mla_cute.get_mla_metadata()[0]

        def step():
            return mla_cute.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, meta, causal=s_q > 1,
                                                   backend="cute")
    else:
        from bench_sparse import make_inputs

        q, k_cache, indices = make_inputs(64, 1, 128, 8192, 2048)
        meta = mla_cute.get_mla_metadata()[0]

        def step():
            return mla_cute.flash_mla_with_kvcache(q, k_cache, None, None, 512, meta, is_fp8_kvcache=True,
                                                   indices=indices, backend="cute")

    torch.cuda.synchronize()
    t3 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    t4 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    t5 = time.perf_counter()
    return {"mode": mode, "first_call_s": round(t4 - t3, 3), "second_call_s": round(t5 - t4, 4),
            "import_torch_s": round(t1 - t0, 3), "import_mla_cute_s": round(t2 - t1, 3),
            "dsl_imported": "cutlass" in sys.modules}


def _run(mode: str, cache: str) -> dict:
    env = dict(os.environ, MLA_CUTE_CACHE_DIR=cache)
    done = subprocess.run([sys.executable, __file__, "--child", mode], env=env, check=True,
                          capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--out")
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child)))
        return
    rows = []
    for mode in args.modes.split(","):
        if mode not in MODES:
            raise SystemExit(f"--modes: unknown mode {mode!r}; known: {', '.join(MODES)}")
        with tempfile.TemporaryDirectory() as cache:
            for kind in ("cold", "warm", "warm"):
                row = dict(_run(mode, cache), cache=kind)
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.out:
        meta = {"method": __doc__.split("\n\n")[1].replace("\n", " "), "modes": MODES,
                "cpu_cores": os.cpu_count()}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
