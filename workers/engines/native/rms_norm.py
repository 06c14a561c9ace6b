"""RMSNorm in one kernel for the native generator and trainer alike (``FP8RL_RMS_NORM=triton``).

Hugging Face's ``LlamaRMSNorm`` (and Qwen2's) is about six kernels per call: the float32 copy,
the square, the mean, the ``rsqrt``, the product, the BF16 copy and the weight's product. A
decoder layer has two, and a decode step runs them for every layer. :func:`fuse_norms` gives
each such module a forward that runs :mod:`workers.engines.native.triton_norm` instead: one
read of the row, one write, the same two roundings to BF16. Its sum of squares is Triton's, in
another order than torch's, so a value may land one BF16 step from Hugging Face's. Both engines
build their model with :func:`workers.engines.models.build_policy`, which applies it where the
switch is on, so the trainer computes the norm with the same kernel and gets the same bits as the
generator, row for row. The backward is RMSNorm's gradient in float32 from the saved ``1/rms``:
``dx = rstd (g - y mean(g y))``, ``g = dout w``, ``dw = sum(dout bf16(y))``.

Only BF16 inputs on CUDA (or the CPU under Triton's interpreter, for tests) take it; anything
else keeps Hugging Face's forward.
"""

from __future__ import annotations

from functools import partial
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
    own), give each of the model's :data:`NORM_MODULES` the one-kernel forward; returns how many."""
    from workers.engines.exact import is_exact

    if is_exact(model) or not enabled(device):
        return 0
    taken = 0
    module: Any
    for module in model.modules():
        if type(module).__name__ not in NORM_MODULES or hasattr(module, "fp8rl_hf_forward"):
            continue
        module.fp8rl_hf_forward = module.forward
        module.forward = partial(_forward, module)
        taken += 1
    return taken


def _forward(module: Any, hidden: torch.Tensor) -> torch.Tensor:
    weight = module.weight
    if hidden.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or hidden.shape[-1] == 0:
        return module.fp8rl_hf_forward(hidden)  # type: ignore[no-any-return]
    out: torch.Tensor = _RmsNormFn.apply(hidden, weight, float(module.variance_epsilon))  # type: ignore[no-untyped-call]
    return out


class _RmsNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        from workers.engines.native.triton_norm import rms_norm

        x2d = x.reshape(-1, x.shape[-1])
        if x2d.stride(-1) != 1:
            x2d = x2d.contiguous()
        out, rstd = rms_norm(x2d, weight.contiguous(), eps)
        ctx.save_for_backward(x2d, weight, rstd)
        return out.view(x.shape)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (dout,) = grads
        x2d, weight, rstd = ctx.saved_tensors
        g_out = dout.reshape(x2d.shape).float()
        y = x2d.float() * rstd[:, None]  # [R, D]: x / rms, float32
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            g = g_out * weight.float()
            grad_x = rstd[:, None] * (g - y * (g * y).mean(-1, keepdim=True))
            grad_x = grad_x.to(x2d.dtype).view(dout.shape)
        if ctx.needs_input_grad[1]:
            grad_w = (g_out * y.to(torch.bfloat16).float()).sum(0).to(weight.dtype)
        return grad_x, grad_w, None
