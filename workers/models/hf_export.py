"""``fp8rl export``: a run's checkpoint as a Hugging Face model directory that vLLM, SGLang and
transformers load.

Formats:
- ``hf-fp8``: block-FP8 (:mod:`workers.fp8.hf_checkpoint`): the decoder linears in E4M3 with
  128x128-block float32 scales, everything else in BF16. Which linears are FP8 is the job's
  generator layout under ``fp8-e2e`` (``precision.keep_bf16_layers`` honoured), whatever the run's
  recipe, so a ``bf16`` or ``fp8-gen`` run exports FP8 too. For an ``fp8-e2e`` run the FP8 weights
  are the trainer's own (:meth:`Fp8Linear.fp8_weight`), bit for bit: the weights its last steps
  trained and generated with; other runs' master weights are quantized here, as the weight sync
  quantizes them for an ``fp8-gen`` generator.
- ``hf-bf16``: every tensor in BF16 (the master weights rounded), no ``quantization_config``.

The tokenizer is saved beside the weights when the run used a Hugging Face one; the byte tokenizer
has no Hugging Face files (the log says so). The directory is assembled in a temporary directory
and renamed into place, so an export that fails leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rljob.run_dir import SPEC_RESOLVED, RunDir
from rljob.spec import JobSpec, parse_spec
from workers.engines.factory import native_trainer
from workers.engines.models import apply_recipe, fp8_config, model_config
from workers.fp8.fp8_tensor import Fp8Tensor
from workers.fp8.hf_checkpoint import (
    check_tp_partitions,
    checkpoint_tensors,
    ignored_linear_names,
    quantization_config,
    write_checkpoint,
)
from workers.models.checkpoint import list_checkpoints, load_master_weights
from workers.models.tokenizer import Tokenizer, build_tokenizer
from workers.weight_sync.payload import export_weights, fp8_weight_names

FORMATS: dict[str, str] = {
    "hf-fp8": "block-FP8 E4M3 weights with 128x128 scales (vLLM, SGLang, transformers FineGrainedFP8)",
    "hf-bf16": "plain BF16 weights, no quantization",
}


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_run` wrote.

    Attributes:
        out: the model directory.
        step: the checkpoint's RL step.
        files: every file in ``out`` (weights, index, config, tokenizer), sorted.
        fp8_layers: module paths of the linears stored in FP8.
        bf16_layers: module paths of the linears stored in BF16 (``lm_head`` included).
        bytes: bytes of the weight files (``*.safetensors``).
    """

    out: Path
    step: int
    files: list[Path]
    fp8_layers: list[str]
    bf16_layers: list[str]
    bytes: int


def load_run_spec(run_dir: Path) -> JobSpec:
    """The job spec a run was started with (its ``spec.resolved.json``)."""
    if not run_dir.is_dir():
        raise ValueError(
            f"run directory {run_dir} does not exist; give the output_dir of an fp8rl run "
            "(e.g. runs/arithmetic)"
        )
    path = RunDir(run_dir).spec_resolved
    if not path.is_file():
        raise ValueError(
            f"{run_dir} has no {SPEC_RESOLVED}; is it an fp8rl run directory? (`fp8rl run` writes it "
            "when a run starts)"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err}); the run directory is damaged") from None
    return parse_spec(data, str(path))


def pick_checkpoint(run_dir: Path, step: int | None) -> tuple[int, Path]:
    """``(step, checkpoints/step_N)``: the one of ``step``, or the newest for None."""
    found = list_checkpoints(run_dir)
    if not found:
        raise ValueError(
            f"{run_dir} has no checkpoints (checkpoints/step_N with a state.json); a run writes one "
            "every checkpoint_interval steps and at its end"
        )
    if step is None:
        return found[-1]
    for s, path in found:
        if s == step:
            return s, path
    steps = ", ".join(str(s) for s, _ in found)
    raise ValueError(
        f"{run_dir} has no checkpoint of step {step}; available steps: {steps} (use --step with one "
        "of them, or leave it out for the newest)"
    )


def generator_layout(spec: JobSpec, vocab_size: int, fp8: bool) -> nn.Module:
    """The job's generator model as structure only (on the ``meta`` device, no storage): with
    ``fp8``, its linears converted as under recipe ``fp8-e2e`` (``keep_bf16_layers`` honoured)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model: nn.Module = AutoModelForCausalLM.from_config(model_config(spec, vocab_size))  # type: ignore[no-untyped-call]
    if fp8:
        apply_recipe(model, spec.precision.model_copy(update={"recipe": "fp8-e2e"}), "generator")
    return model


def _config(spec: JobSpec, tok: Tokenizer, model: nn.Module, ignored: list[str] | None) -> dict[str, Any]:
    """``config.json``: the model's Hugging Face config, BF16, with a quantization_config for FP8."""
    config: dict[str, Any] = model_config(spec, tok.vocab_size).to_dict()
    config["architectures"] = [type(model).__name__]
    config["torch_dtype"] = config["dtype"] = "bfloat16"  # transformers < 5 reads the first
    if spec.model.tiny is not None:  # a named model's config has its own token ids
        config["eos_token_id"], config["pad_token_id"] = tok.eos_id, tok.pad_id
        bos = getattr(tok, "bos_id", None)
        if bos is not None:
            config["bos_token_id"] = bos
    config.pop("quantization_config", None)
    if ignored is not None:
        config["quantization_config"] = quantization_config(ignored)
    return config


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(
            f"--out {out}: already exists and is not an empty directory; remove it or choose another"
        )


