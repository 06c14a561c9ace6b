"""The fp8rl command line: `bench fp8` runs and prints a table whose ratios match its times."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from bench.fp8 import LLM_SHAPES, SQUARE_SHAPES, parse_shapes
from fp8rl.cli import app
from tests.helpers import tiny_spec, wait_for

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


def test_run_rejects_a_bad_spec_with_the_field_path(tmp_path: Path) -> None:
    spec = tmp_path / "bad.yaml"
    spec.write_text("rollout:\n  group_size: 0\nprecision:\n  recipe: fp16\n")
    result = runner.invoke(app, ["run", str(spec)])
    assert result.exit_code == 2
    assert "rollout.group_size" in result.output and "precision.recipe" in result.output
    assert "'bf16', 'fp8-gen' or 'fp8-e2e'" in result.output


def test_run_rejects_a_bad_override(tmp_path: Path) -> None:
    spec = tmp_path / "ok.yaml"
    spec.write_text("steps: 1\n")
    result = runner.invoke(app, ["run", str(spec), "--recipe", "fp4"])
    assert result.exit_code == 2 and "precision.recipe" in result.output


def test_set_overrides_any_field_and_names_what_is_wrong() -> None:
    """--set KEY=VALUE: a dotted path to an existing field, the value read as YAML and validated
    by the spec like the file; a typo names the level it failed at and the fields there."""
    from fp8rl.run import apply_overrides
    from rljob.spec import SpecError, parse_spec

    spec = parse_spec(tiny_spec(steps=5), "test")
    sets = ["precision.fp8_kv_cache=true", "precision.keep_bf16_layers=[1, 0]", "rollout.max_new_tokens=7"]
    changed = apply_overrides(spec, {"set": sets, "recipe": "fp8-gen"})
    assert changed.precision.fp8_kv_cache is True and changed.precision.keep_bf16_layers == (1, 0)
    assert changed.rollout.max_new_tokens == 7 and changed.precision.recipe == "fp8-gen"
    assert spec.precision.fp8_kv_cache is False  # the loaded spec is left as it was
    with pytest.raises(
        SpecError,
        match=r"--set precision.fp8_kv_cach: precision has no field 'fp8_kv_cach' \(fields: .*fp8_kv_cache",
    ):
        apply_overrides(spec, {"set": ["precision.fp8_kv_cach=true"]})
    with pytest.raises(SpecError, match=r"expected KEY=VALUE"):
        apply_overrides(spec, {"set": ["precision.fp8_kv_cache"]})
    with pytest.raises(
        SpecError, match=r"--set steps.x: steps has no field 'x' \(fields: none: it is a value\)"
    ):
        apply_overrides(spec, {"set": ["steps.x=1"]})
    with pytest.raises(SpecError, match=r"rollout.max_new_tokens"):  # the spec's own validation
        apply_overrides(spec, {"set": ["rollout.max_new_tokens=-3"]})


def test_run_refuses_a_fault_drill_it_cannot_do_before_starting_ray(tmp_path: Path) -> None:
    spec = tmp_path / "ok.yaml"
    spec.write_text(yaml.safe_dump(tiny_spec(steps=5)))
    out = tmp_path / "run"
    bad = runner.invoke(app, ["run", str(spec), "--output", str(out), "--inject-fault", "generator:melt@2"])
    assert bad.exit_code == 2 and "KIND 'melt' is not one of kill, raise, hang, engine" in bad.output
    late = runner.invoke(app, ["run", str(spec), "--output", str(out), "--inject-fault", "trainer1:kill@9"])
    assert late.exit_code == 2 and "steps 1-5 and 1 trainer(s)" in late.output
    assert not (out / "metrics.jsonl").exists()


def test_run_prints_an_error_that_looks_like_markup_as_it_is(tmp_path: Path) -> None:
    """An error's text is printed, not read as Rich markup: gloo's errors name their source file in
    brackets (``[/__w/.../pair.cc:553]``), which Rich took for a closing tag and crashed on, hiding
    the error itself."""
    spec = tmp_path / "ok.yaml"
    spec.write_text(yaml.safe_dump(tiny_spec(steps=5)))
    bad = runner.invoke(app, ["run", str(spec), "--inject-fault", "generator:[/gloo/pair.cc:553]@2"])
    assert bad.exit_code == 2, bad.output
    assert "'generator:[/gloo/pair.cc:553]@2': expected ROLE[INDEX]:KIND@STEP" in bad.output


@pytest.mark.parametrize("raised", ["NonFiniteError", "GraderFailure"])
def test_a_run_that_fails_on_its_way_is_not_a_bad_spec(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, raised: str
) -> None:
    """A non-finite FP8 value (a ValueError, from an actor) or a failing grader ends the run with
    exit 1 and says so; exit 2 stays for what the user must fix in the spec."""
    from workers.fp8.guard import NonFiniteError
    from workers.job import driver
    from workers.tasks.grading import GraderFailure

    error = {"NonFiniteError": NonFiniteError, "GraderFailure": GraderFailure}[raised]

    def fail(*args: Any, **kwargs: Any) -> None:
        raise error("model.layers.0.mlp.down_proj: input: 3 non-finite values at step 7")

    monkeypatch.setattr(driver, "run", fail)
    spec = tmp_path / "ok.yaml"
    spec.write_text(yaml.safe_dump(tiny_spec(steps=5)))
    result = runner.invoke(app, ["run", str(spec), "--no-progress"])
    assert result.exit_code == 1, result.output
    assert "the run failed: model.layers.0.mlp.down_proj: input: 3 non-finite values" in result.output


@pytest.mark.parametrize("where", ["actor", "driver"])
def test_a_value_error_is_a_bad_spec_only_when_the_driver_raised_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A ValueError raised inside an actor (Ray re-raises it as a RayTaskError that is also a
    ValueError) is a failure of the run, exit 1, with the actor's traceback; one the driver raises
    before the run (a spec it refuses) stays a bad spec, exit 2."""
    from ray.exceptions import RayTaskError

    from workers.job import driver

    cause = ValueError("shapes (4, 7) and (8, 3) cannot be multiplied")
    try:
        raise cause
    except ValueError:
        traceback = 'Traceback (most recent call last):\n  File "trainer.py", line 9, in train_step'
    raised: Exception = (
        RayTaskError("TrainerWorker.train", traceback, cause).as_instanceof_cause()
        if where == "actor"
        else cause
    )
    assert isinstance(raised, ValueError)

    def fail(*args: Any, **kwargs: Any) -> None:
        raise raised

    monkeypatch.setattr(driver, "run", fail)
    spec = tmp_path / "ok.yaml"
    spec.write_text(yaml.safe_dump(tiny_spec(steps=5)))
    result = runner.invoke(app, ["run", str(spec), "--no-progress"])
    if where == "actor":
        assert result.exit_code == 1, result.output
        assert "the run failed in an actor" in result.output
        assert 'File "trainer.py", line 9, in train_step' in result.output
    else:
        assert result.exit_code == 2, result.output
        assert "error: shapes (4, 7) and (8, 3) cannot be multiplied" in result.output


