"""The Megatron-Core trainer's configuration, from a Hugging Face Llama/Qwen2 config and the job spec.

``TransformerConfig`` and ``GPTModel`` keyword arguments (Megatron-Core 0.16), the shapes the
layout helpers need (:class:`MegatronShapes`), the models the adapter refuses (with the field to
change), and the environment Transformer Engine must see before it is imported. Pure: nothing
here imports Megatron-Core or Transformer Engine.

Two layer specs, two parameter layouts (:data:`Layout`): ``te`` (Transformer Engine's spec, the
GPU path) fuses each RMSNorm into the linear after it (``linear_qkv.layer_norm_weight``,
``linear_fc1.layer_norm_weight``); ``local`` (Megatron-Core's own modules, the CPU path) keeps
them as modules of their own (``input_layernorm.weight``, ``pre_mlp_layernorm.weight``). Every
other name and every layout is the same in both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from rljob.spec import JobSpec, PrecisionSpec, bf16_layer_reason
from workers.fp8.convert import AuditRow, Fp8Audit

# The versions this adapter is written against (docker/worker.Dockerfile pins the same)
MEGATRON_CORE_VERSION = "0.16.1"
TRANSFORMER_ENGINE_VERSION = "2.11.0"
SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
VOCAB_MULTIPLE = 128
# Megatron-Core's llama3 RoPE scaling takes only the factor; these are fixed in its code
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192.0}
_NATIVE = "use resources.trainer_engine: native for this model"

Layout = Literal["te", "local"]  # Transformer Engine's layer spec | Megatron-Core's local one


# -- configs ----------------------------------------------------------------------------------------


def _rope(hf_config: Any) -> tuple[float, dict[str, Any]]:
    """``(rope_theta, rope parameters)`` from a transformers 4.x or 5.x config."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    theta = params.get("rope_theta") or getattr(hf_config, "rope_theta", None) or 10000.0
    return float(theta), dict(params)


def rope_scaling_factor(hf_config: Any) -> float | None:
    """The llama3 RoPE scaling factor, ``None`` without scaling; refuses every other kind."""
    _, params = _rope(hf_config)
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return None
    if kind != "llama3":
        raise ValueError(
            f"model.name: rope_scaling type {kind!r} is not supported by the megatron trainer "
            f"(Megatron-Core's GPTModel implements RoPE without scaling or with llama3 scaling); {_NATIVE}"
        )
    for key, fixed in _LLAMA3_FIXED.items():
        if key not in params or float(params[key]) != fixed:
            raise ValueError(
                f"model.name: llama3 rope_scaling.{key} is {params.get(key)!r}; Megatron-Core fixes it at "
                f"{fixed:g} and takes only the factor; {_NATIVE}"
            )
    return float(params["factor"])


@dataclass(frozen=True)
class MegatronShapes:
    """What the name and layout mappings need to know about the model (full, unsharded)."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    ffn: int
    vocab: int  # the Hugging Face vocabulary (the softmax runs over these)
    padded_vocab: int  # Megatron's embedding / output-layer rows
    tied: bool
    qkv_bias: bool
    layout: Layout = "te"  # which layer spec's parameter names (see the module docstring)

    @property
    def heads_per_group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def norm_names(self) -> tuple[str, str]:
        """The layer's two RMSNorm weights (before attention, before the MLP), layer-relative."""
        if self.layout == "te":
            return "self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"
        return "input_layernorm.weight", "pre_mlp_layernorm.weight"

    @classmethod
    def from_hf(cls, hf_config: Any, tp: int = 1, layout: Layout = "te") -> MegatronShapes:
        """Shapes of a Hugging Face Llama/Qwen2 config trained with ``tp`` tensor-parallel ranks
        on ``layout``'s layer spec; raises ``ValueError`` (field path and what to do) for what the
        trainer cannot run."""
        check_supported(hf_config)
        heads, kv_heads = int(hf_config.num_attention_heads), int(hf_config.num_key_value_heads)
        ffn = int(hf_config.intermediate_size)
        if heads % tp or kv_heads % tp or ffn % tp:
            raise ValueError(
                f"resources.trainer_tensor_parallel_size ({tp}) must divide the model's attention heads "
                f"({heads}), key/value heads ({kv_heads}) and intermediate_size ({ffn}): each rank holds "
                "whole query groups and an equal share of the MLP; choose a smaller tensor-parallel size"
            )
        hidden = int(hf_config.hidden_size)
        vocab = int(hf_config.vocab_size)
        multiple = VOCAB_MULTIPLE * tp
        return cls(
            layers=int(hf_config.num_hidden_layers),
            heads=heads,
            kv_heads=kv_heads,
            head_dim=int(getattr(hf_config, "head_dim", None) or hidden // heads),
            hidden=hidden,
            ffn=ffn,
            vocab=vocab,
            padded_vocab=-(-vocab // multiple) * multiple,
            tied=bool(hf_config.tie_word_embeddings),
            qkv_bias=hf_config.model_type == "qwen2",
            layout=layout,
        )


def check_supported(hf_config: Any) -> None:
    """Refuse configs the Megatron trainer would compute differently from the Hugging Face model."""
    kind = getattr(hf_config, "model_type", None)
    if kind not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model.name: model_type {kind!r} is not supported by the megatron trainer (it maps "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}); {_NATIVE}"
        )
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"model.name: hidden_act {hf_config.hidden_act!r} is not silu (SwiGLU); {_NATIVE}")
    if kind == "llama" and (
        getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False)
    ):
        raise ValueError(
            "model.name: a Llama with attention_bias or mlp_bias has biases on o_proj / the MLP, which "
            f"the megatron trainer does not map; {_NATIVE}"
        )
    sliding = getattr(hf_config, "use_sliding_window", False) or "sliding_attention" in (
        getattr(hf_config, "layer_types", None) or ()
    )
    if sliding:
        raise ValueError(
            "model.name: the model uses sliding-window attention, which the megatron trainer does not "
            f"implement (Megatron's TE spec is full causal attention); {_NATIVE}"
        )
    rope_scaling_factor(hf_config)


