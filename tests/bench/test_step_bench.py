"""``fp8rl bench step`` (bench/step.py) and ``bench sync`` on a real model's workload: the options
parse, every row and ratio is printed, on models small enough to run in seconds. No timing is
asserted (this machine is shared); what the rows are, is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from bench import hf_baseline, step
from fp8rl.cli import app
from workers.engines.protocols import Rollouts

TINY = ["--steps", "1", "--prompts", "2", "--group-size", "2", "--new-tokens", "2"]


def test_recipes_option_picks_the_rows_and_bad_options_exit_2() -> None:
    runner = CliRunner()
    out = runner.invoke(
        app, ["bench", "step", "--model", "tiny", "--device", "cpu", "--recipes", "fp8-e2e", *TINY]
    )
    assert out.exit_code == 0, out.output
    labels = [line.split()[0] for line in out.output.splitlines() if line[:1].isalpha()]
    assert "fp8-e2e" in labels and "fp8-e2e+exact" in labels and "bf16" not in labels
    assert "against plain transformers" not in out.output  # no baseline for a random-init preset
    bad = runner.invoke(app, ["bench", "step", "--model", "tiny", "--recipes", "fp4"])
    assert bad.exit_code == 2 and "'fp4' is not a recipe" in bad.output
    for wrong in ("bf16+pow2", "fp8-e2e+fast"):
        bad = runner.invoke(app, ["bench", "step", "--model", "tiny", "--recipes", wrong])
        assert bad.exit_code == 2 and f"{wrong!r} is not a recipe" in bad.output
    bad = runner.invoke(app, ["bench", "step", "--model", "tiny", "--baseline"])
    assert bad.exit_code == 2 and "--baseline needs a real model" in bad.output
    bad = runner.invoke(app, ["bench", "step", "--model", "/no/such/model"])
    assert bad.exit_code == 2 and "config.json" in bad.output


def test_a_pow2_variant_runs_its_fp8_gemms_in_bf16_on_a_cpu() -> None:
    out = CliRunner().invoke(
        app, ["bench", "step", "--model", "tiny", "--device", "cpu", "--recipes", "bf16,fp8-e2e+pow2", *TINY]
    )
    assert out.exit_code == 0, out.output
    table = out.output[out.output.index("device:") :]  # the progress lines come first
    labels = [line.split()[0] for line in table.splitlines() if line[:1].isalpha()]
    # no exact run with +pow2; "vs", "prefill" and "exact" begin the legend's lines
    assert labels[2:] == ["bf16", "bf16+exact", "fp8-e2e+pow2", "vs", "prefill", "exact"]


def test_hf_train_pass_counts_the_response_tokens_and_leaves_no_gradient() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    config.update({"num_attention_heads": 2, "num_key_value_heads": 1})
    model: Any = LlamaForCausalLM(config)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    batch = Rollouts(
        prompt_ids=torch.tensor([[0, 5, 6], [7, 8, 9]]),
        prompt_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]),
        response_ids=torch.tensor([[1, 2, 0], [3, 0, 0]]),
        response_mask=mask,
        logprobs=torch.zeros(2, 3),
    )
    assert hf_baseline.train_pass(model, batch) == 3
    assert all(p.grad is None for p in model.parameters())
    # generate(): tokens up to and with each row's first stop id (here: stop at every id < 20)
    bf16: Any = model.to(torch.bfloat16)
    n = hf_baseline.generate(bf16, [[5, 6], [7]], 3, tuple(range(20)), 0, seed=1)
    assert 2 <= n <= 6


@pytest.mark.slow
def test_a_real_model_directory_runs_the_examples_batch_with_the_baseline(smollm2_small_dir: Path) -> None:
    runner = CliRunner()
    args = ["bench", "step", "--model", str(smollm2_small_dir), "--device", "cpu", *TINY]
    out = runner.invoke(app, args)
    assert out.exit_code == 0, out.output
    table = out.output[out.output.index("device:") :]  # transformers' loading bars come first
    labels = [line.split()[0] for line in table.splitlines() if line[:1].isalpha()]
    assert labels[:4] == ["device:", "recipe", "bf16", "fp8-e2e"]  # no exact rows for a real model
    for row in ("train: bf16 vs float32", "generation: bf16 vs generate()", "train seconds: fp8-e2e / bf16"):
        assert row in out.output
    sync = runner.invoke(app, ["bench", "sync", "--model", str(smollm2_small_dir), "--repeat", "1"])
    assert sync.exit_code == 0, sync.output
    assert "end-to-end s" in sync.output and sync.output.count("\nfp8 ") == 2


def test_the_real_workload_is_the_examples_batch() -> None:
    from bench.common import REAL_EXAMPLE
    from rljob.spec import load_spec

    spec = load_spec(REAL_EXAMPLE)
    r = spec.rollout
    assert {
        "prompts": r.prompts_per_step,
        "group_size": r.group_size,
        "new_tokens": r.max_new_tokens,
    } == step.REAL_SHAPE
    assert spec.optimizer.micro_batch_size == 64  # what the benchmark's trainers use


def test_the_kv_cache_option_adds_fp8_cache_rows_and_the_decode_time_is_split_from_prefill() -> None:
    runner = CliRunner()
    out = runner.invoke(
        app,
        ["bench", "step", "--model", "tiny", "--device", "cpu", "--recipes", "bf16,fp8-gen",
         "--kv-cache", "bf16,fp8", *TINY],
    )  # fmt: skip
    assert out.exit_code == 0, out.output
    table = out.output[out.output.index("device:") :]
    labels = [line.split()[0] for line in table.splitlines() if line[:1].isalpha()]
    assert labels[2:5] == ["bf16", "bf16+exact", "fp8-gen"] and "fp8-gen+fp8kv" in labels
    assert "bf16+fp8kv" not in labels  # the BF16 recipe keeps its BF16 cache
    assert "prefill s" in table and "decode ms" in table
    for bad, says in (("--kv-cache", "int8"), ("--recipes", "bf16+fp8kv")):
        value = says if bad == "--kv-cache" else "bf16+fp8kv"
        wrong = runner.invoke(app, ["bench", "step", "--model", "tiny", bad, value])
        assert wrong.exit_code == 2, wrong.output
    assert "--kv-cache int8" in runner.invoke(app, ["bench", "step", "--kv-cache", "int8"]).output


def test_decode_time_is_the_generation_less_its_prefill_per_token_step() -> None:
    seconds = {"generation": 1.0, "reward": 0.0, "train": 0.5, "weight_sync": 0.1}
    row = step.StepRow("fp8-e2e", seconds, 0, prefill_s=0.2, decode_steps=4)
    assert row.decode_ms == pytest.approx(200.0)  # (1.0 - 0.2) s over 4 steps, by hand
    assert step.StepRow("bf16", seconds, 0).decode_ms is None  # one token: no decode step


def test_interleaved_steps_take_turns_and_give_the_same_rows() -> None:
    """Built first, then step 0 of each recipe, step 1 of each, ...: the progress lines show the
    turns, and the table has the same rows as one recipe after the other."""
    seen: list[str] = []
    _, rows, _ = step.run(
        "tiny", "cpu", prompts=2, group_size=2, new_tokens=2, steps=1, recipes=("bf16", "fp8-e2e+pow2"),
        progress=seen.append, interleave=True,
    )  # fmt: skip
    order = [line.split(" step ")[0] + line.split(" step ")[1][:1] for line in seen if " step " in line]
    assert order == ["bf160", "bf16+exact0", "fp8-e2e+pow20", "bf161", "bf16+exact1", "fp8-e2e+pow21"]
    assert [r.label for r in rows] == ["bf16", "bf16+exact", "fp8-e2e+pow2"]