@pytest.mark.slow
def test_run_end_to_end_with_overrides(tmp_path: Path) -> None:
    spec = tmp_path / "tiny.yaml"
    spec.write_text(yaml.safe_dump(tiny_spec(steps=50)))
    out = tmp_path / "run"
    result = runner.invoke(app, ["run", str(spec), "--recipe", "bf16", "--steps", "2", "--output", str(out)])
    assert result.exit_code == 0, result.output
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    assert json.loads((out / "spec.resolved.json").read_text())["precision"]["recipe"] == "bf16"
    again = runner.invoke(app, ["run", str(spec), "--steps", "2", "--output", str(out)])
    assert again.exit_code == 2 and "--resume" in again.output


def _fake_run(path: Path, recipe: str, rewards: list[float], tmpe: list[float]) -> Path:
    path.mkdir()
    (path / "spec.resolved.json").write_text(json.dumps({"precision": {"recipe": recipe}}))
    rows = [
        {
            "step": i + 1,
            "reward/mean": r,
            "mismatch/token_mult_prob_error": t,
            "throughput/generation_tokens_per_s": 100.0,
            "throughput/train_tokens_per_s": 50.0,
            "mismatch/gen_kl_error": 0.0,
            "mismatch/is_oob_ratio": 0.0,
        }
        for i, (r, t) in enumerate(zip(rewards, tmpe, strict=True))
    ]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_report_draws_a_png_and_prints_final_reward_and_mismatch(tmp_path: Path) -> None:
    # 12 steps, fewer than 2 x 10: first and final are the two halves of 6 steps, so they share none.
    # first 6: 0.1; last 6: (0.1*4 + 0.7*2)/6 = 1.8/6 = 0.3
    a = _fake_run(tmp_path / "a", "bf16", [0.1] * 10 + [0.7, 0.7], [1.0] * 6 + [1.02] * 6)
    b = _fake_run(tmp_path / "b", "fp8-e2e", [0.2] * 12, [1.01] * 12)
    png = tmp_path / "report.png"
    result = runner.invoke(app, ["report", str(a), str(b), "-o", str(png)])
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    line_a = next(x for x in result.output.splitlines() if x.startswith("a (bf16)"))
    assert line_a.split()[-3:] == ["0.100", "0.300", "1.01000"]  # mean tmpe (6*1.0 + 6*1.02)/12
    bad = runner.invoke(app, ["report", str(tmp_path)])
    assert bad.exit_code == 2 and "no metrics.jsonl" in bad.output


