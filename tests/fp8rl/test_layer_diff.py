"""``fp8rl layer-diff`` on a tiny job: under exact no sampled token and no module differs, with the
initial weights and with a checkpoint's; a spec exact mode cannot hold is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from fp8rl.cli import app

runner = CliRunner()
SPEC = """
model: {tiny: {hidden_size: 64, intermediate_size: 128, num_layers: 2}}
rollout: {max_new_tokens: 8}
precision: {recipe: %s, exact: true}
"""


@pytest.mark.slow
def test_layer_diff_under_exact_finds_nothing_that_differs(tmp_path: Path) -> None:
    for recipe in ("bf16", "fp8-e2e"):
        spec = tmp_path / f"{recipe}.yaml"
        spec.write_text(SPEC % recipe)
        result = runner.invoke(app, ["layer-diff", str(spec), "--prompts", "3"])
        assert result.exit_code == 0, result.output
        lines = result.output.splitlines()
        assert lines[0].startswith(f"recipe {recipe}, exact true: 0 of ")
        assert "no sampled token differs" in lines[2]
        # both decoder layers add exactly nothing: the engines agree bit for bit
        assert lines[3].endswith("the job's per-layer attribution measures it): 0 (+0), 1 (+0)"), lines[3]
        modules = [line.split() for line in lines[5:]]
        names = [m[0] for m in modules]
        assert "model.embed_tokens" in names and "lm_head" in names and len(names) > 20
        assert all(m[-1] == "yes" for m in modules)


@pytest.mark.slow
def test_layer_diff_names_the_layers_of_an_fp8_gen_job(tmp_path: Path) -> None:
    """fp8-gen: FP8 weights in the generator against a BF16 trainer, so the traced token's hidden
    states part: the line names both decoder layers, whose contributions add up to a positive
    divergence."""
    spec = tmp_path / "gen.yaml"
    spec.write_text(SPEC.replace("exact: true", "exact: false") % "fp8-gen")
    result = runner.invoke(app, ["layer-diff", str(spec), "--prompts", "3"])
    assert result.exit_code == 0, result.output
    line = result.output.splitlines()[3]
    named = line.split("measures it): ")[1].split(", ")
    shares = {int(x.split(" ")[0]): float(x.split("(")[1].rstrip(")")) for x in named}
    assert set(shares) == {0, 1} and sum(shares.values()) > 0, line
    assert "over 1 token(s)" in line
    more = runner.invoke(app, ["layer-diff", str(spec), "--prompts", "3", "--tokens", "3"])
    assert more.exit_code == 0 and "over 3 token(s)" in more.output.splitlines()[3], more.output
    # the module table is the most-differing token's either way
    assert more.output.splitlines()[5:] == result.output.splitlines()[5:]
    bad = runner.invoke(app, ["layer-diff", str(spec), "--tokens", "0"])
    assert bad.exit_code == 2 and "--tokens" in bad.output


def test_layer_diff_refuses_a_bad_spec(tmp_path: Path) -> None:
    spec = tmp_path / "bad.yaml"
    spec.write_text("precision: {recipe: fp8-gen, exact: true}\n")
    result = runner.invoke(app, ["layer-diff", str(spec)])
    assert result.exit_code == 2 and "precision.exact" in result.output


def test_layer_diff_loads_a_checkpoint(tmp_path: Path) -> None:
    """Other weights, from a checkpoint directory: both engines run on them and still agree."""
    from rljob import parse_spec
    from workers.engines.native.trainer import NativeTrainer
    from workers.models.tokenizer import ByteTokenizer

    spec_path = tmp_path / "s.yaml"
    spec_path.write_text(SPEC % "bf16")
    import yaml

    trainer = NativeTrainer(parse_spec(yaml.safe_load(SPEC % "bf16")), ByteTokenizer().vocab_size)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.mul_(1.5)
    torch.save({"model": trainer.model.state_dict()}, tmp_path / "trainer.pt")
    result = runner.invoke(
        app, ["layer-diff", str(spec_path), "--checkpoint", str(tmp_path), "--prompts", "2"]
    )
    assert result.exit_code == 0, result.output
    assert all(line.split()[-1] == "yes" for line in result.output.splitlines()[5:])


SWAP_SPEC = """
model: {tiny: {hidden_size: 64, intermediate_size: 128, num_layers: 2}}
rollout: {max_new_tokens: 8}
precision: {recipe: %s, bf16_layers: %s}
"""


def _broken_layer_checkpoint(tmp_path: Path) -> Path:
    """The tiny fp8-gen model with decoder layer 0's MLP broken for FP8 alone: one weight of its
    ``down_proj`` (a single 64 x 128 block, one FP8 scale) set to 1e4, on an intermediate channel
    whose ``up_proj`` row is zeroed so that BF16 multiplies it by exactly 0. Scaled to E4M3's 448,
    the block's other weights (about 0.02) fall below its smallest step (1e4 / 448 x 2^-9 = 0.044)
    and round to 0: the generator's layer-0 MLP adds nothing, the trainer's works as before."""
    import yaml

    from rljob import parse_spec
    from workers.engines.native.trainer import NativeTrainer
    from workers.models.tokenizer import ByteTokenizer

    trainer = NativeTrainer(
        parse_spec(yaml.safe_load(SWAP_SPEC % ("fp8-gen", "[]"))), ByteTokenizer().vocab_size
    )
    mlp = trainer.model.model.layers[0].mlp
    with torch.no_grad():
        assert float(mlp.down_proj.weight.abs().max()) < 0.2
        mlp.up_proj.weight[5].zero_()
        mlp.down_proj.weight[3, 5] = 1e4
    tmp_path.mkdir()
    torch.save({"model": trainer.model.state_dict()}, tmp_path / "trainer.pt")
    return tmp_path


def _swap_rows(output: str) -> dict[int, tuple[float, float]]:
    """``layer i: +drop  (mean |gap| g, ...)`` lines -> {i: (drop, g)}."""
    rows = {}
    for line in output.splitlines():
        if line.strip().startswith("layer "):
            head, rest = line.split(":", 1)
            drop = float(rest.split()[0])
            gap = float(rest.split("mean |gap| ")[1].split(",")[0])
            rows[int(head.split()[1])] = (drop, gap)
    return rows


@pytest.mark.slow
def test_layer_diff_swap_finds_the_layer_whose_fp8_copy_is_broken(tmp_path: Path) -> None:
    checkpoint = _broken_layer_checkpoint(tmp_path / "ckpt")
    spec = tmp_path / "gen.yaml"
    spec.write_text(SWAP_SPEC % ("fp8-gen", "[]"))
    args = ["--checkpoint", str(checkpoint), "--prompts", "4", "--tokens", "3", "--swap"]
    result = runner.invoke(app, ["layer-diff", str(spec), *args])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("recipe fp8-gen: 3 traced token(s)")
    assert sum("response position" in line for line in lines) == 3
    base = float(result.output.split("(none BF16): mean |gap| ")[1].split(",")[0])
    rows = _swap_rows(result.output)
    assert list(rows) == [0, 1], result.output  # largest drop first: the broken layer
    assert rows[0][1] < 0.25 * base, result.output  # layer 0 in BF16 removes most of the gap
    assert abs(rows[0][0] - (base - rows[0][1])) < 2e-3  # drop = base - gap with the layer moved


@pytest.mark.slow
def test_layer_diff_swap_skips_the_jobs_bf16_layers_and_refuses_bf16(tmp_path: Path) -> None:
    spec = tmp_path / "gen.yaml"
    spec.write_text(SWAP_SPEC % ("fp8-gen", "[1]"))
    result = runner.invoke(app, ["layer-diff", str(spec), "--prompts", "3", "--swap"])
    assert result.exit_code == 0, result.output
    assert "with the job's layers ([1] BF16)" in result.output
    assert list(_swap_rows(result.output)) == [0]
    spec.write_text(SWAP_SPEC % ("bf16", "[]"))
    refused = runner.invoke(app, ["layer-diff", str(spec), "--swap"])
    assert refused.exit_code == 2 and "--swap" in refused.output and "recipe bf16" in refused.output
