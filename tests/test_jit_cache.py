"""The on-disk compile cache with a real kernel: a second process loads the exported kernel instead of
compiling, and a damaged entry is rebuilt rather than loaded.  (Integrity details: test_disk_cache.py.)"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from mla_cute import jit

pytestmark = pytest.mark.compile

# With FORBID_COMPILE=1 any call of cute.compile fails the process: a warm start must load from disk.
SCRIPT = textwrap.dedent(
    """
    import os
    import cutlass.cute as cute
    if os.environ.get("FORBID_COMPILE") == "1":
        def forbidden(*args, **kwargs):
            raise AssertionError("cute.compile called although the kernel is in the disk cache")
        cute.compile = forbidden
    import mla_cute.kernels.build as build
    from mla_cute.schedules import SchedulerConfig
    fn = build.compile_scheduler(SchedulerConfig(fixed_cost=3))
    assert callable(fn), fn
    import mla_cute
    info = mla_cute.cache_info()
    print("memory:", info["memory"], "disk:", info["disk"], "other:", info["disk_other"])
    """
)


def _run(env, forbid_compile=False):
    env = dict(env, FORBID_COMPILE="1" if forbid_compile else "0")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr + proc.stdout


def _env(cache):
    return dict(os.environ, MLA_CUTE_CACHE_DIR=str(cache), CUTE_DSL_ARCH=os.environ.get("CUTE_DSL_ARCH", "sm_90a"))


def _snapshot(cache):
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(cache.iterdir())}


def _assert_entry_good(obj):
    data = obj.read_bytes()
    size, digest = obj.with_suffix(".sum").read_text().split()
    assert int(size) == len(data) and digest == hashlib.sha256(data).hexdigest()


def test_second_process_loads_from_disk(tmp_path):
    env = _env(tmp_path)
    log_cold = _run(env)
    assert "compiling scheduler" in log_cold
    (obj,) = tmp_path.glob("*.o")
    _assert_entry_good(obj)
    linked = [obj.stem + ".so", obj.stem + ".so.sum"] if jit._linker() else []
    entry = [obj.name, obj.stem + ".sum", obj.stem + ".txt"] + linked
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(entry + ["compile_times.json"])
    assert "scheduler" in json.loads((tmp_path / "compile_times.json").read_text())  # the next one's estimate
    assert obj.with_suffix(".txt").read_text().startswith("scheduler SchedulerConfig(fixed_cost=3")
    # cache_info's lists as printed (a description holding a quote is shown in double quotes)
    assert re.search(r"\(compiled\)['\"]\] disk: \[['\"]scheduler SchedulerConfig\(fixed_cost=3", log_cold), log_cold
    before = _snapshot(tmp_path)
    log_warm = _run(env, forbid_compile=True)
    assert "compiling" not in log_warm and "rebuilding" not in log_warm
    assert re.search(r"\(disk\)['\"]\] disk: \[['\"]scheduler", log_warm) and "other: 0" in log_warm  # warm on disk
    assert _snapshot(tmp_path) == before, "a warm start must not rewrite the cache"


def test_damaged_entry_is_rebuilt(tmp_path):
    env = _env(tmp_path)
    _run(env)
    (obj,) = tmp_path.glob("*.o")
    data = bytearray(obj.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte changed: loadable, maybe, but not what was compiled
    obj.write_bytes(bytes(data))
    log = _run(env)
    assert "rebuilding the compile cache entry" in log and str(obj) in log and "compiling scheduler" in log
    _assert_entry_good(obj)
    assert obj.read_bytes() != bytes(data)
    log_warm = _run(env, forbid_compile=True)
    assert "compiling" not in log_warm and "rebuilding" not in log_warm


def test_disk_cache_can_be_disabled(tmp_path):
    env = dict(_env(tmp_path), MLA_CUTE_DISK_CACHE="0")
    assert "compiling scheduler" in _run(env)
    assert list(tmp_path.iterdir()) == []


PARALLEL = textwrap.dedent(
    """
    import sys
    import mla_cute.kernels.build as build
    from mla_cute.schedules import SchedulerConfig
    print("script ran")
    configs = [SchedulerConfig(fixed_cost=3), SchedulerConfig(fixed_cost=4)]
    if sys.argv[1] == "parallel":
        fns = build.compile_all([(build.compile_scheduler, c) for c in configs])
    else:
        fns = [build.compile_scheduler(c) for c in configs]
    assert all(callable(fn) for fn in fns)
    """
)


def test_parallel_build_writes_the_objects_a_serial_build_does(tmp_path):
    """``compile_all`` builds two cold kernels in two child processes into the disk cache, and the parent loads
    them: the entries are byte for byte those of a serial build.  The caller is a script without a main guard,
    which the children do not run again."""
    script = tmp_path / "script.py"
    script.write_text(PARALLEL)
    objects = {}
    for mode in ("parallel", "serial"):
        cache = tmp_path / mode
        proc = subprocess.run([sys.executable, str(script), mode], env=_env(cache), capture_output=True,
                              text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.count("script ran") == 1
        assert proc.stderr.count("compiling scheduler") == 2
        assert "building it here" not in proc.stderr  # the children built them, without torch
        objects[mode] = {p.name: p.read_bytes() for p in cache.glob("*.o")}
    assert len(objects["serial"]) == 2 and objects["parallel"] == objects["serial"]


def test_a_kernel_build_imports_no_torch():
    """The package, the schedules and the build module import no torch (a build process runs without it)."""
    code = ("import sys; import mla_cute, mla_cute.schedules, mla_cute.kernels.build; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]"


NO_DSL = textwrap.dedent(
    """
    import sys
    import mla_cute.kernels.build as build
    from mla_cute.schedules import SchedulerConfig
    fn = build.compile_scheduler(SchedulerConfig(fixed_cost=3))
    print(type(fn).__module__, type(fn).__name__, "cutlass imported:", "cutlass" in sys.modules)
    """
)


@pytest.mark.skipif(jit._linker() is None, reason="no C compiler to link shared libraries with")
def test_a_warm_start_loads_the_shared_library_without_the_dsl(tmp_path):
    """Where a compiler links each entry into a shared library, a second process loads the kernel through TVM-FFI
    and never imports the DSL."""
    env = _env(tmp_path)
    _run(env)
    proc = subprocess.run([sys.executable, "-c", NO_DSL], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tvm_ffi.core Function cutlass imported: False" in proc.stdout, proc.stdout + proc.stderr
    assert "compiling" not in proc.stderr


CONSTRUCTOR = 'static void __attribute__((constructor)) planted(void) { fclose(fopen("%s", "w")); }\n'


@pytest.mark.skipif(jit._linker() is None, reason="no C compiler to link shared libraries with")
def test_a_library_is_loaded_from_the_cache_dir_only_and_a_broken_one_is_linked_again(tmp_path):
    """A checksum file naming another library (an older format's runtime path, here a library whose constructor
    leaves a mark) never gets it loaded; that entry's library and a truncated one are linked again from their
    objects, after which a fresh process loads them without the DSL."""
    cache = tmp_path / "cache"
    env = _env(cache)
    _run(env)
    (lib,) = cache.glob("*.so")
    side = lib.with_name(lib.name + ".sum")
    good = lib.read_bytes()
    assert len(side.read_text().split()) == 3  # size, sha256, the object's sha256: no path
    mark, source = tmp_path / "constructor_ran", tmp_path / "planted.c"
    source.write_text('#include <stdio.h>\n' + CONSTRUCTOR % mark)
    planted = tmp_path / "planted.so"
    subprocess.run(jit._linker() + ["-shared", "-fPIC", "-o", str(planted), str(source)], check=True)
    size, digest, obj_digest = side.read_text().split()
    for damage in ("path", "truncate"):
        if damage == "path":
            side.write_text(f"{size} {digest} {planted} {obj_digest}\n")
        else:
            lib.write_bytes(good[: len(good) // 2])
        log = _run(env, forbid_compile=True)
        assert not mark.exists(), "a library named by a checksum file was loaded"
        assert f"not loading {lib}" in log and "linking it again" in log and "compiling" not in log
        assert jit._library_problem(cache, lib.stem, trusted=False) is None
        proc = subprocess.run([sys.executable, "-c", NO_DSL], env=env, capture_output=True, text=True, timeout=600)
        assert "tvm_ffi.core Function cutlass imported: False" in proc.stdout, proc.stdout + proc.stderr
        assert "not loading" not in proc.stderr and "compiling" not in proc.stderr
