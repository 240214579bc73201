"""Integrity of the on-disk compile cache, with fake compiled objects (no compile, no GPU, no cutlass)."""

from __future__ import annotations

import json
import logging
import os
import stat
import time

import pytest

from mla_cute import jit

PAYLOAD = bytes(range(256)) * 16  # 4 KiB of "object code"


class FakeFn:
    """Stands in for a compiled kernel: exports ``tag`` + a payload, like ``export_to_c`` of the DSL."""

    def __init__(self, tag: bytes, fail: BaseException | None = None):
        self.tag, self.fail = tag, fail

    def export_to_c(self, path, function_name=None):
        with open(path, "wb") as f:
            f.write(self.tag + b":" + function_name.encode() + b":" + PAYLOAD[: len(PAYLOAD) // 2])
            if self.fail is not None:  # a partly written file, then the failure
                raise self.fail
            f.write(PAYLOAD[len(PAYLOAD) // 2:])


class Loaded:
    def __init__(self, data: bytes):
        self.data = data


@pytest.fixture
def cache(tmp_path, monkeypatch, caplog):
    """An empty cache directory, keys named ``k<key>`` on disk, and a loader that records what it loads."""
    root = tmp_path / "cache"
    monkeypatch.setenv("MLA_CUTE_CACHE_DIR", str(root))
    monkeypatch.delenv("MLA_CUTE_DISK_CACHE", raising=False)
    monkeypatch.setattr(jit, "_disk_name", lambda key: f"k{key}")
    monkeypatch.setattr(jit, "_build_stamp", lambda: "this build")
    monkeypatch.setattr(jit, "_cache", {})
    monkeypatch.setattr(jit, "_described", {})
    monkeypatch.setattr(jit, "_warned", set())
    loads = []

    def load(path, name):
        loads.append(path)
        return Loaded(path.read_bytes())

    monkeypatch.setattr(jit, "_load_module", load)
    monkeypatch.setattr(jit, "_link_shared", lambda obj, out: None)  # fake objects: no shared libraries
    caplog.set_level(logging.INFO, logger="mla_cute")
    return root, loads


def compile_(key, fn):
    """``cached_compile`` with a build that counts its calls; returns (result, builds)."""
    builds = []

    def build():
        builds.append(key)
        return fn

    return jit.cached_compile(key, build, describe=f"test {key}"), len(builds)


def warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def tmp_files(root):
    return sorted(p.name for p in root.glob("*tmp*"))


def test_entry_round_trip(cache, caplog):
    root, loads = cache
    fn = FakeFn(b"A")
    got, builds = compile_("a", fn)
    assert got is fn and builds == 1
    obj, side = root / "ka.o", root / "ka.sum"
    assert obj.read_bytes().startswith(b"A:ka:") and len(obj.read_bytes()) == 5 + len(PAYLOAD)
    assert side.read_text() == jit._sidecar_text(obj.read_bytes())
    jit.clear_memory_cache()
    got, builds = compile_("a", FakeFn(b"B"))
    assert builds == 0 and isinstance(got, Loaded) and got.data == obj.read_bytes()
    assert loads == [obj]
    assert warnings(caplog) == [] and tmp_files(root) == []


def _bad_entry(root, damage):
    """A good entry for key "a", then ``damage(obj, side)``; returns the object's path."""
    compile_("a", FakeFn(b"A"))
    jit.clear_memory_cache()
    obj, side = root / "ka.o", root / "ka.sum"
    damage(obj, side)
    return obj


def _truncate(obj, side):
    obj.write_bytes(obj.read_bytes()[:100])


def _flip_byte(obj, side):
    data = bytearray(obj.read_bytes())
    data[len(data) // 2] ^= 0x01
    obj.write_bytes(bytes(data))


def _drop_sidecar(obj, side):
    side.unlink()


def _drop_object(obj, side):
    obj.unlink()


def _garble_sidecar(obj, side):
    side.write_text("not a checksum")


@pytest.mark.parametrize("damage, why", [
    (_truncate, "has 100 bytes"),
    (_flip_byte, "does not match its checksum"),
    (_drop_sidecar, "checksum file is missing"),
    (_drop_object, "object is unreadable"),
    (_garble_sidecar, "checksum file is unreadable"),
])
def test_bad_entry_is_reported_rebuilt_and_replaced(cache, caplog, damage, why):
    root, loads = cache
    obj = _bad_entry(root, damage)
    caplog.clear()
    fresh = FakeFn(b"C")
    got, builds = compile_("a", fresh)
    assert got is fresh and builds == 1, "a bad entry must be rebuilt"
    assert loads == [], "a bad entry must not be loaded"
    (msg,) = warnings(caplog)
    assert str(obj) in msg and why in msg
    # replaced by a good entry of the rebuilt kernel, which the next process loads silently
    assert obj.read_bytes().startswith(b"C:ka:")
    assert (root / "ka.sum").read_text() == jit._sidecar_text(obj.read_bytes())
    jit.clear_memory_cache()
    caplog.clear()
    got, builds = compile_("a", FakeFn(b"D"))
    assert builds == 0 and got.data.startswith(b"C:ka:") and loads == [obj]
    assert warnings(caplog) == [] and tmp_files(root) == []


def test_checked_entry_that_does_not_load_is_rebuilt(cache, caplog, monkeypatch):
    root, _ = cache
    obj = _bad_entry(root, lambda obj, side: None)

    def broken(path, name):
        raise RuntimeError("symbol not found")

    monkeypatch.setattr(jit, "_load_module", broken)
    caplog.clear()
    fresh = FakeFn(b"C")
    got, builds = compile_("a", fresh)
    assert got is fresh and builds == 1
    (msg,) = warnings(caplog)
    assert str(obj) in msg and "symbol not found" in msg


def test_bad_entry_is_reported_once(cache, caplog):
    """Each bad entry is reported once per process, even while it cannot be replaced."""
    root, loads = cache
    obj_a = _bad_entry(root, _flip_byte)
    compile_("b", FakeFn(b"B"))
    obj_b = root / "kb.o"
    _truncate(obj_b, None)
    jit.clear_memory_cache()
    caplog.clear()
    for _ in range(3):  # every export fails, so the entries stay bad
        for key in ("a", "b"):
            _, builds = compile_(key, FakeFn(b"X", fail=RuntimeError("export failed")))
            assert builds == 1
        jit.clear_memory_cache()
    msgs = warnings(caplog)
    assert len([m for m in msgs if "rebuilding" in m and str(obj_a) in m]) == 1
    assert len([m for m in msgs if "rebuilding" in m and str(obj_b) in m]) == 1
    assert len([m for m in msgs if "could not write" in m]) == 1
    assert len(msgs) == 3
    assert loads == [] and tmp_files(root) == []


@pytest.mark.parametrize("failure", [RuntimeError("DSL error"), OSError(28, "No space left on device")])
def test_failed_export_leaves_no_tmp_file(cache, caplog, failure):
    root, _ = cache
    fn = FakeFn(b"A", fail=failure)
    got, builds = compile_("a", fn)
    assert got is fn and builds == 1, "the compiled kernel is still returned"
    assert tmp_files(root) == [] and not (root / "ka.o").exists() and not (root / "ka.sum").exists()
    (msg,) = warnings(caplog)
    assert "could not write" in msg and str(failure) in msg
    assert jit.cached_compile("a", lambda: pytest.fail("rebuilt")) is fn, "kept in memory"


def test_interrupted_export_leaves_no_tmp_file(cache):
    root, _ = cache
    with pytest.raises(KeyboardInterrupt):
        compile_("a", FakeFn(b"A", fail=KeyboardInterrupt()))
    assert root.is_dir() and tmp_files(root) == [] and list(root.iterdir()) == []


def test_failed_sidecar_write_leaves_no_tmp_file(cache, caplog, monkeypatch):
    root, _ = cache

    def no_sidecar(text):
        raise OSError(122, "Disk quota exceeded")

    monkeypatch.setattr(jit, "_sidecar_text", no_sidecar)
    compile_("a", FakeFn(b"A"))
    assert tmp_files(root) == [] and list(root.iterdir()) == []
    (msg,) = warnings(caplog)
    assert "Disk quota exceeded" in msg


def test_stale_tmp_files_are_swept(cache):
    root, _ = cache
    root.mkdir()
    old, young = root / "kz.123.abcd.tmp.o", root / "kz.456.ef01.tmp.sum"
    for p in (old, young):
        p.write_bytes(b"partial")
    hours_ago = time.time() - 2 * jit._STALE_TMP_S
    os.utime(old, (hours_ago, hours_ago))
    compile_("a", FakeFn(b"A"))
    assert tmp_files(root) == [young.name], "only the dead writer's file goes"
    assert (root / "ka.o").exists() and (root / "ka.sum").exists()


def _assert_compiles_without_cache(root, caplog):
    for key in ("a", "b"):
        fn = FakeFn(key.encode())
        got, builds = compile_(key, fn)
        assert got is fn and builds == 1
    msgs = warnings(caplog)
    assert len(msgs) == 1, msgs  # once, not once per kernel
    assert "could not write" in msgs[0] and str(root) in msgs[0]


def test_cache_dir_that_is_a_file(cache, caplog):
    root, _ = cache
    root.write_bytes(b"not a directory")
    _assert_compiles_without_cache(root, caplog)
    assert root.read_bytes() == b"not a directory"


def test_read_only_cache_dir(cache, caplog):
    root, _ = cache
    root.mkdir()
    root.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        if os.access(root, os.W_OK):
            pytest.skip("chmod cannot make a directory read-only for this user (root); "
                        "test_cache_dir_that_is_a_file covers an unwritable cache")
        _assert_compiles_without_cache(root, caplog)
        assert list(root.iterdir()) == []
    finally:
        root.chmod(stat.S_IRWXU)


def test_disabled_disk_cache_touches_nothing(cache, monkeypatch):
    root, loads = cache
    monkeypatch.setenv("MLA_CUTE_DISK_CACHE", "0")
    fn = FakeFn(b"A")
    assert compile_("a", fn) == (fn, 1)
    assert not root.exists() and loads == []


def test_cache_info_names_the_warm_configurations(cache):
    """Memory: what this process compiled or loaded; disk: the entries of this build, by their configuration;
    entries of another build (or without a description) are counted apart."""
    root, _ = cache
    jit.cached_compile("a", lambda: FakeFn(b"a"), describe="sparse decode A")
    info = jit.cache_info()
    assert info["memory"] == ["sparse decode A (compiled)"] and info["disk"] == ["sparse decode A"]
    assert info["disk_other"] == 0 and info["directory"] == str(root)
    (root / "ka.txt").write_text("sparse decode A\nanother build\n")
    (root / "kb.txt").write_text("dense decode B\nthis build\n")  # no object: not loadable
    assert jit.cache_info()["disk"] == [] and jit.cache_info()["disk_other"] == 2
    jit.clear_memory_cache()
    (root / "ka.txt").write_text("sparse decode A\nthis build\n")
    jit.cached_compile("a", lambda: pytest.fail("compiled again"), describe="sparse decode A")
    assert jit.cache_info()["memory"] == ["sparse decode A (disk)"]


def test_packaged_kernels_load_before_the_disk_cache(cache, tmp_path, monkeypatch):
    """A wheel's kernels (``jit.PACKAGED``) load first, by the disk cache's entry name; a damaged one is reported
    and passed over; ``cache_info`` lists the package's entries of this build."""
    root, loads = cache
    package = tmp_path / "package"
    monkeypatch.setattr(jit, "PACKAGED", package)
    jit.cached_compile("p", lambda: FakeFn(b"p"), describe="dense decode P")  # an entry, in the disk cache
    package.mkdir()
    for suffix in (".o", ".sum", ".txt"):
        (package / f"kp{suffix}").write_bytes((root / f"kp{suffix}").read_bytes())
        (root / f"kp{suffix}").unlink()
    jit.clear_memory_cache()
    fn = jit.cached_compile("p", lambda: pytest.fail("compiled although packaged"), describe="dense decode P")
    assert loads == [package / "kp.o"] and fn.data.startswith(b"p:kp:")
    info = jit.cache_info()
    assert info["package"] == ["dense decode P"] and info["disk"] == [] and info["memory"] == ["dense decode P (package)"]
    assert jit.is_warm("p")
    (package / "kp.o").write_bytes(b"not the object")  # damaged: reported, then compiled into the disk cache
    jit.clear_memory_cache()
    jit.cached_compile("p", lambda: FakeFn(b"q"), describe="dense decode P")
    assert (root / "kp.o").read_bytes().startswith(b"q:kp:")


def test_wheel_hook_bundles_named_sets(tmp_path, monkeypatch):
    """setup.py's hook runs ``python -m mla_cute.precompile`` into the wheel's ``_kernels`` and keeps whole entries."""
    import importlib.util
    import sys
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("setup_hook", Path(__file__).parents[1] / "setup.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)  # defines the hook; setup() runs only as __main__
    ran = []

    def run(cmd, env, check):
        ran.append((cmd, env["MLA_CUTE_CACHE_DIR"], check))
        for name in ("ka.o", "ka.sum", "ka.txt", "ka.so", "ka.so.sum", "kb.1.tmp.o", "kb.2.tmp.so", "stray.log"):
            (tmp_path / name).write_text("x")

    hook.bundle_kernels(tmp_path, "deepseek-v32-sparse", "4", run=run)
    assert ran == [([sys.executable, "-m", "mla_cute.precompile", "--sets", "deepseek-v32-sparse", "--jobs", "4"],
                    str(tmp_path), True)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ka.o", "ka.so", "ka.so.sum", "ka.sum", "ka.txt"]


def test_a_linked_library_loads_first_and_a_bad_one_falls_back_to_the_object(cache, monkeypatch, caplog):
    """With a shared library beside the object (``_link_shared``), a load opens it (``_load_shared``, given the
    runtime path its sidecar records); a library that fails its checksum or does not load is reported once and
    the object loads."""
    root, loads = cache

    def link(obj, out):
        out.write_bytes(b"lib:" + obj.read_bytes())
        return "cu13/lib/libcute_dsl_runtime.so"

    shared = []
    monkeypatch.setattr(jit, "_link_shared", link)
    monkeypatch.setattr(jit, "_load_shared", lambda path, name, runtime: shared.append((path.name, runtime)) or "lib")
    compile_("a", FakeFn(b"A"))
    lib, side = root / "ka.so", root / "ka.so.sum"
    assert lib.read_bytes().startswith(b"lib:A:ka:")
    assert side.read_text().split()[2:] == ["cu13/lib/libcute_dsl_runtime.so", (root / "ka.sum").read_text().split()[1]]
    assert jit._entry_problem(lib, side) is None
    jit.clear_memory_cache()
    assert compile_("a", FakeFn(b"B")) == ("lib", 0) and shared == [("ka.so", "cu13/lib/libcute_dsl_runtime.so")]
    assert loads == [] and warnings(caplog) == []
    lib.write_bytes(b"lib:damaged")
    jit.clear_memory_cache()
    got, builds = compile_("a", FakeFn(b"C"))
    assert builds == 0 and got.data.startswith(b"A:ka:") and loads == [root / "ka.o"]
    assert any("loading ka from its object instead of" in w for w in warnings(caplog))


def test_a_cold_compile_announces_the_last_time_of_its_kind(cache, caplog, monkeypatch):
    """Each compile records its seconds by kernel kind in the disk cache; the next cold compile of that kind (or a
    parallel batch, ``estimate``) announces about that long."""
    root, _ = cache
    assert jit.estimate([("dense_decode", 1)]) == ""
    clock = iter([100.0, 112.4])
    monkeypatch.setattr(jit.time, "perf_counter", lambda: next(clock))
    compile_(("dense_decode", 1), FakeFn(b"A"))
    assert json.loads((root / "compile_times.json").read_text()) == {"dense_decode": 12.4}
    assert jit.estimate([("scheduler", 3), ("dense_decode", 2)]) == ", ~12 s"
    assert jit.estimate([("scheduler", 3)]) == ""
    monkeypatch.setattr(jit.time, "perf_counter", lambda: 0.0)
    compile_(("dense_decode", 2), FakeFn(b"B"))
    assert any("compiling test ('dense_decode', 2), ~12 s ..." in r.getMessage() for r in caplog.records)


def test_a_library_of_an_older_object_is_not_loaded(cache, monkeypatch, caplog):
    """An entry rebuilt (its object damaged) whose new link fails keeps the old library on disk; that library
    records the old object's digest, so the new object loads instead."""
    root, loads = cache
    monkeypatch.setattr(jit, "_link_shared", lambda obj, out: out.write_bytes(b"lib") or "cu13/lib/x.so")
    monkeypatch.setattr(jit, "_load_shared", lambda path, name, runtime: "lib")
    compile_("a", FakeFn(b"A"))
    (root / "ka.o").write_bytes(b"damaged")

    def fail(obj, out):
        raise RuntimeError("cc exited 1: no space")

    monkeypatch.setattr(jit, "_link_shared", fail)
    jit.clear_memory_cache()
    compile_("a", FakeFn(b"B"))  # rebuilt: new object, link failed, the old library left
    assert (root / "ka.so").exists() and any("could not link" in w for w in warnings(caplog))
    jit.clear_memory_cache()
    got, builds = compile_("a", FakeFn(b"C"))
    assert builds == 0 and got.data.startswith(b"B:ka:") and loads == [root / "ka.o"]
    assert any("linked from another object" in w for w in warnings(caplog))
