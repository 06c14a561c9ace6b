"""RMSNorm in one kernel for the native generator and trainer alike (``FP8RL_RMS_NORM=triton``).

Hugging Face's ``LlamaRMSNorm`` (and Qwen2's) is about six kernels per call: the float32 copy,
the square, the mean, the ``rsqrt``, the product, the BF16 copy and the weight's product. A
decoder layer has two, and a decode step runs them for every layer. :func:`fuse_norms` gives
each such module a forward that runs :mod:`workers.engines.native.triton_norm` instead: one
read of the row, one write, the same two roundings to BF16. Its sum of squares is Triton's, in
another order than torch's, so a value may land one BF16 step from Hugging Face's. The native
generator and the native trainer both apply it to the model they build where the switch is on,
so the trainer computes the norm with the same kernel and gets the same bits as the generator,
row for row. The residual add after attention runs inside the post-attention norm's
kernel (the decoder layers' forward, :func:`_layer_forward`). The backward is RMSNorm's gradient
in float32 from the saved ``1/rms``: ``dx = rstd (g - y mean(g y))``, ``g = dout w``,
``dw = sum(dout bf16(y))``; the add's is the identity.

In an FP8 generator, :func:`emit_fp8_tiles` has each decoder layer's two norms write their output
in 1x128 tiles too, in the same pass, where every projection reading it (q/k/v; gate/up) is an FP8
layer with 1x128 input tiles of one format and scale rule: the bytes and scales those projections'
input quantizer would make (:func:`workers.fp8.linear_gemm.attach_input_tiles`), so that pass is
skipped, and the logits stay bit for bit the same. :func:`chain_layer_adds` moves each layer's
closing residual add into the next norm's kernel too (the next layer's input norm, or the final
norm), so a generator's decode step runs no add kernel of its own.

Only BF16 inputs on CUDA (or the CPU under Triton's interpreter, for tests) take it; anything
else keeps Hugging Face's forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# the RMSNorm modules whose forward is Hugging Face's weight * bf16(x * rsqrt(mean(x^2) + eps))
NORM_MODULES = ("LlamaRMSNorm", "Qwen2RMSNorm")


def enabled(device: torch.device) -> bool:
    """``FP8RL_RMS_NORM``: ``torch`` (default until a GPU has measured it) or ``triton``. Asked for
    where it cannot run, it logs why once and Hugging Face's norm runs."""
    from workers.fp8.dispatch import triton_switch

    return triton_switch("FP8RL_RMS_NORM", "torch", "triton", device, "Hugging Face's RMSNorm")


def fuse_norms(model: nn.Module, device: torch.device) -> int:
    """Where the switch is on for ``device`` (and the model is not row-exact: its blocks are its
    own), give each of the model's :data:`NORM_MODULES` the one-kernel forward, and each decoder
    layer of :data:`LAYER_MODULES` a forward whose residual add after attention runs in the
    post-attention norm's kernel; returns how many norms it took."""
    from workers.engines.exact import is_exact

    if is_exact(model) or not enabled(device):
        return 0
    from workers.fp8.fused import take_forward

    taken = 0
    module: Any
    for module in model.modules():
        kind = type(module).__name__
        if kind in NORM_MODULES:
            taken += take_forward(module, _norm_forward)
        elif kind in LAYER_MODULES and type(module.post_attention_layernorm).__name__ in NORM_MODULES:
            take_forward(module, _layer_forward)
    return taken


def emit_fp8_tiles(model: nn.Module) -> int:
    """For an FP8 generator whose norms :func:`fuse_norms` took: each decoder layer's input norm
    (read by q/k/v) and post-attention norm (read by gate/up) whose readers are all FP8 layers of
    one config with 1x128 input tiles also writes its output in those tiles, in inference (no
    autograd). Returns how many norms emit."""
    from workers.fp8.fp8_tensor import TILE_1x128
    from workers.fp8.linear import Fp8Linear

    emitting = 0
    module: Any
    for module in model.modules():
        if type(module).__name__ not in LAYER_MODULES:
            continue
        for norm, owner, names in (
            (module.input_layernorm, module.self_attn, ("q_proj", "k_proj", "v_proj")),
            (module.post_attention_layernorm, module.mlp, ("gate_proj", "up_proj")),
        ):
            found = [getattr(owner, n, None) for n in names]
            readers = [r for r in found if isinstance(r, Fp8Linear)]
            if not hasattr(norm, "fp8rl_hf_forward") or len(readers) < len(names):
                continue
            configs = {r.config for r in readers}
            cfg = readers[0].config
            if len(configs) == 1 and cfg.activation_block == TILE_1x128:
                norm.fp8rl_tiles_for = (cfg, f"{'+'.join(r.name for r in readers)}: input")
                emitting += 1
    return emitting


