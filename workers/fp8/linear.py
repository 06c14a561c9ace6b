"""``Fp8Linear``: a drop-in ``nn.Linear`` whose three GEMMs run in FP8 with blockwise scales.

For ``y = x @ W.T + b`` with ``x [M, K]`` (tokens x in), ``W [N, K]`` (out x in), and ``G`` the
gradient format:

    forward  y  = q(x; E4M3, 1x128)    @ q(W; E4M3, 128x128).T          fprop
    backward dx = q(dy; G, 1x128)      @ q(W; E4M3, 128x128)            dgrad: the same FP8 weight
             dW = q(dy.T; G, 1x128)    @ q(x.T; E4M3, 1x128).T          wgrad: contraction over M

``G`` is E4M3 by default (``fp8_format: e4m3``): E4M3 on every tensor, the recipe of DeepSeek-V3
(fine-grained scales cover the gradients' range, and E4M3 has half E5M2's rounding error), of
Transformer Engine's ``Float8BlockScaling`` and of NeMo RL's FP8 training (Megatron-Core with
``fp8="e4m3"``, ``fp8_recipe="blockwise"``). ``fp8_format: hybrid`` uses E5M2 gradients, the
older per-tensor FP8 convention (Transformer Engine's ``Format.HYBRID``); cuBLAS has no blockwise
kernel for an E5M2 operand, so on Hopper its dgrad and wgrad run rowwise per 128-long K-chunk.

The weight's 128x128 blocks are square, so one FP8 weight serves fprop (``W.T``) and dgrad (``W``)
without re-quantizing. wgrad contracts over tokens, so its operands are tiled along M: ``x.T`` and
``dy.T`` are quantized in 1x128 tiles of tokens, row-major, as Transformer Engine keeps a
"columnwise" copy. ``x.T`` is made in the forward pass and saved in FP8 (half the bytes of BF16).
All GEMMs accumulate in float32.

Layouts, as CUDA's ``_scaled_mm`` wants them (first operand row-major, second column-major):
fprop ``q(x) @ W_q.T`` (``W_q.T`` of a row-major weight is column-major), dgrad ``q(dy) @ W_q`` with
a column-major copy of the FP8 weight (made once per weight update, trainers only, only where a
CUDA kernel runs), wgrad ``q(dy.T) @ q(x.T).T``. Which kernel runs each GEMM on this device and why:
:meth:`Fp8Linear.gemm_plans` (and the quantization audit).

Master weights stay in their own dtype (float32 or BF16); the optimizer updates them. The FP8
copy of the weight is made the first time it is needed after an update and reused until the next
one: it is keyed on the parameter's in-place version counter, which every optimizer step bumps.
A trainer makes all of them at once right after its optimizer step (:mod:`workers.fp8.weights`,
one launch on CUDA); each layer adopts its copy (:meth:`Fp8Linear.adopt_fp8_weight`).
A generator that receives the trainer's FP8 weights loads them with :meth:`Fp8Linear.load_fp8_weight`
and uses them as they are, bit for bit; after :meth:`Fp8Linear.drop_master_weight` it holds the FP8
weight alone (the high-precision one becomes a shape-only placeholder on the ``meta`` device).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from workers.fp8.dispatch import GemmPlan, OperandSpec, plan_gemm, profile_of
from workers.fp8.formats import get_format
from workers.fp8.fp8_tensor import Fp8Tensor
from workers.fp8.linear_config import Fp8LinearConfig
from workers.fp8.linear_gemm import (
    BoundGemm,
    WgradGemm,
    fprop_gemm,
    input_tiles,
    train_backward,
    train_forward,
)


class _Fp8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x2d: torch.Tensor,  # [M, K]
        weight: torch.Tensor,  # [N, K] master weight (only for autograd bookkeeping)
        bias: torch.Tensor | None,  # [N]
        layer: Fp8Linear,
    ) -> torch.Tensor:
        return train_forward(ctx, x2d, layer, bias, weight.requires_grad, weight.dtype)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (grad_y,) = grads  # [M, N]
        need = ctx.needs_input_grad
        return (*train_backward(ctx, grad_y, need[0], need[1], need[2]), None)


class Fp8Linear(nn.Module):
    """``nn.Linear`` with FP8 GEMMs. Same parameters (``weight [out, in]``, ``bias [out]``).

    Build one directly, or swap an existing layer with :meth:`from_linear` (which shares its
    parameters, so optimizers and state dicts keep working). ``name`` (the module path) is what
    NaN/inf errors and audits call the layer.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        config: Fp8LinearConfig | None = None,
        name: str = "Fp8Linear",
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias: nn.Parameter | None = (
            nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        )
        nn.Linear.reset_parameters(self)  # type: ignore[arg-type]
        self._init_fp8(config, name)

    def _init_fp8(self, config: Fp8LinearConfig | None, name: str) -> None:
        self.config = config or Fp8LinearConfig()
        self.name = name
        self._w_q: Fp8Tensor | None = None
        self._w_q_key: tuple[int, int, int] | None = None
        self.fp8_only = False  # True after drop_master_weight(): the FP8 weight is all there is
        self.fp8_weight_updates = 0  # how many times the FP8 copy was (re)made or loaded
        # (FusedGroup, member index) once workers.fp8.fused has fused this layer with its siblings
        self.fused: Any = None
        # (TrainFusedGroup, member index) once workers.fp8.fused has fused this trainer's layer
        self.fused_train: Any = None
        self.fprop_gemm = BoundGemm()  # the forward GEMM, bound once per FP8 weight
        # dgrad's GEMM, bound once per weight update (its column-major weight copy: trainers, CUDA)
        self.dgrad_gemm = BoundGemm(dgrad=True)
        self.wgrad_gemm = WgradGemm()  # training's weight gradient, planned once per operand layout

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, config: Fp8LinearConfig | None = None, name: str = "Fp8Linear"
    ) -> Fp8Linear:
        """An ``Fp8Linear`` that shares ``linear``'s weight and bias parameters."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        # nn.Linear types its parameters as Tensor; they are Parameters, shared, not copied
        new.weight = linear.weight  # type: ignore[assignment]
        new.bias = linear.bias
        new._init_fp8(config, name)
        return new

    def _weight_key(self) -> tuple[int, int, int]:
        w = self.weight
        return (w._version, w.data_ptr(), id(w))

    def fp8_weight(self) -> Fp8Tensor:
        """The FP8 copy of the weight; re-quantized only after the master weight changed."""
        if self.fp8_only:
            assert self._w_q is not None
            return self._w_q
        if self._w_q is None or self._w_q_key != self._weight_key():
            self.adopt_fp8_weight(
                self.config.quantize_weight(self.weight, f"{self.name}: weight").with_dequant_cache()
            )
        assert self._w_q is not None
        return self._w_q

    def forget_fp8_weight(self) -> None:
        """Drop the FP8 copy and what is bound to it (it is made again when next needed); a layer
        holding its FP8 weight alone keeps it."""
        if not self.fp8_only:
            self._w_q = self._w_q_key = None
            self.fprop_gemm.release()
            self.dgrad_gemm.release()

    def adopt_fp8_weight(self, w_q: Fp8Tensor) -> None:
        """Take ``w_q`` as the FP8 copy of the master weight as it is now (quantized by this
        layer's config, e.g. all of a trainer's weights at once by :mod:`workers.fp8.weights`)."""
        self._w_q, self._w_q_key = w_q, self._weight_key()
        self.fprop_gemm.release()  # bound to the previous copy: let it go
        self.dgrad_gemm.release()
        self.fp8_weight_updates += 1

    @torch.no_grad()
    def load_fp8_weight(self, w_q: Fp8Tensor) -> None:
        """Use ``w_q`` (e.g. the trainer's FP8 weight) as is, without re-quantizing.

        With a master weight, it is set to the dequantized value so that the module stays
        consistent (state dicts, a later switch to BF16), and the FP8 copy is pinned until the
        next update. After :meth:`drop_master_weight`, ``w_q`` simply replaces the FP8 weight.
        """
        if tuple(w_q.shape) != tuple(self.weight.shape):
            raise ValueError(
                f"load_fp8_weight: {self.name}: FP8 weight has shape {tuple(w_q.shape)}, layer "
                f"expects {tuple(self.weight.shape)} (out_features, in_features)"
            )
        w_q = w_q.to(self._device()).with_dequant_cache()
        if not self.fp8_only:
            self.weight.copy_(w_q.dequantize(self.weight.dtype))
            self._w_q_key = self._weight_key()
        if self.fp8_only and self._w_q is not None and _same_layout(self._w_q, w_q):
            _copy_into(self._w_q, w_q)  # the storage a captured CUDA graph reads stays the same
            if self.fused is not None:
                self.fused[0].refresh()  # the rows are the group's: its derived layout too
        else:
            self._w_q = w_q
            self.fprop_gemm.release()  # bound to the previous weight: let it go
        self.dgrad_gemm.release()
        self.fp8_weight_updates += 1

    def _device(self) -> torch.device:
        if self.fp8_only:
            assert self._w_q is not None
            return self._w_q.device
        return self.weight.device

    @torch.no_grad()
    def drop_master_weight(self) -> None:
        """Keep the FP8 weight alone (inference: a generator). The weight parameter stays, with
        its name and shape, on the ``meta`` device (no storage), so weight-sync payloads still
        match by name; :meth:`load_fp8_weight` replaces the FP8 weight from then on."""
        if self.fp8_only:
            return
        w_q = self.fp8_weight()
        self.weight = nn.Parameter(
            torch.empty(self.weight.shape, dtype=self.weight.dtype, device="meta"), requires_grad=False
        )
        self._w_q, self._w_q_key = w_q, None
        self.dgrad_gemm.release()
        self.fp8_only = True

    def fp8_allocated_bytes(self) -> int:
        """Bytes of this layer's FP8 weight copies (data, scales, CPU dequantization cache)."""
        total = self._w_q.allocated_bytes if self._w_q is not None else 0
        if self.fused is not None and self.fused[1] == 0:  # the group's derived copies, once
            total += sum(t.numel() * t.element_size() for t in self.fused[0].weight._memo.values())
        dgrad = self.dgrad_gemm._bound
        if dgrad is not None and dgrad.b is not dgrad.w_q:  # dgrad's column-major copy (scales: _w_q's)
            total += dgrad.b.data.numel() * dgrad.b.data.element_size()
            if dgrad.blockwise is not None:
                total += dgrad.blockwise[0].numel() * 4
        return total

    def gemm_plans(self, tokens: int = 256, out_dtype: torch.dtype = torch.bfloat16) -> dict[str, GemmPlan]:
        """The kernel of each of the layer's GEMMs on its device (or a simulated one), and why."""
        cfg = self.config
        n, k = self.out_features, self.in_features
        fwd, grad = get_format(cfg.forward_fmt), get_format(cfg.grad_fmt)
        w = OperandSpec((n, k), cfg.weight_block, fwd)
        w_t = OperandSpec((k, n), cfg.transposed(cfg.weight_block), fwd)
        profile = profile_of(self._device())
        backend = cfg.backend
        return {
            "fprop": plan_gemm(
                OperandSpec((tokens, k), cfg.activation_block, fwd),
                w_t,
                profile,
                backend,
                out_dtype,
                cfg.bf16_exact,
            ),
            "dgrad": plan_gemm(
                OperandSpec((tokens, n), cfg.grad_block, grad), w, profile, backend, out_dtype, cfg.bf16_exact
            ),
            "wgrad": plan_gemm(
                OperandSpec((n, tokens), cfg.grad_block, grad),
                OperandSpec((tokens, k), cfg.transposed(cfg.activation_block), fwd),
                profile,
                backend,
                bf16_exact=cfg.bf16_exact,
            ),
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Under torch.autocast (a BF16 trainer's mixed precision) the emulated GEMM must still
        # accumulate in float32: autocast would silently turn it into a BF16 matmul.
        if x.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(x.device.type):
            with torch.autocast(x.device.type, enabled=False):
                return self._forward(x)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2d = x.reshape(-1, self.in_features)  # [M, K]
        params_need_grad = self.weight.requires_grad or (self.bias is not None and self.bias.requires_grad)
        if self.fused_train is not None:  # one GEMM for the group, forward and backward (fused.py)
            group, member = self.fused_train
            y2d: torch.Tensor = group.output(x, x2d, member)
        elif not torch.is_grad_enabled() or not (x.requires_grad or params_need_grad):
            # inference (generation): one quantization of x, no autograd state, no wgrad copy
            if self.fused is not None:  # one GEMM for the group (workers.fp8.fused)
                group, member = self.fused
                y2d = group.output(x, x2d, member)
            else:
                w_q, x_q = self.fp8_weight(), input_tiles(x, self.config)  # x_q: tiles x carries
                y2d = fprop_gemm(x2d, self.fprop_gemm, w_q, self.bias, self.config, self.name, x_q)
        else:
            y2d = _Fp8LinearFn.apply(x2d, self.weight, self.bias, self)  # type: ignore[no-untyped-call]
        return y2d.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, weight={c.forward_fmt}{c.weight_block}, "
            f"act={c.forward_fmt}{c.activation_block}, grad={c.grad_fmt}{c.grad_block}"
            + (", fp8 weight only" if self.fp8_only else "")
        )


def _same_layout(held: Fp8Tensor, new: Fp8Tensor) -> bool:
    """Whether ``new`` can be copied into ``held``'s storage (same shapes, strides, blocks, format)."""
    return (
        held.data.shape == new.data.shape
        and held.data.stride() == new.data.stride()
        and held.data.dtype == new.data.dtype
        and held.scale.shape == new.scale.shape
        and held.block == new.block
        and held.fmt == new.fmt
    )


def _copy_into(held: Fp8Tensor, new: Fp8Tensor) -> None:
    """Write ``new``'s bytes and scales into ``held``, and refresh what was derived from them: the
    cuBLAS scale layout is rewritten in place (a graph holds its address too); a CPU float32
    dequantization is dropped (made again on first use)."""
    held.data.copy_(new.data)
    held.scale.copy_(new.scale)
    refresh_derived(held)


def refresh_derived(held: Fp8Tensor) -> None:
    """``held``'s bytes or scales changed in place: rewrite its cuBLAS scale layout in place, drop
    its CPU float32 dequantization."""
    derived = held._memo.get("cublas_scale_t")
    held._memo.clear()
    if derived is not None:
        from workers.fp8.matmul import cublas_b_scale_layout

        derived.copy_(cublas_b_scale_layout(held.t()))
        held._memo["cublas_scale_t"] = derived
