"""``fp8rl layer-diff`` on a tiny job: under exact no sampled token and no module differs, with the
initial weights and with a checkpoint's; a spec exact mode cannot hold is refused."""

from __future__ import annotations

from pathlib import Path

import torch
from typer.testing import CliRunner

from fp8rl.cli import app

runner = CliRunner()
SPEC = """
model: {tiny: {hidden_size: 64, intermediate_size: 128, num_layers: 2}}
rollout: {max_new_tokens: 8}
precision: {recipe: %s, exact: true}
"""


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