def test_report_prints_the_last_validation_accuracy(tmp_path: Path) -> None:
    a = _fake_run(tmp_path / "a", "bf16", [0.1] * 6, [1.0] * 6)
    rows = [json.loads(x) for x in (a / "metrics.jsonl").read_text().splitlines()]
    rows[2].update({"val/accuracy": 0.25, "val/reward_mean": 0.3})  # validated at steps 3 and 6
    rows[5].update({"val/accuracy": 0.5, "val/reward_mean": 0.6})
    (a / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    b = _fake_run(tmp_path / "b", "fp8-e2e", [0.2] * 6, [1.01] * 6)  # no validation
    result = runner.invoke(app, ["report", str(a), str(b), "-o", str(tmp_path / "r.png")])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split()[-2:] == ["val", "accuracy"]
    assert next(x for x in lines if x.startswith("a (bf16)")).split()[-1] == "0.500"
    assert next(x for x in lines if x.startswith("b (fp8-e2e)")).split()[-1] == "-"


def test_report_gives_mean_and_spread_over_seeds_per_recipe(tmp_path: Path) -> None:
    # bf16 seeds: final rewards 0.2 and 0.4 -> mean 0.3, sample std sqrt(2 * 0.1^2 / 1) = 0.1414;
    # token_mult_prob_error 1.0 and 1.02 -> 1.01 +- 0.01414. fp8-e2e: one run, std 0.
    runs = [
        _fake_run(tmp_path / "bf16-seed0", "bf16", [0.2] * 10, [1.0] * 10),
        _fake_run(tmp_path / "bf16-seed1", "bf16", [0.4] * 10, [1.02] * 10),
        _fake_run(tmp_path / "e2e-seed0", "fp8-e2e", [0.3] * 10, [1.01] * 10),
    ]
    result = runner.invoke(app, ["report", *map(str, runs), "-o", str(tmp_path / "r.png")])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    bf16 = next(x for x in lines if x.startswith("bf16 ")).split()
    assert bf16[:8] == ["bf16", "2", "0.300", "+-", "0.141", "1.01000", "+-", "0.01414"]
    e2e = next(x for x in lines if x.startswith("fp8-e2e ")).split()
    assert e2e[:5] == ["fp8-e2e", "1", "0.300", "+-", "0.000"]


@pytest.mark.slow
def test_ctrl_c_stops_after_the_step_with_a_checkpoint_and_resume_finishes(tmp_path: Path) -> None:
    """SIGINT to the whole process group, as a terminal's Ctrl-C sends it (Ray's workers included)."""
    import os
    import signal
    import subprocess
    import sys

    spec = tmp_path / "tiny.yaml"
    spec.write_text(yaml.safe_dump(tiny_spec(steps=10000, checkpoint_interval=10000)))
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "fp8rl", "run", str(spec), "--output", str(out), "--no-progress"]
    proc = subprocess.Popen(
        cmd, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    metrics = out / "metrics.jsonl"

    def steps_done() -> int:
        assert proc.poll() is None, proc.communicate()[0]
        return metrics.read_text().count("\n") if metrics.exists() else 0

    wait_for(steps_done, "two steps of the run", lambda n: n >= 2, timeout=240)
    os.killpg(proc.pid, signal.SIGINT)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, output
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1))
    ckpt = json.loads(next((out / "checkpoints").glob("step_*/state.json")).read_text())
    assert ckpt["step"] == steps[-1]  # the stop saved the step it finished
    resumed = runner.invoke(
        app, ["run", str(spec), "--output", str(out), "--resume", "--steps", str(steps[-1] + 1)]
    )
    assert resumed.exit_code == 0, resumed.output
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == [*steps, steps[-1] + 1]


