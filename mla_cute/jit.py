"""Compiling CuTe DSL kernels: arch selection, the in-memory and on-disk compile caches.

Kernels are compiled once per static configuration with fake tensors (symbolic batch,
block and split counts) and called through TVM-FFI with torch tensors.  The in-memory
cache is keyed on every static fact the generated code depends on.  The disk cache
(``$MLA_CUTE_CACHE_DIR``, default ``~/.cache/mla_cute``) stores the exported object of each
compiled kernel under a hash of that key, the DSL and TVM-FFI versions, the target arch and the
sources of ``kernels/`` and ``schedules/``: a warm start loads it in milliseconds, and any
edit of a kernel or schedule source invalidates it.  ``MLA_CUTE_DISK_CACHE=0`` disables it.

An entry is ``<name>.o`` plus a sidecar ``<name>.sum`` holding the object's size and sha256, and
``<name>.txt``, the configuration it was compiled for (what ``cache_info`` reports).  Where a C compiler
is found (``$CC``, else ``cc``), the object is also linked into ``<name>.so`` (sidecar ``<name>.so.sum``:
size, sha256 and the object's sha256, so a library left from an older object is not loaded), which a load
opens through TVM-FFI without importing the DSL (seconds of a fresh process's first call); the library finds
the DSL runtime it was linked against through its own run path.  A sidecar holds sizes and digests only, never
a path: what loads is ``<name>.o`` or ``<name>.so`` of the cache directory.  Without a compiler, or when the
library does not load, the object is linked in memory by the DSL; a disk-cache library that fails its checks or
does not load is removed and linked again from its checked object, and a missing one (an earlier link that
failed) is linked again by the next process that loads the entry.  Files are written to temporary files and
published with ``os.replace``, the sidecar last, and
the object is checked against the sidecar before it is loaded: an entry whose object or sidecar
is missing, truncated or altered is reported once (a warning), rebuilt and replaced, never
loaded.  Temporary files are removed when a write fails, and those of dead writers (older than
an hour) are swept when the directory is written.  A cache directory that cannot be written
only costs the persistence (one warning); compiling still works.

The disk cache is trusted as code is (``_trust_problem``): its directory and each entry file it loads must be
owned by this user (or root) and not writable by group or others.  A directory that is not is not used at all
(one warning; kernels compile in memory); an entry file that is not is reported once, rebuilt and replaced.
Files are written without group or other write permission, the directory created ``0o755`` at most.  The
package's own kernels (``PACKAGED``) are trusted as its code is.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import secrets
import stat
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Hashable

log = logging.getLogger("mla_cute")

_lock = threading.Lock()
_cache: Dict[Hashable, Any] = {}
_described: Dict[Hashable, str] = {}  # what each kernel in memory was compiled for, and where it came from
_source_hash: str | None = None
_warned: set = set()  # what has been reported once already (bad entries, unwritable directories)
_STALE_TMP_S = 3600  # a temporary file this old belongs to a writer that died
_PACKAGE_DIR = Path(__file__).resolve().parent
# Kernels a wheel carries (``setup.py``, ``MLA_CUTE_BUNDLE_KERNELS``): entries like the disk cache's, found first.
PACKAGED = _PACKAGE_DIR / "_kernels"


def prepare_dsl() -> None:
    """Point the DSL at sm_90a when no GPU is visible (compile-only use); must run before cutlass is imported."""
    if "CUTE_DSL_ARCH" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["CUTE_DSL_ARCH"] = "sm_90a"


def cutlass_dtype(torch_dtype):
    import cutlass
    import torch

    table = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16, torch.float32: cutlass.Float32}
    if torch_dtype not in table:
        raise NotImplementedError(f"no kernel for dtype {torch_dtype}")
    return table[torch_dtype]


def compile_options(extra: str = "") -> str:
    return ("--enable-tvm-ffi " + extra).strip()


def cache_dir() -> Path:
    root = os.environ.get("MLA_CUTE_CACHE_DIR")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mla_cute"


def _sources_hash() -> str:
    """Hash of the kernel and schedule sources (the code that decides what gets compiled), read from their
    folders without importing them (importing the kernels would import the DSL)."""
    global _source_hash
    if _source_hash is None:
        import importlib.util

        h = hashlib.sha256()
        for name in ("mla_cute.kernels", "mla_cute.schedules"):
            for folder in importlib.util.find_spec(name).submodule_search_locations:
                for path in sorted(Path(folder).glob("*.py")):
                    h.update(path.name.encode())
                    h.update(path.read_bytes())
        _source_hash = h.hexdigest()[:16]
    return _source_hash


def _target_arch() -> str:
    arch = os.environ.get("CUTE_DSL_ARCH")
    if arch:
        return arch
    import torch

    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"sm_{major}{minor}a"
    return "unknown"


@functools.lru_cache(maxsize=1)
def _runtime_versions() -> tuple:
    """The versions an exported object depends on beyond the DSL's: the TVM-FFI it is called through."""
    from importlib import metadata

    try:
        return (metadata.version("apache-tvm-ffi"),)
    except metadata.PackageNotFoundError:
        return ("no tvm-ffi",)


