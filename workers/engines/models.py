"""Build the policy a job spec names: a Hugging Face Llama/Qwen2, from a hub id/path or inline.

Trainer and generators call :func:`build_policy` with the same spec and get the same
architecture, parameter names and (for random init) the same weights; the generators receive the
trainer's weights over the weight sync before their first rollout anyway.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rljob.spec import JobSpec, PrecisionSpec
from workers.engines.exact import EXACT_ATTENTION, ROW_MULTIPLE, check_device, make_exact
from workers.fp8.convert import Fp8Audit, convert_model
from workers.fp8.cpu_bf16 import cpu_bf16_gemm
from workers.fp8.linear import Fp8Linear
from workers.fp8.linear_config import Fp8LinearConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# The dtype both engines compute in between the GEMMs (residual stream, norms, attention, RoPE's
# output, logits), as vLLM serves a model and Megatron-Core + Transformer Engine train it.
COMPUTE_DTYPE = torch.bfloat16


def padded_vocab(vocab_size: int, multiple: int = 16) -> int:
    """Round a vocabulary up so the embedding and lm_head shapes are tensor-core friendly."""
    return -(-vocab_size // multiple) * multiple


def model_config(spec: JobSpec, vocab_size: int) -> Any:
    """The Hugging Face config (typed Any: transformers configs are dynamic)."""
    tiny = spec.model.tiny
    if tiny is None:
        from transformers import AutoConfig

        assert spec.model.name is not None
        return AutoConfig.from_pretrained(spec.model.name)
    from transformers import LlamaConfig, Qwen2Config

    common: dict[str, Any] = dict(
        vocab_size=padded_vocab(vocab_size),
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_layers,
        num_attention_heads=tiny.num_heads,
        num_key_value_heads=tiny.num_kv_heads,
        max_position_embeddings=tiny.max_position_embeddings,
        tie_word_embeddings=tiny.tie_word_embeddings,
    )
    return LlamaConfig(**common) if tiny.arch == "llama" else Qwen2Config(**common)


def build_policy(
    spec: JobSpec,
    vocab_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    init_on_host: bool = False,
) -> Any:
    """The policy model in ``dtype`` on ``device``, in eval mode (no dropout in RL); built on the
    row-exact blocks of :mod:`workers.engines.exact` under ``precision.exact``. A random init is
    drawn on ``device`` (GPU or meta) unless ``init_on_host``."""
    from transformers import AutoModelForCausalLM

    dev = torch.device(device)
    if spec.model.name is not None and spec.model.pretrained:
        model = AutoModelForCausalLM.from_pretrained(spec.model.name, dtype=dtype)
    else:
        torch.manual_seed(spec.model.init_seed)
        # On a GPU (or meta) the model is built where it runs: no host initialisation and copy
        # (~15-20 s for the 1B preset). A GPU draws the weights from its own generator, whose
        # numbers for a seed depend on the GPU model (its kernels' grid follows the SM count), not
        # the CPU's. A run syncs the trainer's weights to its generators before the first rollout,
        # so only the trainer's count; data-parallel trainers, which must start equal on any mix
        # of GPUs, draw on the host (init_on_host).
        on_device = dev.type in ("cuda", "meta") and not init_on_host
        with dev if on_device else torch.device("cpu"):
            model = AutoModelForCausalLM.from_config(model_config(spec, vocab_size))  # type: ignore[no-untyped-call]
        model = model.to(dtype)
    _float32_rope(model)
    # Eager attention on CPU (for RL's short sequences its backward is ~1.6x faster than SDPA's
    # CPU flash kernel, measured on the example's 2-layer model), with float32 GEMMs on BF16
    # values (cpu_attention); SDPA on GPU.
    model.config._attn_implementation = "sdpa" if dev.type == "cuda" else CPU_ATTENTION
    if dev.type == "cpu":
        for module in model.modules():
            if type(module) is nn.Linear:
                module.__class__ = CpuBf16Linear  # same parameters and names, another forward
    if spec.precision.exact:
        check_device(device)
        make_exact(model)
    moved: Any = model
    return moved.to(device).eval()


class CpuBf16Linear(nn.Linear):
    """``nn.Linear`` whose BF16 GEMM on CPU runs as :func:`cpu_bf16_gemm` says: torch's own BF16
    GEMM where the CPU has BF16 matrix instructions, else a float32 GEMM on the BF16 values,
    output rounded to BF16. Either is what a BF16 GEMM computes (exact products, float32
    accumulation, one rounding at the end), at the fastest speed the CPU offers. Both engines use
    it on CPU, so they still compute the same function. Other dtypes pass through unchanged."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or x.device.type != "cpu" or cpu_bf16_gemm() == "native":
            return super().forward(x)
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight.float(), bias).to(torch.bfloat16)


