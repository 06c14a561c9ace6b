"""Exact on-policy numerics (``precision.exact``): building blocks whose result for one token does
not depend on anything but that token's own inputs.

The generator computes a token's log-prob in a batch of ``B`` sequences, left-padded to the
longest prompt of *its* batch, with the prompt in one prefill and the response one KV-cache decode
step at a time. The trainer computes the same token in a micro-batch of other sequences, padded
to another width, in one full-sequence forward. The two agree bit for bit when every op computes
a row (a token) the same way whatever the number of rows, the padding around it and the number
of keys it attends over. Elementwise ops already do (the same inputs give the same output), so the
work is in the reductions. Measured on the development CPU (torch 2.13, AVX2, 2 threads), rows
``X[:m]`` against the first ``m`` rows of the whole batch:

    float32 matmul     NOT row-invariant: m in {1, 2, 3, 5, 7, 9} differs (another kernel for small
                       or odd M), and columns likewise for N in {1, 7}. With the rows zero-padded to
                       a multiple of 16 every m in 1..699 agrees (K, N up to 1024 x 2048).
    bfloat16 matmul    row- and column-invariant for every m tried (1-200), but 8-13x slower than
                       float32 on CPUs without BF16 matrix instructions.
    LlamaRMSNorm       row-invariant (hidden 64, 896, 4096).
    (log_)softmax      row-invariant over the last dim (V up to 151936).
    sum over last dim  row-invariant, except one row of 151936: a single long row is split between
                       the threads.
    cumsum             sequential, accumulating in float64 (equal to numpy's float64 cumsum rounded
                       to float32, along any dim): leading and trailing zeros change nothing.
    exp, log, cos, sin, sigmoid, silu, rsqrt (float32)
                       position-invariant (a vector lane and a scalar tail agree); ``rsqrt`` in
                       BF16 is not (its tail differs), so it is only ever applied in float32.
    SDPA               a decode query differs from the same row of the full causal forward (max
                       1e-7): its reduction over keys depends on how many keys there are.

So this module has:

- :func:`fixed_sum`: the reduction every block uses, a ``cumsum`` read at its end, i.e. a strictly
  sequential sum in float64: the same for a row whatever the shape around it, and zeros anywhere
  (masked keys, padding) add exactly nothing.
- :func:`exact_linear` (and :class:`ExactLinear`): the BF16 GEMM as a float32 GEMM on BF16 values
  (exact products, float32 accumulation, one rounding), rows padded to a multiple of
  :data:`ROW_MULTIPLE` so the kernel never changes with M. FP8 layers pad the same way
  (``Fp8LinearConfig.rows_multiple``); their activations are quantized per token (1x128 tiles
  are per row, and an amax is exact).
- :func:`rms_norm` (:class:`ExactRMSNorm`) and :func:`log_softmax` on :func:`fixed_sum`.
- :func:`exact_attention`: scores, softmax and the weighted sum of values in float32 with
  :func:`fixed_sum` over the head dim and over keys; masked keys get probability exactly 0. A
  query's row is then the same in a prefill, in a decode step over the KV cache and in the
  trainer's full-sequence forward, with any left padding and any batch.

RoPE and the MLP's SiLU stay Hugging Face's: elementwise float32 (cos/sin of ``inv_freq *
position``, a single product) and BF16 SiLU, both measured position-invariant above.

Cost: attention materializes ``[B, H, q, T, D]`` products (no fused kernel), and every reduction is
a sequential scan. Fine for the tiny CPU models this mode targets; measured in docs/precision.md.

CUDA: not verified. cuBLAS picks GEMM kernels (and split-K) by shape, so padding M is no proof of
row invariance there; the spec refuses ``exact`` with GPUs and :func:`check_device` refuses a CUDA
device.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# Rows of every float32 GEMM are zero-padded to a multiple of this (see the module docstring).
ROW_MULTIPLE = 16
# The attention implementation name models built for exact mode carry in their config.
EXACT_ATTENTION = "fp8rl_exact"


def check_device(device: torch.device | str) -> None:
    """Refuse a device on which exact mode is not verified (CUDA: cuBLAS is not batch-invariant)."""
    if torch.device(device).type == "cuda":
        raise ValueError(
            "precision.exact is verified on CPU only: CUDA GEMMs (cuBLAS) choose kernels by batch "
            "shape, so generator and trainer need not agree bit for bit; set precision.exact: false "
            "on GPUs (importance sampling corrects the mismatch) or run on CPU"
        )


def fixed_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over ``dim`` (removed) as one sequential pass in float64, rounded once to ``x``'s dtype.

    ``torch.cumsum`` on CPU accumulates left to right in float64 (measured), so a row's sum does not
    depend on the other rows, on the length of the dim beyond its non-zero entries, or on where
    zeros sit in it. ``x`` must be float32 (a BF16 cumsum accumulates in float32).
    """
    return x.cumsum(dim).select(dim, -1)