# the attribute of a decoder layer's output (the sum) that carries the next norm's output of it,
# computed in the same kernel as the sum (chain_layer_adds); and the layer's attribute naming that norm
NORMED_ATTR = "fp8rl_next_normed"
NEXT_NORM_ATTR = "fp8rl_next_norm"


def chain_layer_adds(model: nn.Module) -> int:
    """In inference (the generator): each decoder layer that :func:`fuse_norms` took ends with its
    residual add inside the kernel of the norm that reads the sum next (the next layer's input
    norm; after the last layer, the model's final norm), where that norm took the kernel too. The
    layer still returns the sum (what Hugging Face's loop and any hook see); the norm's output
    rides on it, and that norm returns it when handed that very tensor, unchanged since, once.
    Returns how many layers chain."""
    inner: Any = getattr(model, "model", None)
    layers = list(getattr(inner, "layers", ()))
    following = [layer.input_layernorm for layer in layers[1:]] + [getattr(inner, "norm", None)]
    chained = 0
    for layer, norm in zip(layers, following, strict=True):
        taken = type(layer).__name__ in LAYER_MODULES and hasattr(layer, "fp8rl_hf_forward")
        if taken and hasattr(norm, "fp8rl_hf_forward"):
            # a plain attribute: as a submodule it would enter the state dict under a second name
            object.__setattr__(layer, NEXT_NORM_ATTR, norm)
            chained += 1
    return chained


# the decoder layers whose forward is Hugging Face's pre-norm block (norm, attention, add, norm,
# MLP, add), the one _layer_forward computes with the second add inside the norm's kernel
LAYER_MODULES = ("LlamaDecoderLayer", "Qwen2DecoderLayer")