def transformer_config_kwargs(
    hf_config: Any, spec: JobSpec, compute_dtype: torch.dtype = torch.bfloat16
) -> dict[str, Any]:
    """Keyword arguments of Megatron-Core's ``TransformerConfig`` for this model and job, computing
    in ``compute_dtype`` (BF16: Megatron's ``Float16Module`` and mixed-precision optimizer; float32:
    neither, the parameters are the float32 main weights)."""
    res, precision = spec.resources, spec.precision
    tp, pp = res.trainer_tensor_parallel_size, res.trainer_pipeline_parallel_size
    s = MegatronShapes.from_hf(hf_config, tp)
    if s.layers % pp:
        raise ValueError(
            f"resources.trainer_pipeline_parallel_size ({pp}) must divide the model's {s.layers} layers: "
            "each stage holds the same number of layers"
        )
    kwargs: dict[str, Any] = dict(
        num_layers=s.layers,
        hidden_size=s.hidden,
        num_attention_heads=s.heads,
        num_query_groups=s.kv_heads,
        ffn_hidden_size=s.ffn,
        kv_channels=s.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=float(hf_config.rms_norm_eps),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=s.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=compute_dtype == torch.bfloat16,
        params_dtype=torch.float32 if precision.master_dtype == "float32" else torch.bfloat16,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=False,
    )
    if pp > 1:
        kwargs["pipeline_dtype"] = compute_dtype  # activations sent between stages
    if precision.recipe != "fp8-e2e":
        kwargs["fp8"] = None
        return kwargs
    kwargs.update(
        fp8="e4m3" if precision.fp8_format == "e4m3" else "hybrid", fp8_recipe="blockwise", fp8_param=False
    )
    first, last = precision.keep_bf16_layers
    per_stage = s.layers // pp
    if max(first, last) > per_stage:
        raise ValueError(
            f"precision.keep_bf16_layers ({first}, {last}): Megatron keeps at most the layers of one "
            f"pipeline stage ({per_stage}) in BF16 at each end; lower the counts"
        )
    if first or last:
        kwargs.update(
            first_last_layers_bf16=True, num_layers_at_start_in_bf16=first, num_layers_at_end_in_bf16=last
        )
    return kwargs


def gpt_model_kwargs(hf_config: Any, tp: int) -> dict[str, Any]:
    """Keyword arguments of ``GPTModel`` besides the config, layer spec and stage flags. The
    vocabulary is padded to a multiple of ``128 * tp`` (equal shards; see the module docstring)."""
    s = MegatronShapes.from_hf(hf_config, tp)
    theta, _ = _rope(hf_config)
    kwargs: dict[str, Any] = dict(
        vocab_size=s.padded_vocab,
        max_sequence_length=int(hf_config.max_position_embeddings),
        position_embedding_type="rope",
        rotary_base=int(theta) if theta.is_integer() else theta,
        share_embeddings_and_output_weights=s.tied,
        parallel_output=True,
    )
    factor = rope_scaling_factor(hf_config)
    if factor is not None:
        kwargs.update(rope_scaling=True, rope_scaling_factor=factor)
    return kwargs


def fp8_environment(spec: JobSpec) -> dict[str, str]:
    """Environment Transformer Engine must see *before it is imported*: its ``Float8BlockScaling``
    reads ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES`` once, when the class is defined. Float32 scales
    unless ``precision.power_of_two_scales`` (set explicitly either way, so an inherited value
    cannot flip the recipe)."""
    return {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "0" if spec.precision.power_of_two_scales else "1"}