def pad_rows(x2d: torch.Tensor, multiple: int = ROW_MULTIPLE) -> torch.Tensor:
    """``x2d [M, K]`` with zero rows appended up to a multiple of ``multiple`` rows."""
    extra = -x2d.shape[0] % multiple
    return F.pad(x2d, (0, 0, 0, extra)) if extra else x2d


def exact_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` in ``x``'s dtype: a float32 GEMM on padded rows, then the bias.

    ``x [..., K]``, ``weight [N, K]``, ``bias [N]`` -> ``[..., N]``. BF16 inputs times BF16 weights
    are exact in float32, so this is a BF16 GEMM with float32 accumulation and one rounding.
    """
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1])  # [M, K]
    y = (pad_rows(x2d).float() @ weight.float().t())[: x2d.shape[0]]  # [M, N] float32
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*lead, weight.shape[0])


class ExactLinear(nn.Linear):
    """``nn.Linear`` computing :func:`exact_linear` (same parameters and names)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return exact_linear(x, self.weight, self.bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's Llama/Qwen2 RMSNorm (float32 inside, output in ``x``'s dtype times the
    weight) with the mean of squares as a :func:`fixed_sum`. ``x [..., H]``, ``weight [H]``."""
    h = x.float()
    var = fixed_sum(h * h, -1).unsqueeze(-1) / h.shape[-1]  # [..., 1]
    return weight * (h * torch.rsqrt(var + eps)).to(x.dtype)


class ExactRMSNorm(nn.Module):
    """Takes the place of a ``LlamaRMSNorm`` / ``Qwen2RMSNorm`` (its ``weight`` and
    ``variance_epsilon`` stay; :func:`make_exact` swaps the class)."""

    weight: nn.Parameter
    variance_epsilon: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.variance_epsilon)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """``log_softmax`` over the last dim of float32 ``logits [..., V]``, the normaliser a
    :func:`fixed_sum`; ``max`` and the elementwise ops are row-invariant as they are."""
    peak = logits.amax(-1, keepdim=True)  # [..., 1]
    total = fixed_sum(torch.exp(logits - peak), -1).unsqueeze(-1)  # [..., 1]
    return logits - (peak + torch.log(total))


def exact_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention with Hugging Face's attention-function signature, row-exact (module docstring).

    ``query [B, H, q, D]``, ``key``/``value [B, Hkv, T, D]`` (GQA: head ``h`` reads kv head
    ``h // (H / Hkv)``), ``attention_mask [B, 1, q, T]`` bool, True where a key is seen (every
    query sees itself: :func:`workers.engines.models.attention_mask_4d`). Returns
    ``([B, q, H, D] in query's dtype, None)``. No dropout (RL runs in eval mode).
    """
    if attention_mask is None or attention_mask.dtype != torch.bool:
        raise ValueError("exact attention needs the boolean 4-D mask of attention_mask_4d")
    groups = query.shape[1] // key.shape[1]
    q = query.float()[:, :, :, None, :]  # [B, H, q, 1, D]
    k = key.float().repeat_interleave(groups, dim=1)[:, :, None, :, :]  # [B, H, 1, T, D]
    v = value.float().repeat_interleave(groups, dim=1)[:, :, None, :, :]  # [B, H, 1, T, D]
    scores = fixed_sum(q * k, -1) * scaling  # [B, H, q, T]
    scores = scores.masked_fill(~attention_mask, float("-inf"))
    e = torch.exp(scores - scores.amax(-1, keepdim=True))  # masked keys: exactly 0
    p = e / fixed_sum(e, -1).unsqueeze(-1)  # [B, H, q, T]
    out = fixed_sum(p[..., None] * v, -2)  # [B, H, q, D]: sum over keys, in order
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(EXACT_ATTENTION, exact_attention)


_register()


def make_exact(model: nn.Module) -> None:
    """Rebuild ``model`` (a Hugging Face Llama/Qwen2) in place on the exact blocks: every
    ``nn.Linear`` computes :func:`exact_linear`, every RMSNorm :func:`rms_norm`, attention
    :func:`exact_attention`. Parameters, names and weights are unchanged."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.__class__ = ExactLinear
        elif type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            module.__class__ = ExactRMSNorm
    model.config._attn_implementation = EXACT_ATTENTION  # type: ignore[union-attr]


def is_exact(model: Any) -> bool:
    """Whether ``model`` was built by :func:`make_exact`."""
    return str(getattr(model.config, "_attn_implementation", "")) == EXACT_ATTENTION