@functools.lru_cache(maxsize=1)
def _dsl_version() -> str:
    """The installed DSL's version, read without importing it where its packages say it (its import costs seconds
    on a cold start): the DSL's and its base libraries' versions, else the imported module's."""
    from importlib import metadata

    versions = []
    for package in ("nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base"):
        try:
            versions.append(metadata.version(package))
        except metadata.PackageNotFoundError:
            pass
    if not versions:
        prepare_dsl()
        import cutlass

        versions.append(cutlass.__version__)
    return "/".join(versions)


def _disk_name(key: Hashable) -> str:
    prepare_dsl()  # the arch a compile here targets (sm_90a without a GPU), as the kernels' import sets it
    text = repr((key, _dsl_version(), _runtime_versions(), _target_arch(), _sources_hash()))
    return "k" + hashlib.sha256(text.encode()).hexdigest()[:32]


def _build_stamp() -> str:
    """The versions, arch and sources an entry's name is hashed with besides its key (``_disk_name``)."""
    prepare_dsl()
    return repr((_dsl_version(), _runtime_versions(), _target_arch(), _sources_hash()))


def _warn_once(what: Hashable, msg: str, *args) -> None:
    if what not in _warned:
        _warned.add(what)
        log.warning(msg, *args)


def _load_module(path: Path, name: str):
    """The function ``name`` of the exported object ``path``, linked in memory by the DSL (which this imports)."""
    import cutlass.cute as cute

    return getattr(cute.runtime.load_module(str(path), enable_tvm_ffi=True), name)


_RUNTIME = "libcute_dsl_runtime.so"
_preloaded: Dict[str, Any] = {}


def _dsl_runtime() -> str:
    """The DSL's runtime library (``$CUTE_DSL_LIBS``' if it names one, else the DSL's choice; imports the DSL)."""
    import cutlass.cute as cute

    (path,) = [p for p in cute.runtime.find_runtime_libraries(enable_tvm_ffi=False) if p.endswith(_RUNTIME)]
    return path


def _linker() -> list | None:
    """The command of the C compiler that links exported objects into shared libraries (``$CC``, which may carry
    arguments, else ``cc``), or None where it is not found."""
    import shlex
    import shutil

    command = shlex.split(os.environ.get("CC") or "cc")
    found = shutil.which(command[0]) if command else None
    return [found] + command[1:] if found else None


def _link_shared(obj: Path, out: Path) -> bool:
    """Link the exported object ``obj`` into the shared library ``out`` against the DSL's runtime and TVM-FFI, with
    the runtime's folder as the library's run path (a load finds it there, or already loaded by its name, as
    TVM-FFI is); False when there is no compiler."""
    import subprocess

    cc = _linker()
    if cc is None:
        return False
    import tvm_ffi

    runtime = Path(_dsl_runtime()).resolve()
    done = subprocess.run(cc + ["-shared", "-o", str(out), str(obj), str(runtime), tvm_ffi.libinfo.find_libtvm_ffi(),
                                f"-Wl,-rpath,{runtime.parent}"], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cc)} exited {done.returncode}: {done.stderr.strip()[-1000:]}")
    return True


