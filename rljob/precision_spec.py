"""The job spec's ``precision``: the recipe, the FP8 formats, the KV cache, which decoder layers stay
BF16, and the mismatch SLO.

Re-exported by :mod:`rljob.spec` (``from rljob.spec import PrecisionSpec`` keeps working). The
checks that need other parts of the spec (the engines, the model's layers) are in
:class:`rljob.spec.JobSpec`. :func:`bf16_layer_reason` is the one rule of which decoder layers an
FP8 engine keeps in BF16, with the reason each engine's audit prints.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Annotated, Literal

from pydantic import Field

from rljob.mismatch_slo import MismatchSloSpec
from rljob.spec_base import StrictModel

Recipe = Literal["bf16", "fp8-gen", "fp8-e2e"]
LayerCount = Annotated[int, Field(ge=0, le=128)]  # decoder layers (TinyModel.num_layers' range)
LayerIndex = Annotated[int, Field(ge=0, le=127)]  # a decoder layer, counted from 0


class PrecisionSpec(StrictModel):
    """Where FP8 is used (docs/precision.md: precision recipes)."""

    recipe: Recipe = Field("fp8-e2e", description="bf16 | fp8-gen | fp8-e2e.")
    fp8_format: Literal["e4m3", "hybrid"] = Field(
        "e4m3",
        description="FP8 training GEMMs: `e4m3` = E4M3 with blockwise scales on fprop, dgrad and wgrad "
        "(Transformer Engine's Float8BlockScaling, NeMo RL, DeepSeek-V3); `hybrid` = E5M2 gradients.",
    )
    fp8_kv_cache: bool = Field(
        False,
        description="Store the generator's KV cache in FP8 (E4M3), with per-layer power-of-two scales the "
        "trainer calibrates before the first rollout and after every update.",
    )
    fp8_kv_cache_in_training: bool = Field(
        True,
        description="With fp8_kv_cache: the trainer's forward reads K and V rounded as the generators' FP8 "
        "cache holds them (same scales; gradient straight through), so both engines attend over the same "
        "values; false: the trainer attends over BF16 K/V (NeMo RL's choice) and importance sampling "
        "corrects the difference (docs/precision.md: FP8 KV cache).",
    )
    kv_calibration_sequences: int = Field(
        64,
        ge=0,
        le=65536,
        description="With fp8_kv_cache: how many of a step's sequences (per trainer, evenly spaced over its "
        "rows) the trainer runs its K/V-scale calibration forward on after each update; 0: all of them. "
        "The scales are the amax of those sequences' K and V, rounded up to a power of two, which leaves "
        "1-2x of headroom for the rest (docs/precision.md: FP8 KV cache).",
    )
    keep_bf16_layers: tuple[LayerCount, LayerCount] = Field(
        (0, 0), description="(first, last): decoder layers kept in BF16 at each end."
    )
    bf16_layers: tuple[LayerIndex, ...] = Field(
        (),
        max_length=128,
        description="Decoder layers kept in BF16 by index, beside keep_bf16_layers' ends (native "
        "engines and vLLM; the mismatch SLO's bf16-layers action adds to it).",
    )
    power_of_two_scales: bool = Field(False, description="Round FP8 scales to powers of two.")
    master_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Trainer's master weights and optimizer state."
    )
    exact: bool = Field(
        False,
        description="Exact on-policy RL: generator and trainer compute every token's log-prob bit for bit "
        "alike (row-invariant matmul, norms, softmax and attention, whatever the batch, padding or KV "
        "cache), so the importance-sampling correction is a no-op; a step whose log-probs differ fails "
        "with the first differing token and layer. Recipes bf16 and fp8-e2e, native engines, CPU only; "
        "slower (docs/precision.md: exact on-policy RL).",
    )
    mismatch_slo: MismatchSloSpec = Field(
        default_factory=MismatchSloSpec,
        description="The train/generation mismatch the job is held to: a median and a tail bound over a "
        "window of steps, the recipe's by default (docs/precision.md: the mismatch SLO).",
    )

    def bf16_decoder_layers(self, layers: int) -> frozenset[int]:
        """Of a model's ``layers`` decoder layers, those an FP8 engine keeps in BF16:
        ``keep_bf16_layers``' first and last ones, and the ``bf16_layers``."""
        return frozenset(
            i for i in range(layers) if bf16_layer_reason(i, layers, self.keep_bf16_layers, self.bf16_layers)
        )


def bf16_layer_reason(
    index: int, layers: int, keep: tuple[int, int], named: Collection[int] = ()
) -> str | None:
    """Why an FP8 engine keeps decoder layer ``index`` of ``layers`` in BF16, or None when it goes
    FP8: among the first or last ``keep`` (``precision.keep_bf16_layers``), or ``named``
    (``precision.bf16_layers``). The one rule: the native engines' conversion, vLLM's layout,
    Megatron's audit and the SLO's ``bf16-layers`` action all ask it."""
    first, last = keep
    if index < first:
        return f"decoder layer {index} is among the first {first} kept in BF16 (keep_bf16_layers)"
    if index >= layers - last:
        return f"decoder layer {index} is among the last {last} kept in BF16 (keep_bf16_layers)"
    if index in named:
        return f"decoder layer {index} is named in bf16_layers"
    return None