def _save_tokenizer(spec: JobSpec, into: Path, log: Callable[[str], Any]) -> None:
    if spec.tokenizer.kind != "huggingface":
        log(
            "tokenizer: none written: the run uses the byte tokenizer (one token per UTF-8 byte, "
            "BOS 256, EOS 257, PAD 258), which has no Hugging Face files"
        )
        return
    from transformers import AutoTokenizer

    name = spec.tokenizer.name or spec.model.name
    AutoTokenizer.from_pretrained(name).save_pretrained(str(into))
    log(f"tokenizer: {name}")


def _warn_tensor_parallel(
    spec: JobSpec, payload: dict[str, Fp8Tensor | torch.Tensor], log: Callable[[str], Any]
) -> None:
    """Say which FP8 layers vLLM would refuse at the job's tensor-parallel size (transformers
    loads them all the same)."""
    tp = spec.resources.generator_tensor_parallel_size
    shapes = {n: (v.shape[0], v.shape[1]) for n, v in payload.items() if isinstance(v, Fp8Tensor)}
    try:
        check_tp_partitions(shapes, tp)
    except ValueError as err:
        log(f"warning: vLLM cannot load these FP8 layers at tensor_parallel_size {tp}:\n{err}")


def export_run(
    run_dir: Path, step: int | None, out: Path, fmt: str = "hf-fp8", log: Callable[[str], Any] = print
) -> ExportResult:
    """Export checkpoint ``step`` (None: the newest) of ``run_dir`` into ``out`` as ``fmt``.

    Raises ValueError, saying what to do, for a bad format, a missing run directory, spec file or
    checkpoint, or an ``out`` that is not empty.
    """
    if fmt not in FORMATS:
        allowed = "; ".join(f"{k}: {v}" for k, v in FORMATS.items())
        raise ValueError(f"--format {fmt!r} is not one of {', '.join(FORMATS)} ({allowed})")
    run_dir, out = Path(run_dir), Path(out)
    spec = load_run_spec(run_dir)
    ckpt_step, ckpt_dir = pick_checkpoint(run_dir, step)
    _check_out(out)
    if not (ckpt_dir / "trainer.pt").is_file():
        raise ValueError(f"{ckpt_dir} has no trainer.pt; the checkpoint is incomplete, pick another --step")
    log(f"exporting {ckpt_dir} (recipe {spec.precision.recipe}) as {fmt}")
    tok = build_tokenizer(spec)
    spec = spec.model_copy(deep=True)
    spec.algorithm.kl.coef = 0.0  # no frozen reference copy of the model: only the weights matter
    try:
        trainer = native_trainer(spec, tok.vocab_size, load_master_weights(ckpt_dir))
    except ValueError as err:
        raise ValueError(
            f"{ckpt_dir}: does not fit the model of {RunDir(run_dir).spec_resolved}: {err}"
        ) from None
    fp8 = fmt == "hf-fp8"
    layout = generator_layout(spec, tok.vocab_size, fp8)
    if fp8:
        fp8_names = fp8_weight_names(layout)
        payload = export_weights(trainer.model, fp8_names, fp8_config(spec.precision))
        stored_fp8 = sorted(n for n, v in payload.items() if isinstance(v, Fp8Tensor))
        if stored_fp8 != sorted(fp8_names):  # the trainer's FP8 layers are the generator's
            raise RuntimeError(
                f"the trainer holds FP8 weights {stored_fp8} but the generator layout has {sorted(fp8_names)}"
            )
        _warn_tensor_parallel(spec, payload, log)
    else:
        payload = {n: p.detach() for n, p in trainer.model.named_parameters()}
    fp8_layers = [n.removesuffix(".weight") for n, v in payload.items() if isinstance(v, Fp8Tensor)]
    bf16_layers = ignored_linear_names(layout)
    config = _config(spec, tok, trainer.model, bf16_layers if fp8 else None)
    tensors = checkpoint_tensors(payload)
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    try:
        write_checkpoint(stage / "model", tensors, config)
        _save_tokenizer(spec, stage / "model", log)
        _check_out(out)
        if out.exists():
            out.rmdir()
        os.replace(stage / "model", out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    files = sorted(p for p in out.iterdir() if p.is_file())
    weight_bytes = sum(p.stat().st_size for p in files if p.suffix == ".safetensors")
    log(
        f"wrote {out}: {len(fp8_layers)} linear layers in FP8, {len(bf16_layers)} in BF16, "
        f"{weight_bytes / 2**20:.2f} MiB of weights"
    )
    return ExportResult(out, ckpt_step, files, fp8_layers, bf16_layers, weight_bytes)
