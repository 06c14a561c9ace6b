"""Fused projections for an FP8 generator: q/k/v, and gate/up, as one FP8 GEMM each.

Hugging Face's attention calls ``q_proj(x)``, ``k_proj(x)`` and ``v_proj(x)`` on the same hidden
states, its MLP ``gate_proj(x)`` and ``up_proj(x)``: in FP8 that is one quantization of ``x`` and
one GEMM per projection. :func:`fuse_projections` gives each group one FP8 weight, the members'
weights stacked along the output dimension, and makes each member's FP8 weight a view of its rows
(data and 128x128-block scales): the first member called quantizes ``x`` once and runs one GEMM
for the group; the others, called with the same ``x``, return their columns of it (views, no
copy). Nothing else changes:

- the bytes: a member's rows are a whole number of 128-row blocks (a group is fused only then),
  so every 128x128 block and its scale are the member's own, bit for bit;
- names and payloads: the members stay ``q_proj``, ``k_proj``, ... with their own weights, so
  weight sync, export and vLLM's checkpoint format are unchanged; a weight loaded into a member
  is copied into the group's rows (in place: a captured CUDA graph reads the group's storage) and
  the group's cuBLAS scale layout is rewritten in place;
- biases (Qwen2's q/k/v): the group's bias is one buffer, each member's bias a view of it.

Inference only (a generator after ``drop_master_weights``): a member that is asked for gradients
runs alone, as before.

:func:`fuse_silu_mul` then takes the activation between the gate/up GEMM and the down projection
into one Triton pass (``FP8RL_SILU_MUL=triton``, :mod:`workers.fp8.triton_act`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from workers.fp8.dispatch import triton_switch
from workers.fp8.formats import get_format
from workers.fp8.fp8_tensor import Fp8Tensor, TILE_1x128
from workers.fp8.linear import Fp8Linear
from workers.fp8.linear_gemm import (
    BoundGemm,
    WgradGemm,
    fprop_gemm,
    input_tiles,
    train_backward,
    train_forward,
)

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


@dataclass
class FusedGroup:
    """One FP8 weight for several projections of the same input (see the module docstring)."""

    names: tuple[str, ...]
    bounds: tuple[int, ...]  # member i owns output rows bounds[i]:bounds[i + 1]
    weight: Fp8Tensor  # [sum of N, K]
    bias: torch.Tensor | None
    first: Fp8Linear  # the config and name the group's GEMM uses
    gemm: BoundGemm = field(default_factory=BoundGemm)  # the group's GEMM, bound once
    _x: torch.Tensor | None = None
    _y: torch.Tensor | None = None
    _served: set[int] | None = None  # members that took their columns of _y

    def output(self, x: torch.Tensor, x2d: torch.Tensor, member: int) -> torch.Tensor:
        """Member ``member``'s ``x2d @ W.T + b`` (``x2d``: the layer's input ``x`` as rows): one GEMM
        for the group per input, recognised as the same tensor object ``x``."""
        if self._x is not x or self._y is None or self._served is None or member in self._served:
            # a new input (or a member asking twice: x may have changed in place): compute
            self._x, self._served = x, set()
            name = "+".join(self.names)
            x_q = input_tiles(x, self.first.config)  # the tiles x carries, if its maker wrote them
            self._y = fprop_gemm(x2d, self.gemm, self.weight, self.bias, self.first.config, name, x_q)
        y = self._y
        self._served.add(member)
        if len(self._served) == len(self.names):  # every member has its columns: let go of x
            self._x = self._y = self._served = None
        return y[:, self.bounds[member] : self.bounds[member + 1]]

    def refresh(self) -> None:
        """After a member's rows were rewritten: the group's derived cuBLAS layout, in place."""
        from workers.fp8.linear import refresh_derived

        refresh_derived(self.weight)


def _candidates(model: nn.Module) -> Iterator[tuple[tuple[str, ...], list[Fp8Linear]]]:
    """Every q/k/v and gate/up group of FP8 layers under one parent, by name."""
    for parent in model.modules():
        for names in GROUPS:
            members = [getattr(parent, n, None) for n in names]
            if all(isinstance(m, Fp8Linear) for m in members):
                yield names, members  # type: ignore[misc]


def fuse_projections(model: nn.Module) -> int:
    """Fuse every q/k/v and gate/up group of FP8-only layers whose outputs are whole 128-row
    blocks; returns how many groups were fused."""
    fused = 0
    for names, layers in _candidates(model):
        if _fusable(layers):
            _fuse(names, layers)
            fused += 1
    return fused


def _fusable(layers: list[Fp8Linear]) -> bool:
    w = [m.fp8_weight() if m.fp8_only else None for m in layers]
    if any(x is None for x in w) or getattr(layers[0], "fused", None) is not None:
        return False
    first = w[0]
    assert first is not None
    same = all(
        x is not None
        and x.block == first.block == (128, 128)
        and x.fmt == first.fmt
        and x.shape[1] == first.shape[1]
        and x.shape[0] % 128 == 0
        and x.data.is_contiguous()
        for x in w
    )
    biases = {m.bias is None for m in layers}
    configs = {m.config for m in layers}
    return same and len(biases) == 1 and len(configs) == 1


@torch.no_grad()
def _stacked(weights: list[Fp8Tensor]) -> tuple[Fp8Tensor, list[Fp8Tensor], tuple[int, ...]]:
    """Members' FP8 weights (whole 128-row blocks) as one ``[sum N, K]`` weight, each member's a
    view of its rows (data and scales), and the row bounds: member i owns rows bounds[i]:bounds[i + 1]."""
    data = torch.cat([w.data for w in weights])  # [sum N, K]
    scale = torch.cat([w.scale for w in weights])  # [sum N / 128, K / 128]
    block, fmt = weights[0].block, weights[0].fmt
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + w.shape[0])
    rows = [
        Fp8Tensor(data[a:b], scale[a // 128 : b // 128], block, fmt, True)
        for a, b in itertools.pairwise(bounds)
    ]
    return Fp8Tensor(data, scale, block, fmt, True), rows, tuple(bounds)


def _fuse(names: tuple[str, ...], layers: list[Fp8Linear]) -> None:
    group_weight, rows, bounds = _stacked([m.fp8_weight() for m in layers])
    bias = None
    if layers[0].bias is not None:
        bias = torch.cat([m.bias.detach() for m in layers if m.bias is not None])
    group = FusedGroup(names, bounds, group_weight, bias, layers[0])
    for i, m in enumerate(layers):
        a, b = bounds[i], bounds[i + 1]
        m._w_q = rows[i]
        if bias is not None:
            m.bias = nn.Parameter(bias[a:b], requires_grad=False)  # a view: loads write the group's bias
        m.fused = (group, i)


def take_forward(module: nn.Module, forward: Any) -> bool:
    """Give ``module`` the forward ``forward(module, ...)`` in place of its own, which stays callable
    as ``module.fp8rl_hf_forward`` (the fused forwards fall back to it where they do not apply).
    A module is taken once: False, and nothing changed, where one of the fused forwards has it."""
    if hasattr(module, "fp8rl_hf_forward"):
        return False
    own: Any = module
    own.fp8rl_hf_forward = module.forward
    own.forward = partial(forward, module)
    return True


# -- generators: SiLU, the product and the down projection's quantizer in one pass --------------

# the MLPs whose forward is down_proj(act_fn(gate_proj(x)) * up_proj(x)) with a SiLU act_fn
SILU_MLPS = ("LlamaMLP", "Qwen2MLP")


def silu_mul_enabled(device: torch.device) -> bool:
    """``FP8RL_SILU_MUL``: ``torch`` (default until a GPU has measured it) or ``triton`` (an FP8
    generator's MLP activation in one pass, :func:`fuse_silu_mul`; CUDA, or the CPU under Triton's
    interpreter). Asked for where it cannot run, it logs why once and torch's path runs."""
    return triton_switch("FP8RL_SILU_MUL", "torch", "triton", device, "torch's SiLU, product and quantizer")