def _tiny_bench_spec(tmp_path: Path, prompts: int, new_tokens: int) -> Path:
    spec = tmp_path / "tiny.yaml"
    spec.write_text(
        "model: {tiny: {hidden_size: 64, intermediate_size: 128, num_layers: 2}}\n"
        "task: {params: {min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}, size: 20}\n"
        f"rollout: {{prompts_per_step: {prompts}, group_size: 4, max_new_tokens: {new_tokens}}}\n"
    )
    return spec


@pytest.mark.slow
def test_bench_mismatch_compares_recipes_on_the_same_weights(tmp_path: Path) -> None:
    spec = _tiny_bench_spec(tmp_path, prompts=8, new_tokens=6)
    bad = runner.invoke(app, ["bench", "mismatch", str(spec), "--checkpoint", str(tmp_path)])
    assert bad.exit_code == 2 and "no trainer.pt in that directory" in bad.output
    result = runner.invoke(app, ["bench", "mismatch", str(spec), "--batches", "2"])
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.output.splitlines()[1:]]
    values = {row[0]: float(row[1]) for row in rows}  # recipe: mean over the batches
    assert set(values) == {"bf16", "fp8-gen", "fp8-e2e"}
    assert all(float(r[4]) <= float(r[1]) <= float(r[5]) for r in rows)  # min <= mean <= max
    # BF16 on both sides differs only by rounding; FP8 generation against a BF16 trainer adds the
    # weights' and activations' quantization error
    assert 1.0 <= values["bf16"] < values["fp8-gen"]
    # one recipe alone: the same prompts and seeds, so the same numbers as in the full comparison
    alone = runner.invoke(app, ["bench", "mismatch", str(spec), "--batches", "2", "--recipes", "fp8-gen"])
    assert alone.exit_code == 0, alone.output
    assert [line.split() for line in alone.output.splitlines()[1:]] == [r for r in rows if r[0] == "fp8-gen"]
    bad = runner.invoke(app, ["bench", "mismatch", str(spec), "--recipes", "fp8-gen,fp4"])
    assert bad.exit_code == 2 and "--recipes 'fp8-gen,fp4'" in bad.output
    bad = runner.invoke(app, ["bench", "mismatch", str(spec), "--kv-cache", "on,fp16"])
    assert bad.exit_code == 2 and "--kv-cache fp16" in bad.output
    args = ["--batches", "1", "--kv-cache", "on,bf16-attn"]
    result = runner.invoke(app, ["bench", "mismatch", str(spec), *args])
    assert result.exit_code == 0, result.output
    kv = {row[0]: float(row[1]) for row in (line.split() for line in result.output.splitlines()[1:])}
    variants = {f"{r}{m}" for r in ("bf16", "fp8-gen", "fp8-e2e") for m in ("+fp8kv", "+fp8kv-bf16attn")}
    assert set(kv) == variants
    # a trainer that reads K/V as the FP8 cache holds them computes what the generator did; one
    # that attends over BF16 K/V does not
    assert kv["bf16+fp8kv"] < kv["bf16+fp8kv-bf16attn"]


