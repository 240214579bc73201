"""``python -m mla_cute.precompile``: the named shape sets are valid configurations, the runner builds each once
(in parallel processes with ``--jobs``), and the module stays callable as ``mla_cute.precompile``."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
import torch

import mla_cute
from mla_cute import _precompile_cli as cli


def _fake_build(cfg):
    """A build that takes no time (picklable, for the spawned processes)."""
    return 0.0


def test_named_sets_are_valid_configurations(monkeypatch):
    from mla_cute.backends import cute

    seen = []
    monkeypatch.setattr(cute, "precompile_dense", lambda *a: seen.append(("dense", a)))
    monkeypatch.setattr(cute, "precompile_sparse", lambda *a: seen.append(("sparse", a)))
    monkeypatch.setattr(cute, "precompile_writer", lambda *a: seen.append(("writer", a)))
    by_set = {}
    for name, configs in cli.SETS.items():
        seen.clear()
        assert mla_cute.precompile(configs) == len(configs) == len(seen)
        by_set[name] = list(seen)
    for name, fmt, extra in [("deepseek-v4-sparse", "V4", "V4"), ("deepseek-v41-sparse", "V41", "V41_FP4")]:
        sparse = [a for kind, a in by_set[name] if kind == "sparse"]
        assert {(a[5], a[6]) for a in sparse} == {(fmt, extra)}  # with its extra cache
    writers = [a[0] for kind, a in by_set["deepseek-v41-sparse"] if kind == "writer"]
    assert writers == ["V41", "V41", "V41_FP4", "V41_FP4"]
    assert [a for kind, a in by_set["deepseek-v4-sparse"] if kind == "writer"] == [
        ("V4", torch.bfloat16, torch.int32), ("V4", torch.bfloat16, torch.int64)]
    assert len(cli.SETS["deepseek-v32-sparse"]) == 32 + 2 and len(cli.SETS["deepseek-v3-dense"]) == 32


@pytest.mark.parametrize("kind, key", [("dense", "s_q"), ("dense", "h_q"), ("dense", "h_kv"), ("sparse", "s_q"),
                                       ("sparse", "h_q")])
def test_precompile_refuses_a_bool_for_a_size(monkeypatch, kind, key):
    """``s_q=True`` is an int to Python but names no shape: refused (naming the key) before anything is built."""
    from mla_cute.backends import cute

    built = []
    monkeypatch.setattr(cute, "precompile_dense", lambda *a: built.append(a))
    monkeypatch.setattr(cute, "precompile_sparse", lambda *a: built.append(a))
    cfg = dict(dtype=torch.bfloat16, s_q=1, h_q=16, h_kv=1) if kind == "dense" else dict(sparse=True, s_q=1, h_q=64)
    assert mla_cute.precompile([cfg]) == 1 and len(built) == 1
    with pytest.raises(ValueError, match=f"precompile config 0: {key} must be an int >= 1, got True"):
        mla_cute.precompile([dict(cfg, **{key: True})])
    assert len(built) == 1


@pytest.mark.parametrize("configs", [["deepseek-v3-dense"], "deepseek-v3-dense", dict(sparse=True, s_q=1, h_q=64),
                                     [("s_q", 1)]])
def test_precompile_takes_configuration_dicts_not_set_names(configs):
    """A set's name (alone or in a list), a lone dict or anything but dicts: a TypeError saying configurations are
    dicts and where set names go."""
    with pytest.raises(TypeError, match=r"configuration.* dicts.*python -m mla_cute\.precompile --sets"):
        mla_cute.precompile(configs)


def test_precompile_checks_writer_configurations():
    with pytest.raises(ValueError, match="precompile config 0 has unknown keys"):
        mla_cute.precompile([dict(write_cache=True, h_q=64)])
    with pytest.raises(TypeError, match="precompile config 0: slot_dtype must be"):
        mla_cute.precompile([dict(write_cache=True, slot_dtype=torch.float32)])
    with pytest.raises(ValueError, match="kv_format must be one of"):
        mla_cute.precompile([dict(write_cache=True, kv_format="V5")])


@pytest.mark.parametrize("jobs", [1, 2])
def test_runner_builds_every_configuration_once(jobs):
    out = io.StringIO()
    configs = cli.SETS["deepseek-v32-sparse"][:3]
    cli.run(configs, jobs, build=_fake_build, out=out)
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and all(line.endswith(": 0.0 s") for line in lines)
    assert sorted(line.split("] ", 1)[1] for line in lines) == sorted(f"{cli.describe(c)}: 0.0 s" for c in configs)


def test_command_line(capsys):
    assert cli.main(["--list"]) == 0
    assert "deepseek-v32-sparse: 34 configurations" in capsys.readouterr().out
    assert cli.main(["--sets", "deepseek-v4-sparse", "--dry-run"]) == 0
    assert capsys.readouterr().out.count("kv_format=V4") == 16 + 2  # and its two writers
    for bad in (["--sets", "deepseek-v9"], [], ["--sets", "deepseek-v3-dense", "--jobs", "0"]):
        with pytest.raises(SystemExit):
            cli.main(bad)
    proc = subprocess.run([sys.executable, "-m", "mla_cute.precompile", "--list"], capture_output=True, text=True)
    assert proc.returncode == 0 and "deepseek-v3-dense: 32 configurations" in proc.stdout


def test_importing_the_command_module_keeps_precompile_callable(monkeypatch):
    import importlib

    from mla_cute.backends import cute

    module = importlib.import_module("mla_cute.precompile")
    seen = []
    monkeypatch.setattr(cute, "precompile_sparse", lambda *a: seen.append(a))
    assert mla_cute.precompile is module and mla_cute.precompile([dict(sparse=True, s_q=1, h_q=64)]) == 1
    assert len(seen) == 1


def _child_jobs(cfg):
    import os

    return float(os.environ.get("MLA_CUTE_COMPILE_JOBS", "0"))


def test_parallel_jobs_build_their_kernels_serially(monkeypatch):
    """With --jobs, each process builds its configuration's kernels itself (no nested process pools)."""
    monkeypatch.delenv("MLA_CUTE_COMPILE_JOBS", raising=False)
    out = io.StringIO()
    cli.run(cli.SETS["deepseek-v3-dense"][:2], 2, build=_child_jobs, out=out)
    assert all(line.endswith(": 1.0 s") for line in out.getvalue().splitlines())
    import os

    assert "MLA_CUTE_COMPILE_JOBS" not in os.environ