def _load_shared(path: Path, name: str):
    """The function ``name`` of the shared library ``path`` through TVM-FFI, without importing the DSL.  The DSL
    runtime it needs is ``$CUTE_DSL_LIBS``' where that names one (loaded first, as the DSL does), else the one
    it was linked against (its run path)."""
    import ctypes

    import tvm_ffi

    named = [p for p in os.environ.get("CUTE_DSL_LIBS", "").split(os.pathsep) if p.endswith(_RUNTIME)]
    if named and named[0] not in _preloaded:
        _preloaded[named[0]] = ctypes.CDLL(named[0], mode=ctypes.RTLD_GLOBAL)
    return tvm_ffi.load_module(str(path))[name]


def _owner_and_mode(path: Path) -> tuple:
    st = os.stat(path)
    return st.st_uid, st.st_mode


def _trust_problem(path: Path) -> str | None:
    """Why the disk cache's directory or file ``path`` must not be used (None when it is owned by this user or
    root and neither its group nor others may write it; a path that does not exist is none of these)."""
    try:
        uid, mode = _owner_and_mode(path)
    except (FileNotFoundError, NotADirectoryError):  # not there (a store then makes it, or fails to)
        return None
    except OSError as exc:
        return f"{path} cannot be examined ({exc})"
    me = os.getuid() if hasattr(os, "getuid") else None
    if me is not None and uid not in (me, 0):
        return f"{path} is owned by uid {uid}, not by this user (uid {me}) or root"
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by its group or others (mode {stat.S_IMODE(mode):o})"
    return None


def _usable_cache_dir() -> Path | None:
    """The disk cache's directory when the disk cache is on and the directory may be trusted (or does not exist
    yet); else None, reported once for an untrusted directory."""
    if not disk_cache_enabled():
        return None
    directory = cache_dir()
    problem = _trust_problem(directory)
    if problem is None:
        return directory
    _warn_once(("untrusted", str(directory)), "mla_cute: not using the compile cache in %s: %s; kernels compile in "
               "memory (make it yours and not writable by group or others, e.g. chmod go-w, or set "
               "MLA_CUTE_CACHE_DIR to another folder)", directory, problem)
    return None


def _seal(path: Path) -> None:
    """Take group and other write permission off a file about to be published."""
    os.chmod(path, stat.S_IMODE(os.stat(path).st_mode) & ~(stat.S_IWGRP | stat.S_IWOTH))


def _sidecar_text(data: bytes) -> str:
    return f"{len(data)} {hashlib.sha256(data).hexdigest()}\n"


def _entry_problem(obj: Path, side: Path, trusted: bool = False) -> str | None:
    """Why the entry ``obj`` must not be loaded (None when it matches its sidecar ``side``: size and sha256, then
    any further fields, ``_sidecar_fields``).  Unless ``trusted`` (the package's kernels), both files must pass
    ``_trust_problem`` first."""
    for path in () if trusted else (side, obj):
        problem = _trust_problem(path)
        if problem is not None:
            return problem
    try:
        size, digest = side.read_text().split()[:2]
        size = int(size)
    except FileNotFoundError:
        return "its checksum file is missing"
    except (OSError, ValueError) as exc:
        return f"its checksum file is unreadable ({exc})"
    what = "the library" if obj.suffix == ".so" else "the object"
    try:
        data = obj.read_bytes()
    except OSError as exc:
        return f"{what} is unreadable ({exc})"
    if len(data) != size:
        return f"{what} has {len(data)} bytes, its checksum file says {size}"
    if hashlib.sha256(data).hexdigest() != digest:
        return f"{what} does not match its checksum"
    return None


def _sidecar_fields(side: Path) -> list:
    return side.read_text().split()[2:]


