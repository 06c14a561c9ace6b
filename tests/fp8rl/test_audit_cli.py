"""``fp8rl audit`` on a tiny job: the audit table with every linear's weight and input statistics."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from fp8rl.audit import calibrated_audit
from fp8rl.cli import app
from rljob.spec import load_spec

runner = CliRunner()
SPEC = (
    "model: {tiny: {hidden_size: 64, intermediate_size: 128, num_layers: 2}}\nprecision: {recipe: fp8-e2e}\n"
)


def test_the_audit_command_prints_the_statistics_columns(tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(SPEC)
    result = runner.invoke(app, ["audit", str(spec), "--prompts", "3", "--top", "4"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "w amax" in lines[0] and "outlier@ch" in lines[0]
    # 3 short prompts are far under 1000 tokens: the nearest-rank p99.9 is each channel's max,
    # so every ratio is exactly 1, and the footer says why
    assert "(under 1000 tokens every ratio is 1: more --prompts)" in result.output
    q = next(line for line in lines if line.startswith("model.layers.0.self_attn.q_proj "))
    assert " 1@0 " in q
    top = lines[lines.index("top 4 outlier ratios:") + 1 :]
    assert len(top) == 4


def test_with_over_1000_tokens_ratios_are_at_least_one_and_some_exceed_it(tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(SPEC)
    audit = calibrated_audit(load_spec(spec), prompts=160)
    tokens = int(audit.calibration.split(", ")[1].split()[0])
    assert tokens >= 1000 and "under" not in audit.calibration
    linears = [r for r in audit.rows if r.kind in ("linear", "lm_head")]
    ratios = [r.outlier_ratio for r in linears]
    assert all(r is not None and r >= 1.0 for r in ratios)  # a max is never below a percentile
    assert max(r for r in ratios if r is not None) > 1.0
    assert all(r.input_amax is not None and r.weight_amax is not None for r in linears)
