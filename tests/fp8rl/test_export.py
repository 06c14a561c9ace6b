"""`fp8rl export`: a fabricated run's checkpoint as a Hugging Face block-FP8 directory, read back
with safetensors' own reader and checked against a float64 dequantization written here.

The tiny model (hidden 256, intermediate 384, 4 heads of 64, 1 KV head, 2 layers) is chosen so
that the 128x128 scale grids are worked out by hand and include partial blocks:
q/o_proj [256, 256] -> [2, 2]; k/v_proj [64, 256] -> [1, 2] (64 rows: half a block);
gate/up_proj [384, 256] -> [3, 2]; down_proj [256, 384] -> [2, 3].
``keep_bf16_layers [1, 0]`` keeps decoder layer 0 in BF16, so only layer 1 is FP8.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from fp8rl.cli import app
from rljob import JobSpec, parse_spec
from tests import helpers
from workers.engines.factory import native_trainer
from workers.engines.native.trainer import NativeTrainer
from workers.fp8.linear import Fp8Linear
from workers.models.checkpoint import load_master_weights
from workers.models.hf_export import export_run
from workers.models.tokenizer import ByteTokenizer

VOCAB = ByteTokenizer().vocab_size
LINEARS = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
]
SCALE_SHAPES = {  # ceil(N / 128), ceil(K / 128) of each [N, K] weight
    "self_attn.q_proj": (2, 2),
    "self_attn.k_proj": (1, 2),
    "self_attn.v_proj": (1, 2),
    "self_attn.o_proj": (2, 2),
    "mlp.gate_proj": (3, 2),
    "mlp.up_proj": (3, 2),
    "mlp.down_proj": (2, 3),
}
FP8_LAYERS = [f"model.layers.1.{m}" for m in LINEARS]
BF16_LAYERS = sorted(["lm_head", *(f"model.layers.0.{m}" for m in LINEARS)])
STEPS = (2, 4)


def tiny_spec(recipe: str) -> JobSpec:
    """The shared tiny job on a model whose weights make whole and partial 128x128 FP8 blocks (the
    module docstring), with its first layer and lm_head kept in BF16."""
    model = {"hidden_size": 256, "intermediate_size": 384, "num_layers": 2, "num_heads": 4, "num_kv_heads": 1}
    precision = {"recipe": recipe, "keep_bf16_layers": [1, 0]}
    return parse_spec(helpers.tiny_spec(model={"tiny": model}, precision=precision))


def fabricate_run(root: Path, recipe: str) -> Path:
    """A run directory as a run leaves it: spec.resolved.json and checkpoints of steps 2 and 4,
    each with other master weights (init seed = step)."""
    root.mkdir()
    spec = tiny_spec(recipe)
    (root / "spec.resolved.json").write_text(json.dumps(spec.model_dump(mode="json")))
    for step in STEPS:
        spec.model.init_seed = step
        ckpt = root / "checkpoints" / f"step_{step:08d}"
        ckpt.mkdir(parents=True)
        torch.save({"model": NativeTrainer(spec, VOCAB).state_dict()["model"]}, ckpt / "trainer.pt")
        (ckpt / "state.json").write_text(json.dumps({"step": step}))
    return root


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    return {recipe: fabricate_run(root / recipe, recipe) for recipe in ("fp8-e2e", "bf16")}


def master(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_master_weights(run / "checkpoints" / f"step_{step:08d}")


def dequantize_f64(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """weight * scale in float64, each scale repeated over its 128x128 block (cut at the edges).
    Exact: an E4M3 value (4 significant bits) times a float32 (24) fits in float64's 53."""
    n, k = weight.shape
    full = scale.double().repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)  # [128*nR, 128*nC]
    return weight.double() * full[:n, :k]


