"""``python -m mla_cute.precompile``: the named shape sets are valid configurations, the runner builds each once
(in parallel processes with ``--jobs``), and the module stays callable as ``mla_cute.precompile``."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

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
    for name, configs in cli.SETS.items():
        seen.clear()
        assert mla_cute.precompile(configs) == len(configs) == len(seen)
    assert {a[5] for kind, a in seen} == {"V4"} and all(a[6] for kind, a in seen)  # V4 with its extra cache
    assert len(cli.SETS["deepseek-v32-sparse"]) == 32 and len(cli.SETS["deepseek-v3-dense"]) == 32


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
    assert "deepseek-v32-sparse: 32 configurations" in capsys.readouterr().out
    assert cli.main(["--sets", "deepseek-v4-sparse", "--dry-run"]) == 0
    assert capsys.readouterr().out.count("kv_format=V4") == 16
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
