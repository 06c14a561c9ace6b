"""The RL job spec: one pydantic model shared by the CLI, the control plane, the operator and the driver.

Every field has a default a user can run with, a unit where it has one, and a description that
ends up in the OpenAPI schema and the CRD. Unknown fields are errors (``extra="forbid"``), so a
typo never silently falls back to a default. :func:`load_spec` turns validation errors into
:class:`SpecError`, one line per problem: the field path, what was wrong, what is allowed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

# ResourcesSpec lives in its own module and is re-exported here
# PrecisionSpec (where FP8 is used, and the one rule of which layers stay BF16) lives in its own
# module and is re-exported here
from rljob.precision_spec import PrecisionSpec as PrecisionSpec
from rljob.precision_spec import Recipe as Recipe
from rljob.precision_spec import bf16_layer_reason as bf16_layer_reason
from rljob.resources_spec import ResourcesSpec as ResourcesSpec
from rljob.spec_base import MAX_SEED, StrictModel

# TaskSpec (prompts, answers, rewards) lives in its own module and is re-exported here
from rljob.task_spec import AnswerFormat as AnswerFormat
from rljob.task_spec import TaskSpec as TaskSpec

IsMode = Literal["none", "tis", "icepop", "seq-tis", "seq-mask-tis", "geo-mask"]
Aggregation = Literal["token-mean", "seq-mean-token-mean"]


def expand_home(path: str | None) -> str | None:
    """A local path written from the user's home (``~/.cache/fp8rl/models/...``, where ``fp8rl model
    fetch`` puts models) made absolute; anything else (a Hugging Face id, a path) unchanged. Expanded
    where the spec is read, so a service confines the expanded path, never the ``~``."""
    if path is None or not (path == "~" or path.startswith("~/")):
        return path
    return os.path.expanduser(path)


Beta = Annotated[float, Field(ge=0.0, lt=1.0)]  # an AdamW beta: a decay rate


class TinyModel(StrictModel):
    """A small randomly initialised Llama/Qwen2 built from a config (no download): for CPU runs."""

    arch: Literal["llama", "qwen2"] = Field("llama", description="Hugging Face architecture.")
    hidden_size: int = Field(128, ge=16, le=16384, description="Model width.")
    intermediate_size: int = Field(256, ge=16, le=65536, description="MLP width.")
    num_layers: int = Field(2, ge=1, le=128, description="Decoder layers.")
    num_heads: int = Field(4, ge=1, le=256, description="Attention heads.")
    num_kv_heads: int = Field(2, ge=1, le=256, description="Key/value heads (GQA); divides num_heads.")
    max_position_embeddings: int = Field(256, ge=16, le=1_048_576, description="Longest sequence, tokens.")
    tie_word_embeddings: bool = Field(False, description="Share the embedding and lm_head weights.")

    @model_validator(mode="after")
    def _heads(self) -> TinyModel:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} must be a multiple of num_heads {self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}"
            )
        return self


class ModelSpec(StrictModel):
    """The policy. Exactly one of ``name`` (Hugging Face) or ``tiny`` (inline config)."""

    name: str | None = Field(
        None,
        description="Hugging Face model id or local path (config, and weights if pretrained). Set exactly "
        "one of `name` and `tiny`.",
    )
    pretrained: bool = Field(True, description="With `name`: load the weights; false: random init.")
    tiny: TinyModel | None = Field(
        None, description="Inline tiny model config for CPU runs. Set exactly one of `name` and `tiny`."
    )
    init_seed: int = Field(
        0, ge=0, le=MAX_SEED, description="Seed of the random initialisation (tiny or not pretrained)."
    )

    @field_validator("name")
    @classmethod
    def _home(cls, v: str | None) -> str | None:
        return expand_home(v)

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if (self.name is None) == (self.tiny is None):
            raise ValueError("set exactly one of model.name (Hugging Face id/path) or model.tiny")
        return self


class TokenizerSpec(StrictModel):
    """How text becomes token ids."""

    kind: Literal["bytes", "huggingface"] = Field(
        "bytes", description="`bytes`: one token per UTF-8 byte (vocab 259, no download); `huggingface`."
    )
    name: str | None = Field(None, description="Hugging Face tokenizer id/path; default: model.name.")

    @field_validator("name")
    @classmethod
    def _home(cls, v: str | None) -> str | None:
        return expand_home(v)


class RolloutSpec(StrictModel):
    """Generation settings."""

    prompts_per_step: int = Field(16, ge=1, le=65536, description="Distinct prompts per RL step.")
    group_size: int = Field(8, ge=1, le=1024, description="Responses sampled per prompt (GRPO group).")
    max_new_tokens: int = Field(32, ge=1, le=131072, description="Longest response, tokens.")
    temperature: float = Field(1.0, gt=0.0, le=10.0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="Seed of prompt order and sampling.")
    max_staleness: int = Field(
        0,
        ge=0,
        le=64,
        description="Asynchronous RL: how many policy versions a batch may lag the weights it is trained "
        "from. 0 = synchronous, on-policy loop. k >= 1: the generators produce the next batches while the "
        "trainers train, with the newest weights they hold; weights change only between batches "
        "(docs/algorithms.md: asynchronous RL).",
    )
    decode: Literal["auto", "eager", "graph"] = Field(
        "auto",
        description="The native generator's decode loop. graph: a static KV cache and one CUDA-graph "
        "replay per token (needs a CUDA GPU); eager: one Python-issued forward per token over a growing "
        "cache (the reference, and the CPU path); auto: graph on CUDA, eager elsewhere "
        "(docs/engines.md: decoding).",
    )


class KlSpec(StrictModel):
    """Optional KL penalty against the initial policy."""

    coef: float = Field(0.0, ge=0.0, le=10.0, description="Weight of the KL term; 0 disables it.")
    kind: Literal["k1", "k2", "k3"] = Field("k3", description="Per-token KL estimator.")


class ImportanceSamplingSpec(StrictModel):
    """Correction for the trainer/generator mismatch; w = exp(logp_trainer - logp_gen) per token."""

    mode: IsMode = Field("tis", description="none | tis | icepop | seq-tis | seq-mask-tis | geo-mask.")
    low: float = Field(
        0.5,
        ge=0.0,
        le=1000.0,
        description="Lower bound on w (icepop, seq-mask-tis, geo-mask); at most `high`.",
    )
    high: float = Field(
        2.0, gt=0.0, le=1000.0, description="Upper bound / truncation C on w; at least `low`."
    )

    @model_validator(mode="after")
    def _bounds(self) -> ImportanceSamplingSpec:
        if self.low > self.high:
            raise ValueError(f"low ({self.low}) must not exceed high ({self.high})")
        return self


class AlgorithmSpec(StrictModel):
    """GRPO and its loss."""

    name: Literal["grpo"] = Field("grpo", description="RL algorithm.")
    advantage_normalization: Literal["std", "none"] = Field(
        "std", description="Divide group-centred rewards by the group std (`std`) or not."
    )
    clip_low: float = Field(0.2, ge=0.0, le=1.0, description="PPO clip range below 1.")
    clip_high: float = Field(0.2, ge=0.0, le=10.0, description="PPO clip range above 1 (clip-higher).")
    loss_aggregation: Aggregation = Field("token-mean", description="token-mean | seq-mean-token-mean.")
    kl: KlSpec = Field(default_factory=KlSpec)
    importance_sampling: ImportanceSamplingSpec = Field(default_factory=ImportanceSamplingSpec)
    minibatches: int = Field(1, ge=1, le=1024, description="Optimizer steps per RL step.")


class OptimizerSpec(StrictModel):
    """AdamW on the master weights."""

    lr: float = Field(1e-5, gt=0.0, le=1.0, description="Learning rate.")
    weight_decay: float = Field(0.0, ge=0.0, le=1.0, description="AdamW weight decay.")
    betas: tuple[Beta, Beta] = Field((0.9, 0.999), description="AdamW betas, each in [0, 1).")
    grad_clip: float = Field(1.0, gt=0.0, le=1e6, description="Max global gradient norm.")
    micro_batch_size: int = Field(32, ge=1, le=65536, description="Sequences per forward/backward pass.")


class WarmupSpec(StrictModel):
    """Optional supervised warm-up on the task's reference answers, before RL starts."""

    sft_steps: int = Field(0, ge=0, le=100_000, description="Supervised steps; 0 disables the warm-up.")
    batch_size: int = Field(64, ge=1, le=65536, description="Examples per supervised step.")
    lr: float = Field(1e-3, gt=0.0, le=1.0, description="Supervised learning rate.")
    target_accuracy: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Stop the warm-up once the policy's greedy accuracy on `check_size` training problems "
        "reaches this (checked every `check_interval` steps; `sft_steps` caps it), so that RL starts "
        "from a comparable policy whatever the seed; 0 runs all `sft_steps`.",
    )
    check_interval: int = Field(25, ge=1, le=100_000, description="Supervised steps between accuracy checks.")
    check_size: int = Field(128, ge=1, le=65536, description="Training problems of each accuracy check.")