def test_fp8_e2e_run_exports_the_trainers_own_fp8_weights(runs: dict[str, Path], tmp_path: Path) -> None:
    run, out = runs["fp8-e2e"], tmp_path / "hf"
    logs: list[str] = []
    result = export_run(run, None, out, log=logs.append)
    assert result.step == 4  # the newest
    assert [p.name for p in result.files] == ["config.json", "model.safetensors"]
    assert result.fp8_layers == FP8_LAYERS and result.bf16_layers == BF16_LAYERS
    assert result.bytes == (out / "model.safetensors").stat().st_size
    assert any("byte tokenizer" in line for line in logs)  # no tokenizer files, and it says why
    tensors = load_file(str(out / "model.safetensors"))

    # the trainer as the run's step 4 left it, built here independently of the export
    trainer = native_trainer(tiny_spec("fp8-e2e"), VOCAB, master(run, 4))
    layers = {n: m for n, m in trainer.model.named_modules() if isinstance(m, Fp8Linear)}
    assert sorted(layers) == sorted(FP8_LAYERS)
    for name, layer in layers.items():
        weight, scale = tensors[f"{name}.weight"], tensors[f"{name}.weight_scale_inv"]
        assert weight.dtype == torch.float8_e4m3fn and tuple(weight.shape) == tuple(layer.weight.shape)
        assert scale.dtype == torch.float32
        assert tuple(scale.shape) == SCALE_SHAPES[name.removeprefix("model.layers.1.")]
        own = layer.fp8_weight()
        assert torch.equal(weight.view(torch.uint8), own.data.view(torch.uint8))  # the same bytes
        assert torch.equal(scale, own.scale)
        # the loader's dequantization, in float64, is the trainer's: float32 rounds the exact
        # product once, so the float64 value rounded to float32 is its dequantize() bit for bit
        ref = dequantize_f64(weight, scale)
        trainers = own.dequantize().double()
        assert torch.equal(ref.float().double(), trainers)
        assert torch.all((ref - trainers).abs() <= 2.0**-24 * ref.abs())

    # everything else in BF16: the master weights rounded to BF16
    state = master(run, 4)
    for name in BF16_LAYERS:
        t = tensors[f"{name}.weight"]
        assert t.dtype == torch.bfloat16 and torch.equal(t, state[f"{name}.weight"].to(torch.bfloat16))
    others = [n for n in state if not any(n.startswith(f"{layer}.") for layer in [*FP8_LAYERS, *BF16_LAYERS])]
    assert sorted(others) == [
        "model.embed_tokens.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.1.input_layernorm.weight",
        "model.layers.1.post_attention_layernorm.weight",
        "model.norm.weight",
    ]
    for name in others:
        assert tensors[name].dtype == torch.bfloat16 and torch.equal(
            tensors[name], state[name].to(torch.bfloat16)
        )
    scales = {f"{n}.weight_scale_inv" for n in FP8_LAYERS}
    assert set(tensors) == set(state) | scales  # nothing missing, nothing extra

    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
        "ignored_layers": BF16_LAYERS,
        "modules_to_not_convert": BF16_LAYERS,
    }
    assert config["torch_dtype"] == "bfloat16" and config["architectures"] == ["LlamaForCausalLM"]
    assert (config["vocab_size"], config["hidden_size"], config["num_hidden_layers"]) == (272, 256, 2)
    assert (config["num_key_value_heads"], config["eos_token_id"]) == (1, ByteTokenizer.eos_id)


def test_bf16_run_exports_fp8_quantized_from_its_master_weights(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    run = runs["bf16"]
    result = export_run(run, 2, tmp_path / "hf", log=lambda _: None)
    assert result.step == 2 and result.fp8_layers == FP8_LAYERS and result.bf16_layers == BF16_LAYERS
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    state = master(run, 2)
    assert not torch.equal(state["model.embed_tokens.weight"], master(run, 4)["model.embed_tokens.weight"])
    assert torch.equal(
        tensors["model.embed_tokens.weight"], state["model.embed_tokens.weight"].to(torch.bfloat16)
    )
    for name in FP8_LAYERS:
        weight, scale = tensors[f"{name}.weight"], tensors[f"{name}.weight_scale_inv"]
        assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
        w = state[f"{name}.weight"].double()  # [N, K] float32 master weight
        # each block's scale maps its amax onto E4M3's 448 (float32 division, correctly rounded)
        n, k = w.shape
        pad = torch.nn.functional.pad(w.abs(), (0, -k % 128, 0, -n % 128))
        amax = pad.reshape(pad.shape[0] // 128, 128, pad.shape[1] // 128, 128).amax(dim=(1, 3))
        assert torch.equal(scale, (amax / 448).float())
        # E4M3 rounding: relative error <= 2^-4 for normal values, half a subnormal step below
        err = (dequantize_f64(weight, scale) - w).abs()
        half_subnormal = dequantize_f64(torch.full_like(weight, 2.0**-10, dtype=torch.float32), scale)
        assert torch.all(err <= 2.0**-4 * w.abs() + half_subnormal)
    for name in BF16_LAYERS:
        assert tensors[f"{name}.weight"].dtype == torch.bfloat16 and f"{name}.weight_scale_inv" not in tensors


def test_bf16_format_has_no_quantization(runs: dict[str, Path], tmp_path: Path) -> None:
    run = runs["fp8-e2e"]
    result = export_run(run, 4, tmp_path / "hf", fmt="hf-bf16", log=lambda _: None)
    assert result.fp8_layers == [] and result.bf16_layers == sorted([*FP8_LAYERS, *BF16_LAYERS])
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    state = master(run, 4)
    assert set(tensors) == set(state)
    for name, t in tensors.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, state[name].to(torch.bfloat16))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"


def test_errors_say_what_to_do(runs: dict[str, Path], tmp_path: Path) -> None:
    run = runs["fp8-e2e"]
    cases: list[tuple[dict[str, Any], str]] = [
        ({"run_dir": tmp_path / "nope"}, r"run directory .*nope does not exist"),
        ({"run_dir": tmp_path}, r"has no spec.resolved.json"),
        ({"step": 3}, r"no checkpoint of step 3; available steps: 2, 4"),
        ({"fmt": "gguf"}, r"--format 'gguf' is not one of hf-fp8, hf-bf16"),
    ]
    for kwargs, message in cases:
        args = {"run_dir": run, "step": None, "out": tmp_path / "out", **kwargs}
        with pytest.raises(ValueError, match=message):
            export_run(**args)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ValueError, match=r"--out .*full: already exists and is not an empty directory"):
        export_run(run, None, tmp_path / "full")
    assert not (tmp_path / "out").exists()


