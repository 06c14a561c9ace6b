"""``fp8rl bench host`` (bench/host.py): the forward GEMM's host time, measured on meta tensors
with the kernel stubbed. No timing is asserted (this machine is shared); what each row is, is."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from bench import host
from fp8rl.cli import app


def test_each_shape_gets_both_timings_and_the_kernel_the_profile_plans() -> None:
    rows = host.run("sm90-cuda13.0", calls=5, rounds=1)
    assert [r[0] for r in rows] == [f"{m}x{k}x{n}" for m, k, n in host.SHAPES]
    assert all(r[1] > 0 and r[2] > 0 and r[3] == "cublas_blockwise" for r in rows)
    # an SM89 plans block scales as emulation (its rowwise kernel writes BF16 only): both paths
    # then run the general code, on meta
    assert {r[3] for r in host.run("sm89-cuda12.8", calls=2, rounds=1)} == {"emulate"}


def test_each_wgrad_shape_gets_both_timings_and_the_kernel_the_profile_plans() -> None:
    rows = host.run_wgrad("sm90-cuda13.0", calls=5, rounds=1)
    assert [r[0] for r in rows] == [f"{t}x{n}x{k}" for t, n, k in host.WGRAD_SHAPES]
    assert all(r[1] > 0 and r[2] > 0 and r[3] == "cublas_blockwise" for r in rows)
    assert {r[3] for r in host.run_wgrad("sm89-cuda12.8", calls=2, rounds=1)} == {"emulate"}


def test_the_command_prints_the_table_and_refuses_bad_options() -> None:
    runner = CliRunner()
    out = runner.invoke(app, ["bench", "host", "--calls", "3", "--rounds", "1"])
    assert out.exit_code == 0, out.output
    assert out.output.count("| cublas_blockwise |") == len(host.SHAPES) + len(host.WGRAD_SHAPES)
    bad = runner.invoke(app, ["bench", "host", "--profile", "sm91"])
    assert bad.exit_code == 2 and "--profile 'sm91'" in bad.output
    with pytest.raises(ValueError, match=r"sm90-cuda13\.0"):
        host.run("h100")