def fuse_silu_mul(model: nn.Module) -> int:
    """Give every SiLU MLP whose gate/up are one fused FP8 GEMM (:func:`fuse_projections`) and
    whose down projection is FP8-only, with 1x128 input tiles, a forward that runs the gate/up
    GEMM, then :func:`workers.fp8.triton_act.silu_mul_rows` (SiLU, the product and the 1x128
    quantization in one pass), then the down GEMM on those bytes. The values are torch's, bit for
    bit (that module's docstring), so the down GEMM reads the bytes the unfused path quantizes;
    with ``FP8RL_SMALL_M_GEMM=triton`` the unfused path's down GEMM of at most 64 tokens would
    quantize inside the small-M kernel instead, and this one takes the bound GEMM. Returns how
    many MLPs it took."""
    taken = 0
    mlp: Any
    for mlp in model.modules():
        if type(mlp).__name__ not in SILU_MLPS:
            continue
        gate, up, down = (getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj"))
        if not (isinstance(gate, Fp8Linear) and isinstance(up, Fp8Linear) and isinstance(down, Fp8Linear)):
            continue
        group = gate.fused[0] if gate.fused is not None else None
        if group is None or up.fused != (group, 1) or gate.fused != (group, 0) or down.fused is not None:
            continue
        cfg = down.config
        if not down.fp8_only or cfg.activation_block != TILE_1x128 or cfg.rows_multiple != 1:
            continue
        if type(getattr(mlp, "act_fn", None)).__name__ not in ("SiLUActivation", "SiLU"):
            continue
        taken += take_forward(mlp, _silu_mul_forward)
    return taken


def _silu_mul_forward(mlp: Any, x: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and x.requires_grad:
        return mlp.fp8rl_hf_forward(x)  # type: ignore[no-any-return]
    from workers.fp8.triton_act import silu_mul_rows

    group: FusedGroup = mlp.gate_proj.fused[0]
    down: Fp8Linear = mlp.down_proj
    cfg = down.config
    x2d = x.reshape(-1, x.shape[-1])
    gu_q = input_tiles(x, group.first.config)  # the tiles x carries, if its maker wrote them
    gu = fprop_gemm(
        x2d, group.gemm, group.weight, group.bias, group.first.config, "+".join(group.names), gu_q
    )
    x_q = silu_mul_rows(gu, get_format(cfg.forward_fmt), cfg.power_of_two_scales, f"{down.name}: input")
    h = gu[:, : down.in_features]  # stands for h in fprop_gemm: its rows, dtype and device
    y = fprop_gemm(h, down.fprop_gemm, down.fp8_weight(), down.bias, cfg, down.name, x_q)
    return y.reshape(*x.shape[:-1], down.out_features)


# -- trainers: q/k/v and gate/up as one FP8 GEMM each, forward and backward ---------------------


class _FusedTrainFn(torch.autograd.Function):
    """The group's GEMM under autograd: one quantization of x (both layouts), one fprop, and in
    backward one quantization of dy, one dgrad and one wgrad, whose rows are the members' weight
    gradients."""

    @staticmethod
    def forward(
        ctx: Any, x2d: torch.Tensor, bias: torch.Tensor | None, group: TrainFusedGroup, *weights: torch.Tensor
    ) -> torch.Tensor:
        wgrad = any(w.requires_grad for w in weights)
        return train_forward(ctx, x2d, group, bias, wgrad, weights[0].dtype)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (grad_y,) = grads  # [M, sum of N]
        need = ctx.needs_input_grad
        grad_x, grad_w, grad_b = train_backward(ctx, grad_y, need[0], any(need[3:]), need[1])
        group: TrainFusedGroup = ctx.owner
        parts: tuple[torch.Tensor | None, ...] = (
            torch.split(grad_w, list(group.sizes)) if grad_w is not None else (None,) * len(group.sizes)
        )
        return (grad_x, grad_b, None, *parts)


class TrainFusedGroup:
    """Several trainable :class:`Fp8Linear` of the same input (q/k/v, gate/up) run as one FP8 GEMM
    in forward and in backward. The members keep their master weights (parameters, optimizer
    state, state dicts and gradients are the members'); the group's FP8 weight is the members'
    FP8 weights stacked, each quantized on its own in 128x128 blocks (so the bytes are the
    members', and their rows are whole blocks), and each member's FP8 copy is a view of its rows:
    weight sync and export read the members' copies as before."""

    def __init__(self, names: tuple[str, ...], layers: list[Fp8Linear]) -> None:
        self.names, self.layers = names, layers
        self.sizes = tuple(m.out_features for m in layers)
        self.config = layers[0].config
        self.name = "+".join(m.name for m in layers)
        self.fprop_gemm, self.dgrad_gemm = BoundGemm(), BoundGemm(dgrad=True)
        self.wgrad_gemm = WgradGemm()
        self._w_q: Fp8Tensor | None = None
        self._keys: tuple[Any, ...] | None = None
        self._x: torch.Tensor | None = None
        self._parts: tuple[torch.Tensor, ...] | None = None
        self._served: set[int] = set()

    @torch.no_grad()
    def fp8_weight(self) -> Fp8Tensor:
        """The members' FP8 weights stacked, made again when any member's master weight changed."""
        if self._w_q is None or self._keys != tuple(m._weight_key() for m in self.layers):
            parts = [self.config.quantize_weight(m.weight, f"{m.name}: weight") for m in self.layers]
            stacked, rows, _ = _stacked(parts)
            for m, own in zip(self.layers, rows, strict=True):  # a view of its rows, current for its key
                m.adopt_fp8_weight(own)
            self.adopt(stacked)
        assert self._w_q is not None
        return self._w_q

    def forget(self) -> None:
        """Drop the stacked FP8 weight and its bound GEMMs (stacked again when next needed)."""
        self._w_q = self._keys = None
        self.fprop_gemm.release()
        self.dgrad_gemm.release()

    def adopt(self, stacked: Fp8Tensor) -> None:
        """Take ``stacked`` as the group's FP8 weight: the members' current FP8 weights (each a view
        of its rows, already adopted by the member), stacked."""
        self._w_q, self._keys = stacked, tuple(m._weight_key() for m in self.layers)
        self.fprop_gemm.release()
        self.dgrad_gemm.release()

    def output(self, x: torch.Tensor, x2d: torch.Tensor, member: int) -> torch.Tensor:
        """Member ``member``'s ``x2d @ W.T + b``: one GEMM for the group per input (the same tensor
        object ``x``); its output split once, so autograd joins the members' gradients with one
        concatenation."""
        if self._x is not x or self._parts is None or member in self._served:
            self._x, self._served = x, set()
            biases = [m.bias for m in self.layers]
            bias = torch.cat(biases) if biases[0] is not None else None  # type: ignore[arg-type]
            weights = [m.weight for m in self.layers]
            grad = torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights))
            if grad:
                y = _FusedTrainFn.apply(x2d, bias, self, *weights)  # type: ignore[no-untyped-call]
            else:
                y = fprop_gemm(x2d, self.fprop_gemm, self.fp8_weight(), bias, self.config, self.name)
            self._parts = torch.split(y, list(self.sizes), dim=1)
        part = self._parts[member]
        self._served.add(member)
        if len(self._served) == len(self.layers):  # every member has its columns: let go of x
            self._x, self._parts, self._served = None, None, set()
        return part


def fuse_for_training(model: nn.Module) -> int:
    """Fuse every q/k/v and gate/up group of trainable FP8 layers (same input size, config, dtype,
    bias or none; every member's output a whole number of 128-row blocks); returns how many."""
    fused = 0
    for names, layers in _candidates(model):
        first = layers[0]
        if all(
            not m.fp8_only
            and m.fused is None
            and m.fused_train is None
            and m.out_features % 128 == 0
            and m.in_features == first.in_features
            and m.config == first.config
            and m.weight.dtype == first.weight.dtype
            and m.weight.device == first.weight.device
            and (m.bias is None) == (first.bias is None)
            for m in layers
        ) and first.config.weight_block == (128, 128):
            group = TrainFusedGroup(names, layers)
            for i, m in enumerate(layers):
                m.fused_train = (group, i)
            fused += 1
    return fused