def test_huggingface_tokenizer_is_saved_beside_the_weights(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # a five-word tokenizer made here (no download): the run's tokenizer.name is its directory
    words = Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1, "a": 2, "b": 3, "c": 4}, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, eos_token="<eos>", pad_token="<pad>").save_pretrained(
        str(tmp_path / "tok")
    )
    run = tmp_path / "run"
    run.mkdir()
    spec = tiny_spec("fp8-e2e")
    spec.tokenizer.kind, spec.tokenizer.name = "huggingface", str(tmp_path / "tok")
    (run / "spec.resolved.json").write_text(json.dumps(spec.model_dump(mode="json")))
    ckpt = run / "checkpoints" / "step_00000001"
    ckpt.mkdir(parents=True)
    torch.save({"model": NativeTrainer(spec, 5).state_dict()["model"]}, ckpt / "trainer.pt")
    (ckpt / "state.json").write_text("{}")
    result = export_run(run, None, tmp_path / "hf", log=lambda _: None)
    names = [p.name for p in result.files]
    assert names == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["vocab_size"], config["eos_token_id"], config["pad_token_id"]) == (16, 1, 0)  # 5 -> 16
    back = PreTrainedTokenizerFast.from_pretrained(str(tmp_path / "hf"))
    assert back.encode("a c b") == [2, 4, 3] and back.eos_token_id == 1


runner = CliRunner()


def test_cli_export(runs: dict[str, Path], tmp_path: Path) -> None:
    run = runs["fp8-e2e"]
    out = tmp_path / "hf"
    result = runner.invoke(app, ["export", str(run), "-o", str(out), "--step", "2"])
    assert result.exit_code == 0, result.output
    assert "exported step 2" in result.output and "7 FP8, 8 BF16" in result.output
    assert "config.json, model.safetensors" in result.output
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    missing = runner.invoke(app, ["export", str(run), "-o", str(tmp_path / "b"), "--step", "7"])
    assert missing.exit_code == 2 and "available steps: 2, 4" in missing.output
    bad = runner.invoke(app, ["export", str(run), "-o", str(tmp_path / "c"), "--format", "onnx"])
    assert bad.exit_code == 2 and "hf-fp8, hf-bf16" in bad.output
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


def test_transformers_loads_the_export(runs: dict[str, Path], tmp_path: Path) -> None:
    """A second reader of the format: transformers' own FP8 loader (on a CPU it dequantizes to
    BF16), whose weights must equal the float64 dequantization rounded to BF16."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    export_run(runs["fp8-e2e"], 4, out, log=lambda m: None)
    model = AutoModelForCausalLM.from_pretrained(str(out))
    stored = load_file(str(out / "model.safetensors"))
    checked = 0
    for name in stored:
        if not name.endswith(".weight_scale_inv"):
            continue
        layer = name.removesuffix(".weight_scale_inv")
        want = dequantize_f64(stored[f"{layer}.weight"], stored[name]).to(torch.bfloat16)
        weight = model.get_submodule(layer).weight
        assert isinstance(weight, torch.Tensor)
        assert torch.equal(weight.detach(), want), layer
        checked += 1
    assert checked == 7  # layer 1's linears; layer 0 is kept in BF16
    assert torch.equal(
        model.model.layers[0].self_attn.q_proj.weight.detach(),
        stored["model.layers.0.self_attn.q_proj.weight"],
    )