def _load_from_disk(name: str, directory: Path | None = None):
    """The cached function ``name`` of ``directory`` (the disk cache's by default, which must have passed
    ``_usable_cache_dir``), or None (absent, or bad: then reported once, to be rebuilt).  The entry is its object;
    where it also has a sound shared library, that is what loads (no DSL import).  The package's kernels
    (``directory`` given) are trusted and never repaired; the disk cache's files must pass ``_trust_problem``, and
    their library is linked again where it is bad or missing."""
    own = directory is None
    directory = cache_dir() if own else directory
    obj, side = directory / f"{name}.o", directory / f"{name}.sum"
    if not obj.exists() and not side.exists():
        return None
    problem = _entry_problem(obj, side, trusted=not own)
    if problem is None:
        fn = _load_linked(directory, name, repair=own)
        if fn is not None:
            return fn
        try:
            return _load_module(obj, name)
        except Exception as exc:  # a checked object that still does not load (a foreign file): rebuild
            problem = f"it does not load ({exc})"
    _warn_once(("entry", str(obj)), "mla_cute: rebuilding the compile cache entry %s: %s", obj, problem)
    return None


def _library_problem(directory: Path, name: str, trusted: bool) -> str | None:
    """Why the entry's shared library must not be loaded: a file that fails ``_entry_problem``, or a sidecar
    whose one further field is not the entry's object's sha256 (a library linked from another object, or by an
    older version that recorded more)."""
    lib, side = directory / f"{name}.so", directory / f"{name}.so.sum"
    problem = _entry_problem(lib, side, trusted)
    if problem is not None:
        return problem
    if _sidecar_fields(side) != [(directory / f"{name}.sum").read_text().split()[1]]:
        return "it was linked from another object or by another version"
    return None


def _load_linked(directory: Path, name: str, repair: bool = False):
    """The entry's function from its shared library, or None (the object loads instead).  A library that fails
    ``_library_problem`` or does not load is reported once a directory; with ``repair`` (the disk cache) it is
    removed and linked again from the checked object, as is a missing one where a compiler is found (an earlier
    link that failed or never ran: each process that loads the entry tries again, and says so)."""
    lib, side = directory / f"{name}.so", directory / f"{name}.so.sum"
    missing = not lib.exists() and not side.exists()
    if not missing:
        problem = _library_problem(directory, name, trusted=not repair)
        if problem is None:
            try:
                return _load_shared(lib, name)
            except Exception as exc:  # e.g. the runtime it was linked against has moved
                problem = f"it does not load ({exc})"
        _warn_once(("library", str(directory)), "mla_cute: not loading %s: %s; %s (reported once for this "
                   "directory)", lib, problem, "linking it again" if repair else "its object loads instead")
        if repair:
            for path in (lib, side):
                with contextlib.suppress(OSError):
                    path.unlink(missing_ok=True)
    if not repair or not _store_shared(directory, name, f"{os.getpid()}.{secrets.token_hex(4)}"):
        return None  # no compiler (silent), or the link failed (reported once)
    if missing:
        _warn_once(("unlinked", str(directory)), "mla_cute: linked the missing shared library %s (an earlier link "
                   "failed or never ran; reported once for this directory)", lib)
    try:
        return _load_shared(lib, name)
    except Exception as exc:
        _warn_once(("relinked", str(directory)), "mla_cute: %s, linked again, does not load (%s); its object "
                   "loads instead", lib, exc)
        return None


def _sweep_stale_tmp(directory: Path) -> None:
    for tmp in directory.glob("*.tmp.*"):
        with contextlib.suppress(OSError):  # gone already, or not ours to remove
            if time.time() - tmp.stat().st_mtime > _STALE_TMP_S:
                tmp.unlink()