def test_bench_gradients_prints_table_and_writes_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from workers.tasks import Task

    spec = _tiny_bench_spec(tmp_path, prompts=4, new_tokens=3)
    # bad options fail before any model is built, naming the option
    bad = runner.invoke(app, ["bench", "gradients", str(spec), "--variants", "fp16"])
    assert bad.exit_code == 2 and "--variants 'fp16'" in bad.output
    bad = runner.invoke(app, ["bench", "gradients", str(spec), "--checkpoint", str(tmp_path / "nope")])
    assert bad.exit_code == 2 and "--checkpoint" in bad.output and "step_N" in bad.output
    # a random policy never answers right: score by the response's bytes so groups have a signal
    monkeypatch.setattr(Task, "score", lambda self, text, problem: float(sum(text.encode()) % 2))
    out = tmp_path / "g.json"
    args = ["--variants", "bf16,hybrid", "--keep-bf16-layers", "1,0", "--device", "cpu", "--json", str(out)]
    result = runner.invoke(app, ["bench", "gradients", str(spec), *args])
    assert result.exit_code == 0, result.output
    assert "keep 1,0 decoder layers in BF16" in result.output
    rows = {
        line.split()[0]: line.split() for line in result.output.splitlines() if line.startswith("layers.")
    }
    assert rows["layers.0.mlp.up_proj.weight"][2] == "-" and rows["layers.1.mlp.up_proj.weight"][2] == "yes"
    data = json.loads(out.read_text())
    assert data["spec"] == str(spec) and data["checkpoint"] is None and data["batch"]["sequences"] == 16
    assert set(data["variants"]) == {"bf16", "hybrid"}
    layers = data["variants"]["hybrid"]["layers"]
    assert (
        layers["model.layers.1.mlp.up_proj.weight"]["fp8"]
        and not layers["model.layers.0.mlp.up_proj.weight"]["fp8"]
    )
    assert all(0.9 < layer["cos"] <= 1.0 for layer in layers.values())


def test_run_refuses_an_engine_that_is_not_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("workers.engines.factory._installed", lambda module: False)
    spec = tmp_path / "vllm.yaml"
    spec.write_text(
        "precision: {recipe: bf16}\nresources: {generator_engine: vllm, gpus_per_generator: 1}\n"
        f"output_dir: {tmp_path / 'out'}\n"
    )
    result = runner.invoke(app, ["run", str(spec), "--no-progress"])
    assert result.exit_code == 2, result.output
    assert "resources.generator_engine=vllm" in result.output and "worker image" in result.output


@pytest.mark.slow
def test_bench_kernels_and_rollout_options() -> None:
    args = ["bench", "kernels", "--device", "cpu", "--tokens", "16", "--shapes", "128x256"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[1].split()[:3] == ["128", "256", "16"]
    bad = runner.invoke(app, ["bench", "kernels", "--shapes", "128"])
    assert bad.exit_code == 2 and "--shapes '128'" in bad.output
    result = runner.invoke(app, [*args, "--kinds", "bf16,quantize_dual_pow2"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0].split()[3:7] == ["bf16", "us", "quantize_dual_pow2", "us"]
    bad = runner.invoke(app, ["bench", "kernels", "--kinds", "bf16,int4"])
    assert bad.exit_code == 2 and "--kinds 'bf16,int4': int4 unknown; choose from bf16," in bad.output
    bad = runner.invoke(app, ["bench", "rollout", "--device", "cpu", "--decode", "graph"])
    assert bad.exit_code == 2 and "--decode graph needs a CUDA GPU" in bad.output
    bad = runner.invoke(app, ["bench", "rollout", "--device", "cpu", "--kv-cache", "int8"])
    assert bad.exit_code == 2 and "--kv-cache int8" in bad.output
    bad = runner.invoke(app, ["bench", "rollout", "--device", "cpu", "--variants", "fp8/e4m3"])
    assert bad.exit_code == 2 and "--variants fp8/e4m3: give WEIGHTS/KV pairs" in bad.output
    bad = runner.invoke(app, ["bench", "rollout", "--variants", "fp8/fp8", "--kv-cache", "fp8"])
    assert bad.exit_code == 2 and "give --variants or --kv-cache, not both" in bad.output
    result = runner.invoke(
        app, ["bench", "rollout", "--device", "cpu", "--prompts", "2", "--new-tokens", "2", "--repeat", "1",
              "--kv-cache", "bf16"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.stdout.splitlines()[2:]]
    assert [(r[0], r[1], r[2]) for r in rows] == [("bf16", "bf16", "eager"), ("fp8", "bf16", "eager")]
    progress = [ln for ln in result.stderr.splitlines() if ln.startswith("[")]  # one per variant, as it ends
    assert [line.split(":")[0] for line in progress] == [
        "[1/2] weights bf16, KV bf16, eager",
        "[2/2] weights fp8, KV bf16, eager",
    ]
