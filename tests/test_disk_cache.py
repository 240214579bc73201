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
    monkeypatch.setattr(jit, "_link_shared", lambda obj, out: False)  # fake objects: no compiler, no libraries
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


def _assert_compiles_without_cache(root, caplog, fake=FakeFn):
    for key in ("a", "b"):
        fn = fake(key.encode())
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


def test_cache_dir_under_a_file(cache, caplog, monkeypatch):
    root, _ = cache
    root.write_bytes(b"not a directory")
    monkeypatch.setenv("MLA_CUTE_CACHE_DIR", str(root / "sub"))
    _assert_compiles_without_cache(root / "sub", caplog)
    assert root.read_bytes() == b"not a directory"


class ModeCheckingFn(FakeFn):
    """Exports as the DSL would for a user other than root: refused in a directory without owner write permission
    (root passes the kernel's check, so the fake makes it from the mode bits)."""

    def export_to_c(self, path, function_name=None):
        if not os.stat(os.path.dirname(path)).st_mode & stat.S_IWUSR:
            raise PermissionError(13, "Permission denied", path)
        super().export_to_c(path, function_name)


def test_read_only_cache_dir(cache, caplog):
    """A read-only cache directory (this user's) costs only the persistence: one warning, kernels compile, nothing
    is written there."""
    root, _ = cache
    root.mkdir()
    root.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        _assert_compiles_without_cache(root, caplog, ModeCheckingFn)
        assert list(root.iterdir()) == []
        assert "Permission denied" in warnings(caplog)[0]
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

    tmp_path.chmod(0o775)  # a build folder made under umask 002: the cache would refuse it
    hook.bundle_kernels(tmp_path, "deepseek-v32-sparse", "4", run=run)
    assert stat.S_IMODE(tmp_path.stat().st_mode) == 0o755
    assert ran == [([sys.executable, "-m", "mla_cute.precompile", "--sets", "deepseek-v32-sparse", "--jobs", "4"],
                    str(tmp_path), True)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ka.o", "ka.so", "ka.so.sum", "ka.sum", "ka.txt"]


class Linker:
    """Stands in for the C compiler and TVM-FFI: ``link`` writes ``lib:`` + the object (or fails while ``fail``
    says why), ``load`` returns what it opened (and refuses a file that is not such a library)."""

    def __init__(self, monkeypatch):
        self.links, self.opened, self.fail = 0, [], None
        monkeypatch.setattr(jit, "_link_shared", self.link)
        monkeypatch.setattr(jit, "_load_shared", self.load)

    def link(self, obj, out):
        if self.fail:
            raise RuntimeError(self.fail)
        self.links += 1
        out.write_bytes(b"lib:" + obj.read_bytes())
        return True

    def load(self, path, name):
        data = path.read_bytes()
        if not data.startswith(b"lib:"):
            raise OSError(f"{path}: invalid ELF header")
        self.opened.append(path.name)
        return Loaded(data)


def test_a_linked_library_loads_first_and_a_bad_one_is_linked_again(cache, monkeypatch, caplog):
    """With a shared library beside the object (``_link_shared``), a load opens it (``_load_shared``); its sidecar
    holds the library's size and sha256 and the object's sha256, nothing else.  A library that fails its checksum
    is reported once, removed and linked again from the object, which then loads from the new library."""
    root, loads = cache
    linker = Linker(monkeypatch)
    compile_("a", FakeFn(b"A"))
    lib, side = root / "ka.so", root / "ka.so.sum"
    assert lib.read_bytes().startswith(b"lib:A:ka:") and linker.links == 1
    assert side.read_text().split() == jit._sidecar_text(lib.read_bytes()).split() + [
        (root / "ka.sum").read_text().split()[1]]
    jit.clear_memory_cache()
    got, builds = compile_("a", FakeFn(b"B"))
    assert builds == 0 and got.data.startswith(b"lib:A:ka:") and linker.opened == ["ka.so"]
    assert loads == [] and warnings(caplog) == []
    lib.write_bytes(b"lib:damaged")
    jit.clear_memory_cache()
    got, builds = compile_("a", FakeFn(b"C"))
    assert builds == 0 and loads == [] and got.data == lib.read_bytes() == b"lib:" + (root / "ka.o").read_bytes()
    assert linker.links == 2 and jit._library_problem(root, "ka", trusted=False) is None
    (msg,) = warnings(caplog)
    assert f"not loading {lib}" in msg and "the library has 11 bytes" in msg and "linking it again" in msg


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
    records the old object's digest, so it is not loaded: removed, linked again (failing again here, reported),
    and the new object loads."""
    root, loads = cache
    linker = Linker(monkeypatch)
    compile_("a", FakeFn(b"A"))
    (root / "ka.o").write_bytes(b"damaged")
    linker.fail = "cc exited 1: no space"
    jit.clear_memory_cache()
    compile_("a", FakeFn(b"B"))  # rebuilt: new object, link failed, the old library left
    assert (root / "ka.so").read_bytes().startswith(b"lib:A:") and any("could not link" in w for w in warnings(caplog))
    jit.clear_memory_cache()
    monkeypatch.setattr(jit, "_warned", set())  # a later process
    caplog.clear()
    got, builds = compile_("a", FakeFn(b"C"))
    assert builds == 0 and got.data.startswith(b"B:ka:") and loads == [root / "ka.o"] and linker.opened == []
    assert not (root / "ka.so").exists() and not (root / "ka.so.sum").exists()
    msgs = warnings(caplog)
    assert any("linked from another object" in w for w in msgs) and any("no space" in w for w in msgs)


# The trust boundary: the disk cache is used only where no other user could have written it.

OTHER_UID = os.getuid() + 4242  # neither this user nor root


def _owned_by_another_user(monkeypatch, *paths):
    """``jit`` sees ``paths`` (these very files: a replaced file is a new one) as owned by ``OTHER_UID``."""
    marked = {(p.stat().st_dev, p.stat().st_ino) for p in paths}
    real = jit._owner_and_mode

    def owner_and_mode(path):
        uid, mode = real(path)
        st = os.stat(path)
        return (OTHER_UID if (st.st_dev, st.st_ino) in marked else uid), mode

    monkeypatch.setattr(jit, "_owner_and_mode", owner_and_mode)


def _snapshot(root):
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


@pytest.mark.parametrize("how, why", [
    ("another user's", f"owned by uid {OTHER_UID}"),
    ("group-writable", "writable by its group or others (mode 775)"),
    ("world-writable", "writable by its group or others (mode 1777)"),
])
def test_a_cache_dir_another_user_could_write_is_not_used(cache, caplog, monkeypatch, how, why):
    """A cache directory owned by another user, or one its group or others may write (a shared /tmp folder), is not
    used: its entries are not loaded (one warning), kernels compile in memory, nothing is written there."""
    root, loads = cache
    compile_("a", FakeFn(b"A"))  # a sound entry, which would load
    jit.clear_memory_cache()
    before = _snapshot(root)
    if how == "another user's":
        _owned_by_another_user(monkeypatch, root)
    else:
        root.chmod(0o775 if how == "group-writable" else 0o1777)
    caplog.clear()
    for key in ("a", "b", "a"):
        fn = FakeFn(key.encode())
        assert compile_(key, fn) == (fn, 1)
        jit.clear_memory_cache()
    assert loads == [], "nothing of an untrusted directory may be loaded"
    (msg,) = warnings(caplog)
    assert f"not using the compile cache in {root}" in msg and why in msg and "compile in memory" in msg
    assert _snapshot(root) == before
    jit.clear_memory_cache()
    assert not jit.is_warm("a") and jit.cache_info()["disk"] == []


@pytest.mark.parametrize("suffix", [".o", ".sum"])
@pytest.mark.parametrize("how", ["another user's", "group-writable"])
def test_an_entry_file_another_user_could_write_is_rebuilt(cache, caplog, monkeypatch, suffix, how):
    """In a trusted directory, an entry whose object or checksum file belongs to another user, or may be written by
    its group or others, is reported, not loaded, rebuilt and replaced by this user's own files."""
    root, loads = cache
    compile_("a", FakeFn(b"A"))
    jit.clear_memory_cache()
    planted = root / f"ka{suffix}"
    if how == "another user's":
        _owned_by_another_user(monkeypatch, planted)
    else:
        planted.chmod(0o664)
    caplog.clear()
    fresh = FakeFn(b"C")
    assert compile_("a", fresh) == (fresh, 1) and loads == []
    (msg,) = warnings(caplog)
    assert f"rebuilding the compile cache entry {root / 'ka.o'}" in msg and str(planted) in msg
    assert jit._trust_problem(planted) is None and stat.S_IMODE(planted.stat().st_mode) & 0o022 == 0
    jit.clear_memory_cache()
    got, builds = compile_("a", FakeFn(b"D"))
    assert builds == 0 and got.data.startswith(b"C:ka:") and loads == [root / "ka.o"]


def test_root_or_this_user_may_own_the_cache(cache, caplog, monkeypatch):
    """Files of this user or of root (an image's cache built as root, served as another user) are trusted."""
    root, loads = cache
    compile_("a", FakeFn(b"A"))
    jit.clear_memory_cache()
    monkeypatch.setattr(jit.os, "getuid", lambda: OTHER_UID)
    real = jit._owner_and_mode
    for owner in (0, OTHER_UID):
        monkeypatch.setattr(jit, "_owner_and_mode", lambda path, owner=owner: (owner, real(path)[1]))
        got, builds = compile_("a", FakeFn(b"B"))
        assert builds == 0 and got.data.startswith(b"A:ka:")
        jit.clear_memory_cache()
    assert warnings(caplog) == [] and len(loads) == 2


@pytest.mark.parametrize("umask", [0o002, 0o000])
def test_entries_are_written_without_group_or_other_write(cache, monkeypatch, umask):
    """Whatever the umask, the directory (when created here) and every entry file are written without group or
    other write permission, so the entries pass the trust check of the next process."""
    root, loads = cache
    Linker(monkeypatch)
    old = os.umask(umask)
    try:
        compile_("a", FakeFn(b"A"))
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [root, *root.iterdir()]}
    assert {"cache", "ka.o", "ka.sum", "ka.so", "ka.so.sum"} <= set(modes)
    assert all(mode & 0o022 == 0 for mode in modes.values()), {k: oct(v) for k, v in modes.items()}
    jit.clear_memory_cache()
    got, builds = compile_("a", FakeFn(b"B"))
    assert builds == 0 and got.data.startswith(b"lib:A:ka:")