def _store_to_disk(name: str, fn, describe: str = "") -> bool:
    """Export ``fn`` as the entry ``name``: object, then sidecar, each published with ``os.replace``; then the
    description of its configuration.  Whether the entry was written."""
    directory = cache_dir()
    token = f"{os.getpid()}.{secrets.token_hex(4)}"
    tmp_obj, tmp_side = directory / f"{name}.{token}.tmp.o", directory / f"{name}.{token}.tmp.sum"
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o755)
        problem = _trust_problem(directory)  # made by another user since it was checked
        if problem is not None:
            raise PermissionError(problem)
        _sweep_stale_tmp(directory)
        fn.export_to_c(str(tmp_obj), function_name=name)
        tmp_side.write_text(_sidecar_text(tmp_obj.read_bytes()))
        _seal(tmp_obj)
        _seal(tmp_side)
        os.replace(tmp_obj, directory / f"{name}.o")
        os.replace(tmp_side, directory / f"{name}.sum")
        _store_shared(directory, name, token)
        (directory / f"{name}.txt").write_text(f"{describe}\n{_build_stamp()}\n")
        _seal(directory / f"{name}.txt")
        return True
    except Exception as exc:  # the kernel is compiled and usable; only its persistence failed
        _warn_once(("store", str(directory)), "mla_cute: could not write the compile cache in %s (%s: %s)",
                   directory, type(exc).__name__, exc)
        return False
    finally:
        for tmp in (tmp_obj, tmp_side):
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)


def _store_shared(directory: Path, name: str, token: str) -> bool:
    """Beside the entry's object, its shared library (``_link_shared``) and the library's sidecar (size, sha256,
    the object's sha256); without a compiler, or when linking fails (reported once), the object alone.  Whether
    a library was written."""
    tmp_lib, tmp_side = directory / f"{name}.{token}.tmp.so", directory / f"{name}.{token}.tmp.so.sum"
    try:
        if not _link_shared(directory / f"{name}.o", tmp_lib):
            return False
        obj_digest = (directory / f"{name}.sum").read_text().split()[1]
        tmp_side.write_text(_sidecar_text(tmp_lib.read_bytes()).rstrip("\n") + f" {obj_digest}\n")
        _seal(tmp_lib)
        _seal(tmp_side)
        os.replace(tmp_lib, directory / f"{name}.so")
        os.replace(tmp_side, directory / f"{name}.so.sum")
        return True
    except Exception as exc:
        _warn_once(("link", str(directory)), "mla_cute: could not link a shared library in %s (%s: %s); entries "
                   "load from their objects", directory, type(exc).__name__, exc)
        return False
    finally:
        for tmp in (tmp_lib, tmp_side):
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)


class _CurrentStderr(logging.Handler):
    """Writes to whatever ``sys.stderr`` is at the time (a notebook or a capture may swap it)."""

    def emit(self, record: logging.LogRecord) -> None:
        import sys

        try:
            sys.stderr.write(self.format(record) + "\n")
        except Exception:
            self.handleError(record)


