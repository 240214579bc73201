"""Compile-only checks (CPU, sm_90a): the kernels use the Hopper paths we rely on, without spills."""

from __future__ import annotations

import re

import pytest
import torch

pytestmark = pytest.mark.compile

OPTIONS = "--keep-ptx remarks{ptx}"


def _ptxas_report(stderr: str):
    spills = [tuple(map(int, m)) for m in re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", stderr)]
    regs = [int(m) for m in re.findall(r"Used (\d+) registers", stderr)]
    return spills, regs


@pytest.fixture(autouse=True)
def _dump_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CUTE_DSL_DUMP_DIR", str(tmp_path))


@pytest.mark.parametrize(
    "dtype,s_q,h_q,h_kv,causal,schedule",
    [
        (torch.bfloat16, 1, 128, 1, False, "default"),
        (torch.float16, 2, 64, 1, True, "default"),
        (torch.bfloat16, 4, 9, 3, True, "serial"),
    ],
)
def test_dense_decode_uses_wgmma_tma_mbarriers_without_spills(dtype, s_q, h_q, h_kv, causal, schedule, capfd):
    from mla_cute.kernels.build import compile_dense_decode
    from mla_cute.schedules import DEFAULT_DENSE_SCHEDULE, SERIAL_DENSE_SCHEDULE

    sched = DEFAULT_DENSE_SCHEDULE if schedule == "default" else SERIAL_DENSE_SCHEDULE
    fn = compile_dense_decode(dtype, s_q, h_q, h_kv, causal, 64, sched, options=OPTIONS)
    ptx = fn.__ptx__
    assert ptx, "no PTX kept"
    # QK^T over 576 = 36 k-steps of 16, PV over 64 tokens = 4.
    assert ptx.count("wgmma.mma_async") >= 40
    assert "cp.async.bulk.tensor" in ptx
    assert "mbarrier.try_wait" in ptx
    assert "setmaxnreg" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    err = capfd.readouterr().err
    # C7514 / C7517: ptxas serialized the WGMMAs or injected waits (an accumulator read while in flight).
    assert "C7514" not in err and "C7517" not in err, "ptxas serialized WGMMA: " + err[:2000]
    spills, regs = _ptxas_report(err)
    assert spills, "ptxas printed no resource report"
    assert all(s == (0, 0, 0) for s in spills), f"stack frame / spills: {spills}"
    assert max(regs) <= 168, f"registers {regs} exceed the 384-thread, 1-CTA budget"


def test_combine_and_scheduler_compile_without_spills(capfd):
    from mla_cute.kernels.build import compile_combine, compile_scheduler

    compile_combine(torch.bfloat16, 2, 64, 1, options=OPTIONS)
    compile_scheduler(5, options=OPTIONS)
    spills, _ = _ptxas_report(capfd.readouterr().err)
    assert len(spills) == 2 and all(s == (0, 0, 0) for s in spills), spills