def _takes_kernel(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    return hidden.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and hidden.shape[-1] > 0


def _norm_forward(module: Any, hidden: torch.Tensor) -> torch.Tensor:
    ready = getattr(hidden, NORMED_ATTR, None)
    if ready is not None:  # the previous layer's closing add computed this norm (chain_layer_adds)
        delattr(hidden, NORMED_ATTR)  # taken once: the output's memory goes with its reader
        norm, normed, version = ready
        if norm is module and version == hidden._version:
            return normed  # type: ignore[no-any-return]
    if not _takes_kernel(hidden, module.weight):
        return module.fp8rl_hf_forward(hidden)  # type: ignore[no-any-return]
    if _emits(module):
        return _norm_with_tiles(module, hidden, None)[1]
    out: torch.Tensor = _RmsNormFn.apply(hidden, module.weight, float(module.variance_epsilon))  # type: ignore[no-untyped-call]
    return out


def _add_norm(norm: Any, hidden: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(residual + hidden, norm(residual + hidden))``: one kernel where it applies."""
    if not _takes_kernel(hidden, norm.weight) or residual.dtype != hidden.dtype:
        total = residual + hidden
        return total, norm(total)
    if _emits(norm):
        return _norm_with_tiles(norm, hidden, residual)
    eps = float(norm.variance_epsilon)
    total, out = _AddRmsNormFn.apply(hidden, residual, norm.weight, eps)  # type: ignore[no-untyped-call]
    return total, out


def _emits(norm: Any) -> bool:
    return getattr(norm, "fp8rl_tiles_for", None) is not None and not torch.is_grad_enabled()


def _norm_with_tiles(
    norm: Any, hidden: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, norm(s))`` for ``s = residual + hidden`` (or ``hidden``), the output carrying its 1x128
    tiles for the projections that read it (:func:`emit_fp8_tiles`), checked by the active finite
    guard under their names."""
    from workers.engines.native.triton_norm import rms_norm_fp8
    from workers.fp8.formats import get_format
    from workers.fp8.fp8_tensor import TILE_1x128
    from workers.fp8.guard import active_guard
    from workers.fp8.linear_gemm import attach_input_tiles, input_rows

    cfg, where = norm.fp8rl_tiles_for
    x2d = _rows(hidden)
    guard = active_guard()
    slot = guard.reserve(x2d.device, tuple(x2d.shape), TILE_1x128, where) if guard is not None else None
    rows_out = input_rows(x2d.shape[0], cfg, x2d.device)
    fmt, pow2, eps = get_format(cfg.forward_fmt), cfg.power_of_two_scales, float(norm.variance_epsilon)
    r2d = None if residual is None else _rows(residual)
    s2d, out2d, q = rms_norm_fp8(x2d, norm.weight.contiguous(), eps, r2d, fmt, pow2, rows_out, slot)
    out = out2d.view(hidden.shape)
    attach_input_tiles(out, q, pow2)
    return s2d.view(hidden.shape), out


def _layer_forward(layer: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Hugging Face's decoder layer (``LlamaDecoderLayer.forward``), step for step, with the add
    after attention and the post-attention norm in one kernel (:func:`_add_norm`), and in
    inference where :func:`chain_layer_adds` chained it, the closing add with the next norm."""
    if args:  # positional arguments past the hidden states: not how the model calls its layers
        return layer.fp8rl_hf_forward(hidden_states, *args, **kwargs)  # type: ignore[no-any-return]
    residual = hidden_states
    hidden_states = layer.input_layernorm(hidden_states)
    hidden_states, _ = layer.self_attn(hidden_states=hidden_states, **kwargs)
    residual, hidden_states = _add_norm(layer.post_attention_layernorm, hidden_states, residual)
    hidden_states = layer.mlp(hidden_states)
    following = getattr(layer, NEXT_NORM_ATTR, None)
    if following is None or torch.is_grad_enabled():
        return residual + hidden_states
    total, normed = _add_norm(following, hidden_states, residual)
    setattr(total, NORMED_ATTR, (following, normed, total._version))
    return total


def _norm_backward(
    ctx: Any, grad_out: torch.Tensor, s2d: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm's gradient (the module docstring) for ``grad_out`` shaped as ``s2d``: (ds float32,
    dw in the weight's dtype or None)."""
    g_out = grad_out.reshape(s2d.shape).float()
    y = s2d.float() * rstd[:, None]  # [R, D]: s / rms, float32
    g = g_out * weight.float()
    grad_s = rstd[:, None] * (g - y * (g * y).mean(-1, keepdim=True))
    grad_w = None
    if ctx.needs_input_grad[-2]:  # the weight is the second-to-last input of both functions
        grad_w = (g_out * y.to(torch.bfloat16).float()).sum(0).to(weight.dtype)
    return grad_s, grad_w


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2d = x.reshape(-1, x.shape[-1])
    return x2d if x2d.stride(-1) == 1 else x2d.contiguous()


class _RmsNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        from workers.engines.native.triton_norm import rms_norm

        x2d = _rows(x)
        _, out, rstd = rms_norm(x2d, weight.contiguous(), eps)
        ctx.save_for_backward(x2d, weight, rstd)
        return out.view(x.shape)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (dout,) = grads
        x2d, weight, rstd = ctx.saved_tensors
        grad_s, grad_w = _norm_backward(ctx, dout, x2d, weight, rstd)
        grad_x = grad_s.to(x2d.dtype).view(dout.shape) if ctx.needs_input_grad[0] else None
        return grad_x, grad_w, None


class _AddRmsNormFn(torch.autograd.Function):
    """``(s, norm(s))`` for ``s = residual + x``: both outputs feed the rest of the layer, so the
    sum's gradient is the one through the norm plus the one it receives directly."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from workers.engines.native.triton_norm import rms_norm

        s2d, out, rstd = rms_norm(_rows(x), weight.contiguous(), eps, _rows(residual))
        ctx.save_for_backward(s2d, weight, rstd)
        return s2d.view(x.shape), out.view(x.shape)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        d_sum, d_out = grads
        s2d, weight, rstd = ctx.saved_tensors
        grad_s, grad_w = _norm_backward(ctx, d_out, s2d, weight, rstd)
        if d_sum is not None:
            grad_s = grad_s + d_sum.reshape(s2d.shape).float()
        grad = grad_s.to(s2d.dtype).view(d_out.shape)
        need = ctx.needs_input_grad
        return grad if need[0] else None, grad if need[1] else None, grad_w, None