def test_a_checksum_file_names_no_library_to_load(cache, caplog, monkeypatch, tmp_path):
    """A library's checksum file that names a path (as an older format did: the DSL runtime to load first) never
    gets that path loaded: the library is not opened, it is removed, and the checked object loads."""
    import ctypes

    root, loads = cache
    compile_("a", FakeFn(b"A"))
    jit.clear_memory_cache()
    planted = tmp_path / "planted.so"
    planted.write_bytes(b"\x7fELF a library whose constructor must never run")
    lib = root / "ka.so"
    lib.write_bytes(b"\x7fELF the entry's library")
    obj_digest = (root / "ka.sum").read_text().split()[1]
    (root / "ka.so.sum").write_text(jit._sidecar_text(lib.read_bytes()).rstrip("\n") + f" {planted} {obj_digest}\n")
    opened = []
    monkeypatch.setattr(ctypes, "CDLL", lambda path, *args, **kwargs: opened.append(str(path)))
    monkeypatch.delenv("CUTE_DSL_LIBS", raising=False)
    got, builds = compile_("a", FakeFn(b"B"))
    assert str(planted) not in opened, "a path read from a checksum file was loaded"
    assert builds == 0 and got.data.startswith(b"A:ka:") and loads == [root / "ka.o"]
    assert not lib.exists() and not (root / "ka.so.sum").exists()
    assert any(f"not loading {lib}" in w and "another version" in w for w in warnings(caplog))


