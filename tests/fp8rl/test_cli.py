"""The fp8rl command line: `bench fp8` runs and prints a table whose ratios match its times."""

from __future__ import annotations

import json
import re
from pathlib import Path

from typer.testing import CliRunner

from fp8rl.cli import app
from workers.fp8.bench import LLM_SHAPES, SQUARE_SHAPES, parse_shapes

runner = CliRunner()


def test_bench_fp8_prints_table_and_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = runner.invoke(
        app, ["bench", "fp8", "--shapes", "16x128x256,4x256x128", "--repeat", "2", "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "bf16/fp8" in result.output and "torch" in result.output
    data = json.loads(out.read_text())
    assert [(r["tokens"], r["in_features"], r["out_features"]) for r in data["rows"]] == [
        (16, 128, 256),
        (4, 256, 128),
    ]
    for row in data["rows"]:  # the printed ratio is bf16 time over fp8 time
        assert row["bf16_ms"] > 0 and row["fp8_ms"] > 0
        assert abs(row["speedup"] - row["bf16_ms"] / row["fp8_ms"]) < 1e-9
    printed = re.findall(r"(\d+\.\d+)x", result.output)
    assert len(printed) == 2


def test_bench_train_mode_runs() -> None:
    result = runner.invoke(app, ["bench", "fp8", "--shapes", "8x128x128", "--mode", "train", "--repeat", "1"])
    assert result.exit_code == 0, result.output
    assert "train" in result.output


def test_bad_shapes_and_mode_exit_2_with_a_message() -> None:
    result = runner.invoke(app, ["bench", "fp8", "--shapes", "64x4096"])
    assert result.exit_code == 2 and "TOKENSxINxOUT" in result.output
    result = runner.invoke(app, ["bench", "fp8", "--shapes", "8x128x128", "--mode", "infer"])
    assert result.exit_code == 2 and "mode" in result.output


def test_shape_sets_are_the_ones_the_issue_names() -> None:
    # tokens 1, 64, 4096; hidden 4096 -> 14336 and back; and 8192^3
    assert sorted({m for m, _, _ in LLM_SHAPES}) == [1, 64, 4096]
    assert {(k, n) for _, k, n in LLM_SHAPES} == {(4096, 14336), (14336, 4096)}
    assert SQUARE_SHAPES == [(8192, 8192, 8192)]
    assert parse_shapes("all") == LLM_SHAPES + SQUARE_SHAPES


def test_version() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.startswith("fp8rl ")
