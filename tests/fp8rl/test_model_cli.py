"""``fp8rl model fetch|import``: the directory is the last line of stdout, progress and errors go
to stderr, and an error is one line with exit code 2."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from fp8rl.cli import app
from workers.models.store import MARKER

runner = CliRunner()


def test_fetch_prints_the_directory_last(tmp_path: Path) -> None:
    """A finished directory (its marker written here by hand): printed at once, nothing fetched."""
    done = tmp_path / "models" / "smollm2-135m-instruct"
    done.mkdir(parents=True)
    (done / MARKER).write_text("{}")
    result = runner.invoke(app, ["model", "fetch", "smollm2-135m-instruct", "--home", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-1] == str(done)


def test_fetch_of_an_unknown_model_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = runner.invoke(app, ["model", "fetch", "llama-9000", "--home", str(tmp_path)])
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr.startswith("error: unknown model 'llama-9000'; known: smollm2-135m-instruct")
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_import_of_a_file_that_is_not_gguf_exits_2(tmp_path: Path) -> None:
    text = tmp_path / "notes.gguf"
    text.write_text("hello")
    result = runner.invoke(app, ["model", "import", str(text), "--home", str(tmp_path / "home")])
    assert result.exit_code == 2
    assert result.stderr == f"error: {text} is not a GGUF file (it starts with b'hell', not b'GGUF')\n"
    assert not (tmp_path / "home").exists()


def test_a_run_naming_a_model_directory_that_is_not_there_fails_with_the_field(tmp_path: Path) -> None:
    """Before Ray starts, in one line: not transformers' Hub-id traceback."""
    example = Path(__file__).parents[2] / "examples" / "smollm2-addition.yaml"
    missing = tmp_path / "models" / "smollm2-135m-instruct"
    result = runner.invoke(
        app, ["run", str(example), "--set", f"model.name={missing}", "--output", str(tmp_path / "run")]
    )
    assert result.exit_code != 0
    assert f"model.name: {missing} is not a directory" in result.output
    assert "fp8rl model fetch smollm2-135m-instruct" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "run").exists()