CPU_ATTENTION = "fp8rl_cpu_eager"
# attention implementations that take a bool mask (True = attend); the others an additive one.
# "fp8rl_decode": the static decode loop's Triton attention, SDPA outside decode steps
BOOL_MASKS = ("sdpa", EXACT_ATTENTION, "fp8rl_decode")


def cpu_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's eager attention, step for step (scores rounded to the activation dtype and
    scaled, the additive mask added, softmax in float32 rounded back, the weighted sum), with its
    two batched GEMMs done as :class:`CpuBf16Linear` does its GEMM (:func:`cpu_bf16_gemm`): without
    BF16 matrix instructions float32 on the BF16 values, one rounding of the output, since torch's
    BF16 ``bmm`` there walks the batch one small matrix at a time (~30x slower than float32 for
    the example's 256 x 4 heads of 12 x 32, measured on an AVX2 host); with them torch's own BF16
    ``matmul``, i.e. Hugging Face's eager attention as it is. Both engines use it on CPU.

    ``query [B, H, q, D]``, ``key``/``value [B, Hkv, T, D]`` (GQA: head ``h`` reads kv head
    ``h // (H / Hkv)``), ``attention_mask [B, 1, q, T]`` additive
    (:func:`attention_mask_4d`). Returns ``([B, q, H, D], weights [B, H, q, T])``.
    """
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    dtype = query.dtype
    narrow = dtype in (torch.bfloat16, torch.float16) and not (
        dtype == torch.bfloat16 and cpu_bf16_gemm() == "native"
    )
    wide = torch.float32 if narrow else dtype
    scores = torch.matmul(query.to(wide), key.to(wide).transpose(2, 3)).to(dtype) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    out = torch.matmul(weights.to(wide), value.to(wide)).to(dtype)  # [B, H, q, D]
    return out.transpose(1, 2).contiguous(), weights


def _register_cpu_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(CPU_ATTENTION, cpu_attention)
    # called without a 4-D mask, the model builds eager's additive causal mask for it (an
    # attention name with no mask function registered would get no mask at all: not causal)
    AttentionMaskInterface.register(CPU_ATTENTION, eager_mask)


_register_cpu_attention()


def _float32_rope(model: nn.Module) -> None:
    """Give every rotary embedding its float32 inverse frequencies back, computed on the host.

    ``model.to(bfloat16)`` casts buffers too, and a BF16 ``inv_freq`` is off by up to 2^-9
    relative: at position 100 the angle is off by ~0.2 rad, so a BF16 generator and a float32
    trainer would not compute the same RoPE. vLLM and Megatron compute the frequencies in float32
    and round only cos/sin to the activation dtype, and so do both our engines.
    """
    for module in model.modules():
        inv_freq = getattr(module, "inv_freq", None)
        config = getattr(module, "config", None)
        if not isinstance(inv_freq, torch.Tensor) or config is None:
            continue
        if inv_freq.dtype == torch.float32 and inv_freq.device.type == "cpu":
            continue  # else: cast, or computed on a GPU (whose pow may differ from the host's)
        fresh = type(module)(config)  # built in float32, on the host
        for name, buf in fresh.named_buffers(recurse=False):
            setattr(module, name, buf.to(device=inv_freq.device, dtype=torch.float32))


def compute_params(model: nn.Module, dtype: torch.dtype = COMPUTE_DTYPE) -> dict[str, torch.Tensor]:
    """The trainer's forward-pass parameters: each master parameter cast to ``dtype``, so that
    the trainer computes between its GEMMs exactly what a generator holding ``dtype`` weights
    computes. FP8 layers' weights are left out: they are quantized from the master weight itself
    (the same FP8 bytes the generators receive). The casts are differentiable, so gradients reach
    the master parameters, and accumulate there, in the master dtype (float32)."""
    fp8_weights = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, Fp8Linear)}
    return {
        name: p.to(dtype)
        for name, p in model.named_parameters()
        if name not in fp8_weights and p.dtype != dtype
    }


def attention_mask_4d(
    attn: torch.Tensor, q_len: int, dtype: torch.dtype, implementation: str
) -> torch.Tensor:
    """The attention mask of the last ``q_len`` positions of ``attn [B, T]`` (1 = a real token).

    Query ``i`` (absolute position ``T - q_len + i``) sees the real keys at or before it, and
    always itself, so a padding query never has an empty row (its output is never read). Built
    here rather than by Hugging Face because HF's SDPA mask asks the host whether the mask is all
    ones (``.all()`` read back), a GPU sync on every forward. Returns ``[B, 1, q_len, T]``: bool
    for ``sdpa``; for ``eager`` and :func:`cpu_attention` additive in ``dtype`` (0 where seen,
    dtype min elsewhere), as HF builds it, so both engines mask alike. The exact attention takes
    the bool mask too.
    """
    t = attn.shape[1]
    q_pos = torch.arange(t - q_len, t, device=attn.device)[:, None]  # [q, 1]
    k_pos = torch.arange(t, device=attn.device)[None, :]  # [1, T]
    seen = (k_pos <= q_pos)[None, None] & attn.bool()[:, None, None, :]  # [B, 1, q, T]
    seen = seen | (k_pos == q_pos)[None, None]
    if implementation in BOOL_MASKS:
        return seen
    zero = torch.zeros((), dtype=dtype, device=attn.device)
    return torch.where(seen, zero, torch.finfo(dtype).min)


def fp8_config(precision: PrecisionSpec) -> Fp8LinearConfig:
    return Fp8LinearConfig.for_format(
        precision.fp8_format,
        power_of_two_scales=precision.power_of_two_scales,
        rows_multiple=ROW_MULTIPLE if precision.exact else 1,
    )


def apply_recipe(model: nn.Module, precision: PrecisionSpec, role: str) -> Fp8Audit:
    """Convert ``model`` for its role (``generator`` | ``trainer``) under the spec's recipe.

    Generators are FP8 for ``fp8-gen`` and ``fp8-e2e``; the trainer only for ``fp8-e2e``.
    """
    fp8 = precision.recipe == "fp8-e2e" or (precision.recipe == "fp8-gen" and role == "generator")
    audit = convert_model(
        model,
        "fp8-e2e" if fp8 else "bf16",
        keep_bf16=tuple(precision.keep_bf16_layers),  # type: ignore[arg-type]
        config=fp8_config(precision),
        gemms=("fprop", "dgrad", "wgrad") if role == "trainer" else ("fprop",),
        bf16_layers=precision.bf16_layers,
    )
    # label the audit with the job's recipe, and say why a whole engine stays high precision
    audit.recipe = precision.recipe
    audit.rows = [
        replace(r, reason=f"recipe {precision.recipe}: the {role} runs BF16")
        if r.reason == "recipe bf16"
        else r
        for r in audit.rows
    ]
    return audit