def _report(msg: str) -> None:
    """Progress of cold compiles: a log line with the configuration (visible unless logging is configured)."""
    if not log.hasHandlers():
        handler = _CurrentStderr()
        handler.setFormatter(logging.Formatter("[mla_cute] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    log.info(msg)


def cached_compile(key: Hashable, build: Callable[[], Any], *, describe: str = "", persistent: bool = True) -> Any:
    """The compiled kernel for ``key``: from memory, else the package's kernels, else the disk cache, else
    ``build()`` (then saved to the disk cache)."""
    fn = _cache.get(key)
    if fn is not None:
        return fn
    with _lock:
        fn = _cache.get(key)
        if fn is not None:
            return fn
        use_disk = persistent and _usable_cache_dir() is not None
        name = _disk_name(key) if use_disk else None
        fn, source = None, "package"
        if persistent:
            fn = _load_from_disk(_disk_name(key), PACKAGED) if PACKAGED.is_dir() else None
        if fn is None:
            fn, source = (_load_from_disk(name) if use_disk else None), "disk"
        if fn is None:
            _report(f"compiling {describe or key}{estimate([key])} ...")
            t0 = time.perf_counter()
            fn = build()
            seconds = time.perf_counter() - t0
            _report(f"compiled {describe or key} in {seconds:.1f} s")
            source = "compiled"
            if use_disk:
                if _store_to_disk(name, fn, describe or repr(key)):
                    _record_compile_time(key, seconds)
        _cache[key] = fn
        _described[key] = f"{describe or key} ({source})"
    return fn


_TIMES = "compile_times.json"  # in the disk cache: the last compile's seconds of each kernel kind, this machine


def _kind(key: Hashable) -> str:
    return str(key[0]) if isinstance(key, tuple) and key else "kernel"


def estimate(keys) -> str:
    """", ~N s" for compiling ``keys`` at once: the slowest of their kinds' last compiles on this machine (as the
    disk cache records them), or "" when none is known."""
    try:
        times = json.loads((cache_dir() / _TIMES).read_text())
        known = [float(times[_kind(k)]) for k in keys if _kind(k) in times]
    except (OSError, ValueError, TypeError):
        return ""
    return f", ~{max(known):.0f} s" if known else ""


def _record_compile_time(key: Hashable, seconds: float) -> None:
    """Keep ``seconds`` as the last compile of ``key``'s kind (best effort: a file another process writes at the
    same moment may keep its own numbers)."""
    path = cache_dir() / _TIMES
    with contextlib.suppress(OSError, ValueError, TypeError):
        try:
            times = json.loads(path.read_text())
        except FileNotFoundError:
            times = {}
        times[_kind(key)] = round(seconds, 1)
        tmp = path.with_name(f"compile_times.{os.getpid()}.{secrets.token_hex(4)}.tmp.json")  # swept if left
        tmp.write_text(json.dumps(times))
        _seal(tmp)
        os.replace(tmp, path)


def disk_cache_enabled() -> bool:
    return os.environ.get("MLA_CUTE_DISK_CACHE", "1") != "0"


def disk_cache_usable() -> bool:
    """Whether kernels are read from and written to the disk cache: it is on and its directory may be trusted
    (``_trust_problem``; an untrusted one is reported once)."""
    return _usable_cache_dir() is not None


def is_warm(key: Hashable) -> bool:
    """Whether the kernel of ``key`` is compiled in this process or has an entry in the package or the disk cache."""
    if key in _cache:
        return True
    name = _disk_name(key)
    if (PACKAGED / f"{name}.o").exists() and (PACKAGED / f"{name}.sum").exists():
        return True
    return disk_cache_usable() and (cache_dir() / f"{name}.o").exists() and (cache_dir() / f"{name}.sum").exists()


def cache_info() -> dict:
    """Which kernel configurations are warm: ``memory``, this process's compiled kernels (each described by
    its configuration and where it came from: compiled here, the disk cache, the package); ``disk`` and
    ``package``, the entries of the disk cache (``cache_dir``) and of the installed package (a wheel built with
    ``MLA_CUTE_BUNDLE_KERNELS``) built for this DSL, arch and kernel sources (loadable without compiling), each by
    its configuration; ``disk_other``, the disk cache's entries of other versions or sources (a cold compile
    for this install); ``directory``, the disk cache's folder (one that is not trusted, ``_trust_problem``,
    lists no entries)."""
    with _lock:
        memory = sorted(_described.values())
    stamp = _build_stamp()
    disk, other = _entries(cache_dir(), stamp) if _trust_problem(cache_dir()) is None else ([], 0)
    package, _ = _entries(PACKAGED, stamp)
    return dict(memory=memory, disk=disk, disk_other=other, package=package, directory=str(cache_dir()))


def _entries(directory: Path, stamp: str) -> tuple:
    """The configurations of ``directory``'s entries built with ``stamp``, and the count of the others."""
    current, other = [], 0
    for text in sorted(directory.glob("k*.txt")) if directory.is_dir() else ():
        lines = text.read_text().splitlines()
        if len(lines) == 2 and lines[1] == stamp and text.with_suffix(".o").exists():
            current.append(lines[0])
        else:
            other += 1
    return current, other


def clear_memory_cache() -> None:
    """Forget the compiled kernels of this process (the disk cache stays)."""
    with _lock:
        _cache.clear()
        _described.clear()