# Repair: a broken or missing shared library of a sound entry is linked again.

def _rewrite_with_checksum(lib, data):
    side = lib.with_name(lib.name + ".sum")
    fields = side.read_text().split()
    lib.write_bytes(data)
    side.write_text(" ".join(jit._sidecar_text(data).split() + fields[2:]) + "\n")


@pytest.mark.parametrize("damage, why", [
    (lambda lib: lib.write_bytes(lib.read_bytes()[:40]), "the library has 40 bytes"),
    (lambda lib: _rewrite_with_checksum(lib, b"\x7fELF truncated by a full disk"), "invalid ELF header"),
])
def test_a_broken_library_is_linked_again(cache, caplog, monkeypatch, damage, why):
    """A truncated library, or one that matches its checksum but does not load, beside a sound object: reported,
    removed and linked again, and the new library loads (no rebuild); the next process loads it silently."""
    root, loads = cache
    linker = Linker(monkeypatch)
    compile_("a", FakeFn(b"A"))
    lib = root / "ka.so"
    damage(lib)
    jit.clear_memory_cache()
    caplog.clear()
    got, builds = compile_("a", FakeFn(b"B"))
    assert builds == 0 and linker.links == 2 and loads == []
    assert got.data == lib.read_bytes() == b"lib:" + (root / "ka.o").read_bytes()
    (msg,) = warnings(caplog)
    assert why in msg and "linking it again" in msg
    jit.clear_memory_cache()
    monkeypatch.setattr(jit, "_warned", set())  # a later process
    caplog.clear()
    got, builds = compile_("a", FakeFn(b"C"))
    assert builds == 0 and linker.links == 2 and got.data.startswith(b"lib:A:ka:") and warnings(caplog) == []


@pytest.mark.parametrize("later", ["links", "fails again"])
def test_a_failed_link_is_tried_again_by_a_later_process(cache, caplog, monkeypatch, later):
    """A link that failed (a full disk) leaves the entry without a library and no marker: each later process that
    loads the entry links it again and says so, whether that works (then the library loads) or fails again (then
    the object loads)."""
    root, loads = cache
    linker = Linker(monkeypatch)
    linker.fail = "cc exited 1: No space left on device"
    compile_("a", FakeFn(b"A"))
    assert (root / "ka.o").exists() and not (root / "ka.so").exists()
    assert sorted(p.name for p in root.iterdir()) == ["compile_times.json", "ka.o", "ka.sum", "ka.txt"]  # no marker
    for process in range(2):
        jit.clear_memory_cache()
        monkeypatch.setattr(jit, "_warned", set())
        caplog.clear()
        linker.fail = None if later == "links" else "cc exited 1: No space left on device"
        got, builds = compile_("a", FakeFn(b"B"))
        assert builds == 0
        msgs = warnings(caplog)
        if later == "links":
            assert got.data.startswith(b"lib:A:ka:") and linker.links == 1
            assert (process == 0) == any("linked the missing shared library" in m for m in msgs), msgs
            assert len(msgs) == (process == 0)
        else:
            assert got.data.startswith(b"A:ka:") and loads[-1] == root / "ka.o"
            (msg,) = msgs
            assert "could not link" in msg and "No space left on device" in msg