class ValidationSpec(StrictModel):
    """Accuracy on held-out problems of the task, which training never sees (NeMo RL's validation).
    Off by default: holding problems out of a dataset file shrinks its training set."""

    interval: int = Field(
        0,
        ge=0,
        le=10_000_000,
        description="RL steps between evaluations (and at the last step); 0 disables validation.",
    )
    size: int = Field(
        128,
        ge=1,
        le=100_000,
        description="Held-out problems: reasoning-gym items after task.size whose question is not a "
        "training question; for a dataset file, its last `size` rows (removed from training).",
    )
    temperature: float = Field(
        0.0,
        ge=0.0,
        le=10.0,
        description="Sampling temperature of the evaluation; 0 = greedy (argmax), one response per problem.",
    )
    pass_k: int = Field(
        0,
        ge=0,
        le=64,
        description="Also sample k responses per held-out problem at pass_k_temperature and report "
        "val/pass@k, the share of problems with at least one fully correct response among them "
        "(0: off; val/pass@1 is the single-response accuracy either way).",
    )
    pass_k_temperature: float = Field(
        1.0, gt=0.0, le=10.0, description="Sampling temperature of the pass@k responses."
    )


class JobSpec(StrictModel):
    """One RL post-training job."""

    model: ModelSpec = Field(default_factory=lambda: ModelSpec(tiny=TinyModel()))
    tokenizer: TokenizerSpec = Field(default_factory=TokenizerSpec)
    task: TaskSpec = Field(default_factory=TaskSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    warmup: WarmupSpec = Field(default_factory=WarmupSpec)
    validation: ValidationSpec = Field(default_factory=ValidationSpec)
    precision: PrecisionSpec = Field(default_factory=PrecisionSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    steps: int = Field(20, ge=1, le=10_000_000, description="RL steps.")
    checkpoint_interval: int = Field(
        10, ge=1, le=10_000_000, description="Steps between checkpoints (and at the end)."
    )
    output_dir: str = Field("runs/job", description="Metrics, checkpoints, audit and resolved spec go here.")

    @model_validator(mode="after")
    def _cross_field(self) -> JobSpec:
        if self.tokenizer.kind == "huggingface" and self.tokenizer.name is None and self.model.name is None:
            raise ValueError("tokenizer.name is required with tokenizer.kind=huggingface and model.tiny")
        if self.tokenizer.kind == "bytes" and self.model.name is not None and self.model.pretrained:
            raise ValueError("a pretrained model needs its own tokenizer: set tokenizer.kind=huggingface")
        if self.task.chat_template and self.tokenizer.kind == "bytes":
            raise ValueError(
                "task.chat_template needs a Hugging Face tokenizer with a chat template, but tokenizer.kind "
                "is bytes (no template); set tokenizer.kind: huggingface, or task.chat_template: false"
            )
        res = self.resources
        if res.trainer_engine == "megatron" and self.algorithm.kl.coef > 0:
            raise ValueError(
                "algorithm.kl.coef > 0 needs a frozen reference model, which trainer_engine megatron does "
                "not hold; set algorithm.kl.coef: 0 or resources.trainer_engine: native"
            )
        if (
            res.trainer_engine == "megatron"
            and res.gpus_per_trainer == 0
            and self.precision.recipe == "fp8-e2e"
        ):
            raise ValueError(
                "precision.recipe fp8-e2e trains with Transformer Engine's FP8 GEMMs, which need CUDA GPUs; "
                "the megatron trainer on CPU (resources.gpus_per_trainer 0) runs BF16: set precision.recipe "
                "bf16 or fp8-gen, resources.gpus_per_trainer 1, or resources.trainer_engine native"
            )
        tiny = self.model.tiny
        if res.trainer_engine == "megatron" and tiny is not None:
            tp, pp = res.trainer_tensor_parallel_size, res.trainer_pipeline_parallel_size
            if tiny.num_layers % pp:
                raise ValueError(
                    f"model.tiny.num_layers ({tiny.num_layers}) must be a multiple of "
                    f"resources.trainer_pipeline_parallel_size ({pp}): each stage holds the same layers"
                )
            if tiny.num_kv_heads % tp or tiny.num_heads % tp:
                raise ValueError(
                    f"model.tiny.num_heads ({tiny.num_heads}) and num_kv_heads ({tiny.num_kv_heads}) must be "
                    f"multiples of resources.trainer_tensor_parallel_size ({tp}): each rank holds whole heads"
                )
        p = self.precision
        if len(set(p.bf16_layers)) != len(p.bf16_layers):
            raise ValueError(
                f"precision.bf16_layers {list(p.bf16_layers)} names a layer twice; name each once"
            )
        if p.bf16_layers and res.trainer_engine == "megatron" and p.recipe == "fp8-e2e":
            raise ValueError(
                "precision.bf16_layers: Megatron keeps only the first and last layers in BF16; use "
                "precision.keep_bf16_layers, or resources.trainer_engine native"
            )
        if self.precision.exact:
            _check_exact(self)
        return self


def _check_exact(spec: JobSpec) -> None:
    """What ``precision.exact`` cannot be combined with, and what to do instead."""
    p, res = spec.precision, spec.resources
    if spec.rollout.max_staleness > 0:
        raise ValueError(
            f"precision.exact is on-policy by definition, but rollout.max_staleness "
            f"({spec.rollout.max_staleness}) trains on batches generated by older weights; set "
            "rollout.max_staleness: 0 or precision.exact: false"
        )
    if p.recipe == "fp8-gen":
        raise ValueError(
            "precision.exact needs both engines to compute alike, but recipe fp8-gen samples in FP8 and "
            "trains in BF16; set precision.recipe to bf16 or fp8-e2e, or precision.exact: false"
        )
    if p.fp8_kv_cache:
        raise ValueError(
            "precision.exact does not support precision.fp8_kv_cache yet (its row-exact attention reads "
            "BF16 K/V); set precision.fp8_kv_cache: false or precision.exact: false"
        )
    if res.generator_engine != "native" or res.trainer_engine != "native":
        raise ValueError(
            "precision.exact needs resources.generator_engine and resources.trainer_engine native (vLLM "
            "would need its batch-invariant mode and a trainer on the same kernels); set both to native "
            "or precision.exact: false"
        )
    if res.gpus_per_generator or res.gpus_per_trainer:
        raise ValueError(
            "precision.exact is verified on CPU only (CUDA GEMMs pick kernels by batch shape); set "
            "resources.gpus_per_generator and gpus_per_trainer to 0 or precision.exact: false"
        )


class SpecError(ValueError):
    """A job spec that does not validate; ``problems`` holds one ``path: message`` per error."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.problems = problems
        super().__init__(f"invalid job spec {source}:\n" + "\n".join(f"  - {p}" for p in problems))


def describe_errors(err: ValidationError) -> list[str]:
    """``field.path: message (got: value)`` for each pydantic error."""
    out = []
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "(spec)"
        got = "" if e["type"] == "missing" else f" (got {e.get('input')!r:.80})"
        out.append(f"{path}: {e['msg']}{got}")
    return out


def parse_spec(data: Any, source: str = "") -> JobSpec:
    """Validate a mapping (parsed YAML/JSON) as a :class:`JobSpec`; raise :class:`SpecError`."""
    if not isinstance(data, dict):
        raise SpecError(source, [f"(spec): expected a mapping of fields, got {type(data).__name__}"])
    try:
        return JobSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(source, describe_errors(err)) from None


def load_spec(path: str | Path) -> JobSpec:
    """Read a YAML or JSON job spec; an ``RLJob`` manifest's ``spec.job`` is accepted too."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as err:
        raise SpecError(str(p), [f"cannot read the file: {err.strerror}"]) from None
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        raise SpecError(str(p), [f"not valid YAML/JSON: {err}"]) from None
    if isinstance(data, dict) and data.get("kind") == "RLJob":
        data = (data.get("spec") or {}).get("job", {})
    return parse_spec(data, str(p))