@pytest.mark.compile  # imports the kernels' build module (the DSL)
def test_compile_all_builds_cold_kernels_apart_only_when_allowed(monkeypatch):
    import mla_cute.kernels.build as build
    from mla_cute.schedules import SchedulerConfig

    sent, built = [], []
    monkeypatch.setattr(build, "_build_in_processes", lambda cold: sent.append(cold))
    monkeypatch.setattr(build, "is_warm", lambda key: key[1].fixed_cost == 1)
    real = build.compile_scheduler
    monkeypatch.setattr(build, "compile_scheduler", lambda c, options="": built.append(c))
    build.compile_scheduler.builds_in_parallel = True
    build.compile_scheduler.__name__ = "compile_scheduler"
    tasks = [(build.compile_scheduler, SchedulerConfig(fixed_cost=k)) for k in (1, 2, 3, 3)]
    monkeypatch.setenv("MLA_CUTE_COMPILE_JOBS", "4")
    build.compile_all(tasks)
    assert sent == [[("compile_scheduler", SchedulerConfig(fixed_cost=2)), ("compile_scheduler", SchedulerConfig(fixed_cost=3))]]
    assert built == [SchedulerConfig(fixed_cost=k) for k in (1, 2, 3)]  # each once, in order
    monkeypatch.setenv("MLA_CUTE_COMPILE_JOBS", "1")
    build.compile_all(tasks)
    assert len(sent) == 1  # one job: everything here
    monkeypatch.setenv("MLA_CUTE_COMPILE_JOBS", "many")
    with pytest.raises(ValueError, match="MLA_CUTE_COMPILE_JOBS"):
        build.compile_all(tasks)
    assert real.builds_in_parallel


@pytest.mark.compile  # imports the kernels' build module (the DSL)
def test_compile_all_builds_here_when_the_disk_cache_is_not_used(monkeypatch, tmp_path):
    """Child processes hand their kernels over through the disk cache: where it is not used (a directory its group
    or others may write), they would build for nothing, so every kernel is built here."""
    import mla_cute.kernels.build as build
    from mla_cute import jit
    from mla_cute.schedules import SchedulerConfig

    sent, built = [], []
    monkeypatch.setattr(build, "_build_in_processes", lambda cold: sent.append(cold))
    monkeypatch.setattr(jit, "_warned", set())
    monkeypatch.setattr(build, "compile_scheduler", lambda c, options="": built.append(c))
    build.compile_scheduler.builds_in_parallel = True
    build.compile_scheduler.__name__ = "compile_scheduler"
    monkeypatch.setenv("MLA_CUTE_COMPILE_JOBS", "4")
    monkeypatch.setenv("MLA_CUTE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MLA_CUTE_DISK_CACHE", raising=False)
    tasks = [(build.compile_scheduler, SchedulerConfig(fixed_cost=k)) for k in (2, 3)]
    tmp_path.chmod(0o777)
    build.compile_all(tasks)
    assert sent == [] and built == [SchedulerConfig(fixed_cost=k) for k in (2, 3)]
    tmp_path.chmod(0o755)
    build.compile_all(tasks)
    assert len(sent) == 1
