"""``Fp8Linear``: a drop-in ``nn.Linear`` whose three GEMMs run in FP8 (the "hybrid" recipe).

For ``y = x @ W.T + b`` with ``x [M, K]`` (tokens x in), ``W [N, K]`` (out x in):

    forward  y  = q(x; E4M3, 1x128)   @ q(W; E4M3, 128x128).T          fprop
    backward dx = q(dy; E5M2, 1x128)  @ q(W; E4M3, 128x128)            dgrad: the same FP8 weight
             dW = q(dy; E5M2, 128x1).T @ q(x; E4M3, 128x1)             wgrad: contraction over M

The weight's 128x128 blocks are square, so one FP8 copy serves fprop (``W.T``) and dgrad (``W``)
without re-quantizing. wgrad contracts over tokens, so its operands are tiled along M (128x1);
``x`` is quantized that way in the forward pass and saved in FP8 (half the bytes of BF16), as
Transformer Engine keeps a "columnwise" copy. All GEMMs accumulate in float32.

Master weights stay in their own dtype (float32 or BF16); the optimizer updates them. The FP8
copy of the weight is made the first time it is needed after an update and reused until the next
one: it is keyed on the parameter's in-place version counter, which every optimizer step bumps.
A generator that receives the trainer's FP8 weights loads them with :meth:`Fp8Linear.load_fp8_weight`
and uses them as they are, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from workers.fp8.matmul import Backend, fp8_matmul
from workers.fp8.quant import Block, BLOCK_128x128, Fp8Tensor, TILE_1x128, quantize


@dataclass(frozen=True)
class Fp8LinearConfig:
    """How an :class:`Fp8Linear` quantizes. Defaults: DeepSeek-V3 blockwise hybrid recipe."""

    weight_block: Block = BLOCK_128x128
    activation_block: Block = TILE_1x128
    grad_block: Block = TILE_1x128
    forward_fmt: str = "e4m3"
    grad_fmt: str = "e5m2"
    power_of_two_scales: bool = False
    backend: Backend = "auto"

    @property
    def wgrad_block(self) -> Block:
        """Tiles for the wgrad operands: the activation tile turned to run along tokens."""
        blk = self.activation_block
        return None if blk is None else (blk[1], blk[0])


def _fprop(
    x2d: torch.Tensor, w_q: Fp8Tensor, bias: torch.Tensor | None, cfg: Fp8LinearConfig
) -> torch.Tensor:
    """``q(x) @ q(W).T + b``, accumulated in float32, returned in ``x2d``'s dtype.

    ``x2d [M, K]``, ``w_q [N, K]`` -> ``[M, N]``.
    """
    x_q = quantize(x2d, cfg.forward_fmt, cfg.activation_block, power_of_two=cfg.power_of_two_scales)
    y = fp8_matmul(x_q, w_q.t(), backend=cfg.backend)  # [M, N] float32
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x2d.dtype)


class _Fp8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x2d: torch.Tensor,  # [M, K]
        weight: torch.Tensor,  # [N, K] master weight (only for autograd bookkeeping)
        bias: torch.Tensor | None,  # [N]
        w_q: Fp8Tensor,  # FP8 copy of weight, [N, K]
        cfg: Fp8LinearConfig,
    ) -> torch.Tensor:
        y = _fprop(x2d, w_q, bias, cfg)
        if weight.requires_grad:
            # wgrad contracts over M: keep x tiled along tokens, in FP8
            p2 = cfg.power_of_two_scales
            ctx.x_wgrad = quantize(x2d, cfg.forward_fmt, cfg.wgrad_block, power_of_two=p2)
        ctx.w_q = w_q
        ctx.cfg = cfg
        ctx.has_bias = bias is not None
        ctx.x_dtype = x2d.dtype
        ctx.w_dtype = weight.dtype
        return y

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (grad_y,) = grads  # [M, N]
        cfg: Fp8LinearConfig = ctx.cfg
        p2 = cfg.power_of_two_scales
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            g_q = quantize(grad_y, cfg.grad_fmt, cfg.grad_block, power_of_two=p2)  # [M, N]
            grad_x = fp8_matmul(g_q, ctx.w_q, backend=cfg.backend).to(ctx.x_dtype)  # [M, K]
        if ctx.needs_input_grad[1]:
            g_col = quantize(grad_y, cfg.grad_fmt, cfg.wgrad_block, power_of_two=p2)  # [M, N]
            grad_w = fp8_matmul(g_col.t(), ctx.x_wgrad, backend=cfg.backend)  # [N, K]
            grad_w = grad_w.to(ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_y.to(torch.float32).sum(dim=0)  # [N]
        return grad_x, grad_w, grad_b, None, None


class Fp8Linear(nn.Module):
    """``nn.Linear`` with FP8 GEMMs. Same parameters (``weight [out, in]``, ``bias [out]``).

    Build one directly, or swap an existing layer with :meth:`from_linear` (which shares its
    parameters, so optimizers and state dicts keep working).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        config: Fp8LinearConfig | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.config = config or Fp8LinearConfig()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias: nn.Parameter | None = (
            nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        )
        nn.Linear.reset_parameters(self)  # type: ignore[arg-type]
        self._w_q: Fp8Tensor | None = None
        self._w_q_key: tuple[int, int, int] | None = None
        self.fp8_weight_updates = 0  # how many times the FP8 copy was (re)made or loaded

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: Fp8LinearConfig | None = None) -> Fp8Linear:
        """An ``Fp8Linear`` that shares ``linear``'s weight and bias parameters."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.config = config or Fp8LinearConfig()
        # nn.Linear types its parameters as Tensor; they are Parameters, shared, not copied
        new.weight = linear.weight  # type: ignore[assignment]
        new.bias = linear.bias
        new._w_q, new._w_q_key = None, None
        new.fp8_weight_updates = 0
        return new

    def _weight_key(self) -> tuple[int, int, int]:
        w = self.weight
        return (w._version, w.data_ptr(), id(w))

    def fp8_weight(self) -> Fp8Tensor:
        """The FP8 copy of the weight; re-quantized only after the master weight changed."""
        key = self._weight_key()
        if self._w_q is None or self._w_q_key != key:
            cfg = self.config
            self._w_q = quantize(
                self.weight.detach(),
                cfg.forward_fmt,
                cfg.weight_block,
                power_of_two=cfg.power_of_two_scales,
            ).with_dequant_cache()
            self._w_q_key = key
            self.fp8_weight_updates += 1
        return self._w_q

    @torch.no_grad()
    def load_fp8_weight(self, w_q: Fp8Tensor) -> None:
        """Use ``w_q`` (e.g. the trainer's FP8 weight) as is, without re-quantizing.

        The master weight is set to its dequantized value so that the module stays consistent
        (state dicts, a later switch to BF16), and the FP8 copy is pinned until the next update.
        """
        if tuple(w_q.shape) != tuple(self.weight.shape):
            raise ValueError(
                f"load_fp8_weight: FP8 weight has shape {tuple(w_q.shape)}, layer expects "
                f"{tuple(self.weight.shape)} (out_features, in_features)"
            )
        w_q = w_q.to(self.weight.device).with_dequant_cache()
        self.weight.copy_(w_q.dequantize(self.weight.dtype))
        self._w_q, self._w_q_key = w_q, self._weight_key()
        self.fp8_weight_updates += 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Under torch.autocast (a BF16 trainer's mixed precision) the emulated GEMM must still
        # accumulate in float32: autocast would silently turn it into a BF16 matmul.
        with torch.autocast(x.device.type, enabled=False):
            return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2d = x.reshape(-1, self.in_features)  # [M, K]
        params_need_grad = self.weight.requires_grad or (self.bias is not None and self.bias.requires_grad)
        if not torch.is_grad_enabled() or not (x.requires_grad or params_need_grad):
            # inference (generation): one quantization of x, no autograd state, no wgrad copy
            y2d = _fprop(x2d, self.fp8_weight(), self.bias, self.config)
        else:
            y2d = _Fp8LinearFn.apply(  # type: ignore[no-untyped-call]
                x2d, self.weight, self.bias, self.fp8_weight(), self.config
            )
        return y2d.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, weight={c.forward_fmt}{c.weight_block}, "
            f"act={c.forward_fmt}{c.activation_block}, grad={c.grad_fmt}{c.grad_block}"
        )