def megatron_state_shapes(cfg: MegatronShapes) -> dict[str, tuple[int, ...]]:
    """Every parameter of the full (unsharded, one-stage) Megatron model and its shape."""
    qkv = (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "embedding.word_embeddings.weight": (cfg.padded_vocab, cfg.hidden),
        "decoder.final_layernorm.weight": (cfg.hidden,),
    }
    if not cfg.tied:
        shapes["output_layer.weight"] = (cfg.padded_vocab, cfg.hidden)
    attn_norm, mlp_norm = cfg.norm_names
    for i in range(cfg.layers):
        m = f"decoder.layers.{i}."
        shapes[m + attn_norm] = (cfg.hidden,)
        shapes[m + "self_attention.linear_qkv.weight"] = (qkv, cfg.hidden)
        if cfg.qkv_bias:
            shapes[m + "self_attention.linear_qkv.bias"] = (qkv,)
        shapes[m + "self_attention.linear_proj.weight"] = (cfg.hidden, cfg.heads * cfg.head_dim)
        shapes[m + mlp_norm] = (cfg.hidden,)
        shapes[m + "mlp.linear_fc1.weight"] = (2 * cfg.ffn, cfg.hidden)
        shapes[m + "mlp.linear_fc2.weight"] = (cfg.hidden, cfg.ffn)
    return shapes


_GEMMS = ("fprop", "dgrad", "wgrad")
_LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


def megatron_audit(
    shapes: MegatronShapes,
    precision: PrecisionSpec,
    device: str = "",
    compute_dtype: torch.dtype = torch.bfloat16,
) -> Fp8Audit:
    """One row per parameter-holding module of the full model, with its precision and why
    (``compute_dtype``: what the trainer computes in outside FP8 layers)."""
    fp8 = precision.recipe == "fp8-e2e"
    audit = Fp8Audit(recipe=precision.recipe, device=device)
    weights = megatron_state_shapes(shapes)
    compute = str(compute_dtype).removeprefix("torch.")
    # the module holding each RMSNorm weight, by the linear it comes before
    # (te: "...linear_qkv.layer_norm_weight" -> "...linear_qkv.layer_norm"; local: "input_layernorm")
    norm_modules = (n.removesuffix("_weight").removesuffix(".weight") for n in shapes.norm_names)
    norms = dict(zip(("linear_qkv", "linear_fc1"), norm_modules, strict=True))

    def high(name: str, kind: str, shape: tuple[int, ...], reason: str) -> None:
        # the compute copy (with BF16, float32 main weights live in the optimizer)
        size = compute_dtype.itemsize * math.prod(shape)
        audit.rows.append(AuditRow(name, kind, compute, reason, shape, size, size))

    high(
        "embedding.word_embeddings",
        "embedding",
        weights["embedding.word_embeddings.weight"],
        "embeddings stay high precision",
    )
    for i in range(shapes.layers):
        runs = "BF16" if compute_dtype == torch.bfloat16 else compute
        # Megatron takes no bf16_layers (JobSpec refuses them with it under fp8-e2e)
        reason = (
            bf16_layer_reason(i, shapes.layers, precision.keep_bf16_layers)
            if fp8
            else f"recipe {precision.recipe}: the trainer runs {runs}"
        )
        for module in _LINEARS:
            name = f"decoder.layers.{i}.{module}"
            norm = norms.get(module.rsplit(".", 1)[-1])
            if norm is not None:  # the RMSNorm before the linear (fused into it with TE)
                high(f"decoder.layers.{i}.{norm}", "norm", (shapes.hidden,), "norms stay high precision")
            shape = weights[f"{name}.weight"]
            if reason is not None:
                high(name, "linear", shape, reason)
                continue
            numel, blocks = math.prod(shape), math.ceil(shape[0] / 128) * math.ceil(shape[1] / 128)
            kernels = dict.fromkeys(_GEMMS, "te_blockwise")
            audit.rows.append(
                AuditRow(
                    name, "linear", "fp8", "decoder linear", shape, 2 * numel, numel + 4 * blocks, kernels
                )
            )
    high("decoder.final_layernorm", "norm", (shapes.hidden,), "norms stay high precision")
    head = (shapes.padded_vocab, shapes.hidden)
    if shapes.tied:
        tied = "tied to the word embeddings (high precision)"
        audit.rows.append(AuditRow("output_layer", "lm_head", compute, tied, head, 0, 0))
    else:
        high("output_layer", "lm_head", head, "lm_head stays high precision (logits are precision-sensitive)")
    if audit.fp8_layers:
        grads = "E4M3" if precision.fp8_format == "e4m3" else "E5M2"
        scales = "power-of-two" if precision.power_of_two_scales else "float32"
        audit.formats = (
            f"E4M3 weights (128x128 blocks) and activations (1x128 tiles), {grads} gradients "
            f"(1x128 tiles); {scales} scales"
        )
        for gemm in _GEMMS:
            audit.kernel_reasons[f"{gemm}: te_blockwise"] = (
                "Transformer Engine Float8BlockScaling, turned on per layer by Megatron-Core "
                "(fp8_recipe=blockwise)"
            )
    return audit
