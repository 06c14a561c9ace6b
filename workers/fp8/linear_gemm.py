"""The GEMMs of an :class:`~workers.fp8.linear.Fp8Linear` (and of a fused group of them), bound to
their FP8 weight, and the training forward and backward that run them.

- :class:`BoundGemm` holds a :class:`_Bound` GEMM: the forward one (``q(x) @ W_q.T``) or dgrad's
  (``q(dy) @ W_q``, the weight as a column-major copy), decided once per weight: the plan, the
  weight's operand view and for cuBLAS blockwise its scale layout and the direct
  ``F.scaled_mm`` call, so a call does no planning (the hot path of eager decode and training).
- :func:`fprop_gemm`: quantize the input (or take it quantized) and run the bound forward GEMM; for
  at most :data:`SMALL_M_MAX` tokens the Triton GEMM of :mod:`workers.fp8.triton_gemm` where
  ``FP8RL_SMALL_M_GEMM=triton`` asks for it.
- :func:`attach_input_tiles` / :func:`input_tiles`: an input whose maker wrote its 1x128 tiles in
  the same pass (the generator's RMSNorm kernel) carries them, and the projections that read it
  take them instead of quantizing it again.
- :func:`train_forward` / :func:`train_backward`: what autograd runs; x and dy quantized once
  for both layouts (:func:`workers.fp8.quant.quantize_dual`), wgrad from the FP8 ``x.T`` (with
  ``FP8RL_WGRAD_GEMM=triton`` on CUDA, the Triton GEMM of :mod:`workers.fp8.triton_wgrad`;
  else :class:`WgradGemm`, planned once per operand layout).

The numerics, layouts and kernels are described in :mod:`workers.fp8.linear`.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.nn.functional as F

from workers.fp8.dispatch import DeviceProfile, OperandSpec, plan_gemm, profile_of, triton_switch
from workers.fp8.formats import get_format
from workers.fp8.fp8_tensor import Block, BLOCK_128x128, Fp8Tensor, TILE_1x128
from workers.fp8.linear_config import Fp8LinearConfig
from workers.fp8.matmul import (
    blockwise_scales_for_cublas,
    cublas_b_scale,
    fp8_matmul,
    is_col_major,
    lay_out,
    plan_for,
)
from workers.fp8.quant import quantize, quantize_dual, quantize_rows

# the attribute of a tensor that carries its own 1x128 tiles (attach_input_tiles)
TILES_ATTR = "fp8rl_input_tiles"


def fprop_gemm(
    x2d: torch.Tensor,
    gemm: BoundGemm,
    w_q: Fp8Tensor,
    bias: torch.Tensor | None,
    cfg: Fp8LinearConfig,
    name: str,
    x_q: Fp8Tensor | None = None,
) -> torch.Tensor:
    """``q(x) @ q(W).T + b``, accumulated in float32, returned in ``x2d``'s dtype.

    ``x2d [M, K]``, ``w_q [N, K]`` (through ``gemm``, its bound GEMM) -> ``[M, N]``; ``x_q``:
    ``x2d`` already quantized (training's dual-layout pass), else quantized here.
    """
    m = x2d.shape[0]
    if cfg.rows_multiple > 1 and m % cfg.rows_multiple:  # zero rows: their own tiles, dropped below
        x2d = torch.nn.functional.pad(x2d, (0, 0, 0, -m % cfg.rows_multiple))
    # the kernel may write the activation dtype directly (cuBLAS blockwise writes BF16)
    out = x2d.dtype if bias is None else torch.float32
    bound = gemm.bound(w_q, cfg, x2d.device, out)
    if x_q is None and bound.small_m and x2d.shape[0] <= SMALL_M_MAX:
        y = bound.small_m_gemm(x2d, f"{name}: input")  # quantizes x itself
    else:
        if x_q is None:
            x_q = _quantize_rows(x2d, cfg.forward_fmt, cfg.activation_block, cfg, f"{name}: input")
        y = bound(x_q)[:m]  # [M, N]
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x2d.dtype)


class _InputTiles:
    """Tiles attached to a tensor: the FP8 operand, its scale rule, and the tensor's version
    counter when they were made (an in-place write after that voids them)."""

    __slots__ = ("power_of_two", "q", "version")

    def __init__(self, q: Fp8Tensor, power_of_two: bool, version: int) -> None:
        self.q, self.power_of_two, self.version = q, power_of_two, version


def input_rows(tokens: int, cfg: Fp8LinearConfig, device: torch.device) -> int:
    """The rows :func:`fprop_gemm`'s quantized input has for ``tokens`` rows of ``x``: padded to
    ``cfg.rows_multiple``, and on CUDA to 16 in the quantizing pass (:func:`_quantize_rows`)."""
    rows = -(-tokens // cfg.rows_multiple) * cfg.rows_multiple
    return -(-rows // 16) * 16 if device.type == "cuda" else rows


def attach_input_tiles(x: torch.Tensor, q: Fp8Tensor, power_of_two: bool) -> None:
    """Let ``x`` carry ``q``: its 1x128 tiles, bytes and scales exactly what :func:`fprop_gemm`'s
    quantizer makes of it with ``power_of_two`` scales, rows padded as :func:`input_rows` says.
    Only the maker that computed both in one pass attaches them."""
    setattr(x, TILES_ATTR, _InputTiles(q, power_of_two, x._version))


def input_tiles(x: torch.Tensor, cfg: Fp8LinearConfig) -> Fp8Tensor | None:
    """The tiles ``x`` carries (:func:`attach_input_tiles`) where they are what a GEMM of ``cfg``
    would quantize: 1x128 activation tiles, the same format and scale rule, every row there, and
    ``x`` unchanged since; else None (the caller quantizes)."""
    tiles: _InputTiles | None = getattr(x, TILES_ATTR, None)
    if tiles is None or tiles.version != x._version or cfg.activation_block != TILE_1x128:
        return None
    q = tiles.q
    if q.fmt.name != cfg.forward_fmt or tiles.power_of_two != cfg.power_of_two_scales:
        return None
    tokens = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if q.data.shape[1] != x.shape[-1] or q.data.shape[0] < input_rows(tokens, cfg, x.device):
        return None
    return q


class _Bound:
    """One GEMM ``a @ b`` of an FP8 weight on one device, decided once: ``b`` the weight as the
    GEMM's second operand (fprop: ``W.T``, a view; dgrad: ``W`` as a column-major copy where a CUDA
    kernel runs), the plan, and for cuBLAS blockwise the weight's scale layout and the direct call.
    Per call, :meth:`__call__` then does no planning, no layout checks and makes no objects beyond
    its result (the FP8 linear's hot path: a decode step calls fprop ~100 times, a training step
    each layer's fprop and dgrad once per micro-batch)."""

    __slots__ = (
        "b", "backend", "bf16_exact", "blockwise", "out_dtype", "plan", "profile", "small_m", "w_q",
        "wgrad_triton",
    )  # fmt: skip

    def __init__(
        self,
        w_q: Fp8Tensor,
        cfg: Fp8LinearConfig,
        profile: DeviceProfile,
        out_dtype: torch.dtype,
        dgrad: bool = False,
    ):
        self.w_q, self.profile, self.out_dtype, self.backend = w_q, profile, out_dtype, cfg.backend
        a_block, a_fmt = (cfg.grad_block, cfg.grad_fmt) if dgrad else (cfg.activation_block, cfg.forward_fmt)
        b = w_q if dgrad else w_q.t()  # [K, N] of the GEMM: dgrad contracts over W's rows
        a = OperandSpec((16, int(b.shape[0])), a_block, get_format(a_fmt))
        self.bf16_exact = cfg.bf16_exact
        self.plan = plan_gemm(a, b, profile, cfg.backend, out_dtype, cfg.bf16_exact)
        if dgrad and self.plan.kernel not in ("emulate", "emulate_bf16"):  # column-major, once per weight
            b = Fp8Tensor(w_q.data.t().contiguous().t(), w_q.scale, w_q.block, w_q.fmt)
        self.b = b
        # cuBLAS blockwise, called directly: (the weight's scale layout, a's recipe, b's recipe); for
        # fprop the layout lives with the weight, so an in-place load rewrites it (dgrad's copy is
        # made again after any weight update)
        self.blockwise: tuple[torch.Tensor, Any, Any] | None = None
        if (
            self.plan.kernel == "cublas_blockwise"
            and a_block == TILE_1x128
            and b.block == BLOCK_128x128
            and b.shape[0] % 128 == 0
            and is_col_major(b.data)
            and (dgrad or b._transpose_of is not None)
        ):
            scaling = F.ScalingType  # the plan checked that this torch has F.scaled_mm
            self.blockwise = (cublas_b_scale(b), scaling.BlockWise1x128, scaling.BlockWise128x128)
        # fprop: the Triton GEMM for few tokens (workers.fp8.triton_gemm), where asked for and it applies
        self.small_m = (
            not dgrad
            and small_m_gemm_enabled(w_q.device)
            and w_q.block == BLOCK_128x128
            and w_q.fmt.name == "e4m3"
            and w_q.shape[0] % 128 == 0
            and cfg.activation_block == TILE_1x128
            and cfg.forward_fmt == "e4m3"
            and not cfg.power_of_two_scales
            and cfg.rows_multiple == 1
        )
        # training's weight gradient (forward binding only): the Triton 1x128 x 1x128 GEMM
        # (workers.fp8.triton_wgrad), where asked for and both operands will be E4M3 1x128 tiles
        self.wgrad_triton = (
            not dgrad
            and cfg.forward_fmt == "e4m3"
            and cfg.grad_fmt == "e4m3"
            and cfg.activation_block == TILE_1x128
            and cfg.grad_block == TILE_1x128
            and wgrad_gemm_enabled(w_q.device)
        )

    def small_m_gemm(self, x2d: torch.Tensor, where: str) -> torch.Tensor:
        """``q(x2d) @ w_q.T`` for at most ``SMALL_M_MAX`` tokens, the activation quantized inside
        the kernel (checked by the active finite guard as the quantizer checks it)."""
        from workers.fp8.guard import active_guard
        from workers.fp8.triton_gemm import small_m_gemm

        guard = active_guard()
        slot = guard.reserve(x2d.device, tuple(x2d.shape), TILE_1x128, where) if guard is not None else None
        return small_m_gemm(x2d, self.w_q.data, self.w_q.scale, self.out_dtype, slot)

    def matches(self, w_q: Fp8Tensor, profile: DeviceProfile, out_dtype: torch.dtype, backend: str) -> bool:
        return (
            self.w_q is w_q
            and self.profile is profile
            and self.out_dtype is out_dtype
            and self.backend == backend
        )

    def __call__(self, a_q: Fp8Tensor) -> torch.Tensor:
        """``a_q [M', K] @ b`` -> ``[M', N]`` (``out_dtype``, or the kernel's own dtype)."""
        blockwise = self.blockwise
        if blockwise is not None and a_q.data.shape[0] % 16 == 0 and a_q.data.stride(1) == 1:
            sa = a_q.scale if a_q.scale.stride(0) == 1 else a_q.scale.t().contiguous().t()
            sb, recipe_a, recipe_b = blockwise
            return F.scaled_mm(
                a_q.data, self.b.data, sa, recipe_a, sb, recipe_b, output_dtype=self.plan.out_dtype
            )
        return fp8_matmul(
            a_q, self.b, backend=self.backend, out_dtype=self.out_dtype, bf16_exact=self.bf16_exact
        )


SMALL_M_MAX = 64  # workers.fp8.triton_gemm.MAX_M (that module imports Triton: not imported here)


def small_m_gemm_enabled(device: torch.device) -> bool:
    """``FP8RL_SMALL_M_GEMM=triton``: the forward GEMM of at most 64 tokens runs the Triton block-FP8
    GEMM (:mod:`workers.fp8.triton_gemm`) on CUDA (or under Triton's interpreter on the CPU, for
    tests); ``cublas`` (the default until a GPU has measured it) leaves it to the dispatch. Read
    when a weight's GEMM is bound."""
    instead = "the dispatch's GEMM (workers.fp8.dispatch.plan_gemm)"
    return triton_switch("FP8RL_SMALL_M_GEMM", "cublas", "triton", device, instead)


def wgrad_gemm_enabled(device: torch.device) -> bool:
    """``FP8RL_WGRAD_GEMM=triton``: training's weight gradient runs the Triton 1x128 x 1x128 GEMM
    (:mod:`workers.fp8.triton_wgrad`) on CUDA (or under Triton's interpreter on the CPU, for
    tests); ``cublas`` (the default until a GPU has measured it) leaves it to the dispatch. Read
    when a weight's forward GEMM is bound."""
    return triton_switch("FP8RL_WGRAD_GEMM", "cublas", "triton", device, "the dispatch's GEMM (fp8_matmul)")


class BoundGemm:
    """Holds the :class:`_Bound` forward GEMM (or, with ``dgrad``, the dgrad GEMM) of a layer's or
    a fused group's current FP8 weight; bound again when the weight object, the device profile,
    the output dtype or the backend change. The owner releases it whenever it replaces its FP8
    weight, and the dgrad one at every weight update (its column-major copy would be stale); an
    in-place weight load keeps the forward one, since the load rewrites the scale layout it holds."""

    __slots__ = ("_bound", "dgrad")

    def __init__(self, dgrad: bool = False) -> None:
        self._bound: _Bound | None = None
        self.dgrad = dgrad

    def bound(
        self, w_q: Fp8Tensor, cfg: Fp8LinearConfig, device: torch.device, out_dtype: torch.dtype
    ) -> _Bound:
        b, profile = self._bound, profile_of(device)
        if b is None or not b.matches(w_q, profile, out_dtype, cfg.backend):
            b = self._bound = _Bound(w_q, cfg, profile, out_dtype, self.dgrad)
        return b

    def release(self) -> None:
        self._bound = None

    def wgrad_triton(self) -> bool:
        """Whether the weight gradient of the GEMM bound last runs the Triton kernel."""
        return self._bound is not None and self._bound.wgrad_triton


class WgradGemm:
    """Training's weight-gradient GEMM ``q(dy.T) @ q(x.T).T`` of one layer or fused group, planned
    once per operand layout. Its operands are new activations every call, so nothing is bound to
    a weight; what :func:`fp8_matmul` decides per call (validation, the plan, the padded layout)
    depends only on their shapes, strides, blocks and formats, the output dtype, the device
    profile and the config, and is decided again only when one of those changes. Where the plan
    is cuBLAS blockwise on operands already laid out as it reads them (tokens padded to 128 by
    the dual quantizer), a call is the kernel itself (``F.scaled_mm``); otherwise
    :func:`fp8_matmul` as before. ~512 calls per 1B step (``bench host`` times both ways)."""

    __slots__ = ("_direct", "_key")

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        # the direct call's output dtype (the kernel's own), or None: through fp8_matmul
        self._direct: torch.dtype | None = None

    def __call__(
        self, g_t: Fp8Tensor, x_t: Fp8Tensor, cfg: Fp8LinearConfig, out_dtype: torch.dtype
    ) -> torch.Tensor:
        """``g_t [N, M] @ x_t.T`` -> ``[N, K]`` in ``out_dtype`` (float32 accumulation)."""
        if g_t.device.type == "cpu":
            # the direct call is cuBLAS's (meta tensors stand for CUDA ones in tests); and the key
            # below reads the bytes, which a CPU operand of the compiled quantizer makes only when
            # read (a division per element) and which the CPU's BF16 GEMMs never read
            return _wgrad_matmul(g_t, x_t, cfg, out_dtype)
        key = (
            g_t.data.shape, g_t.data.stride(), g_t.scale.stride(), g_t.block, g_t.fmt,
            x_t.data.shape, x_t.data.stride(), x_t.scale.stride(), x_t.block, x_t.fmt,
            out_dtype, profile_of(g_t.device), cfg,
        )  # fmt: skip
        if key != self._key:
            self._key, self._direct = key, self._plan(g_t, x_t, cfg, out_dtype)
        if self._direct is None:
            return _wgrad_matmul(g_t, x_t, cfg, out_dtype)
        # blockwise_scaled_mm(g_t, x_t.t()) without its per-call layout work: the plan found both
        # scale tensors already as cuBLAS reads them (dy.T's stride 1 along N, x.T's along K)
        recipe = F.ScalingType.BlockWise1x128
        y = F.scaled_mm(
            g_t.data, x_t.data.t(), g_t.scale, recipe, x_t.scale, recipe, output_dtype=self._direct
        )
        return y.to(out_dtype)

    @staticmethod
    def _plan(
        g_t: Fp8Tensor, x_t: Fp8Tensor, cfg: Fp8LinearConfig, out_dtype: torch.dtype
    ) -> torch.dtype | None:
        """The direct call's output dtype where it applies (cuBLAS blockwise, 1x128 x 1x128, both
        operands and scales laid out as it reads them), else None."""
        b = x_t.t()
        plan = plan_for(g_t, b, cfg.backend, out_dtype, cfg.bf16_exact)
        if plan.kernel != "cublas_blockwise" or g_t.block != TILE_1x128 or x_t.block != TILE_1x128:
            return None
        laid_a, laid_b = lay_out(g_t, b, plan.k_multiple)
        sa, sb = blockwise_scales_for_cublas(g_t, b)  # what blockwise_scaled_mm would pass
        same = sa.stride() == g_t.scale.stride() and sb.stride() == x_t.scale.stride()
        same = same and sa.shape == g_t.scale.shape and sb.shape == x_t.scale.shape
        return plan.out_dtype if laid_a is g_t and laid_b is b and same else None


def _wgrad_matmul(
    g_t: Fp8Tensor, x_t: Fp8Tensor, cfg: Fp8LinearConfig, out_dtype: torch.dtype
) -> torch.Tensor:
    """``g_t @ x_t.T`` through :func:`fp8_matmul` (its plan and layout work on every call)."""
    return fp8_matmul(g_t, x_t.t(), backend=cfg.backend, out_dtype=out_dtype, bf16_exact=cfg.bf16_exact)


def _quantize_rows(x: torch.Tensor, fmt: str, block: Block, cfg: Fp8LinearConfig, where: str) -> Fp8Tensor:
    """A GEMM's first operand; on CUDA with rows padded to 16 in the quantizing pass itself."""
    if block == TILE_1x128:
        return quantize_rows(x, fmt, power_of_two=cfg.power_of_two_scales, where=where, rows_multiple=16)
    return quantize(x, fmt, block, power_of_two=cfg.power_of_two_scales, where=where)


class _LastInput(threading.local):
    """The last training input's two FP8 layouts, for the next layer that reads the same tensor:
    Hugging Face's attention calls ``q_proj``, ``k_proj`` and ``v_proj`` on one hidden state
    (fused into one GEMM only where every output is whole 128-row blocks, ``workers.fp8.fused``;
    SmolLM2's 576 and 192 are not), so without this it is quantized three times.

    The same tensor means the same storage, offset, shape, strides, dtype and version counter
    (an in-place write bumps it), with the same quantization config. The entry holds a
    reference to the input, so its memory cannot be freed and handed to another tensor while it
    is the key."""

    def __init__(self) -> None:
        self.key: tuple[Any, ...] | None = None
        self.x: torch.Tensor | None = None
        self.layouts: tuple[Fp8Tensor, Fp8Tensor] | None = None

    @staticmethod
    def _key(x: torch.Tensor, cfg: Fp8LinearConfig) -> tuple[Any, ...]:
        storage = x.untyped_storage().data_ptr()
        return (storage, x.storage_offset(), tuple(x.shape), x.stride(), x.dtype, x.device, x._version, cfg)

    def get(self, x: torch.Tensor, cfg: Fp8LinearConfig) -> tuple[Fp8Tensor | None, Any]:
        if self.layouts is None or self.key != self._key(x, cfg):
            return None, None
        return self.layouts

    def put(self, x: torch.Tensor, cfg: Fp8LinearConfig, x_q: Fp8Tensor, x_t: Fp8Tensor) -> None:
        if x.untyped_storage().data_ptr() == 0:  # meta or empty: no address tells two tensors apart
            self.key = self.x = self.layouts = None
            return
        # detached (the storage stays, the version counter is shared; no autograd graph is kept)
        self.key, self.x, self.layouts = self._key(x, cfg), x.detach(), (x_q, x_t)


_LAST_INPUT = _LastInput()


def train_forward(
    ctx: Any, x2d: torch.Tensor, owner: Any, bias: torch.Tensor | None, wgrad: bool, w_dtype: torch.dtype
) -> torch.Tensor:
    """The forward of an FP8 GEMM autograd will differentiate: ``owner`` (an :class:`Fp8Linear`, or
    a fused group of them in a trainer) gives the config, the FP8 weight and the bound GEMMs;
    ``wgrad``: a weight gradient will be asked for (keep ``x.T`` in FP8)."""
    cfg = owner.config
    w_q = owner.fp8_weight()
    p2 = cfg.power_of_two_scales
    x_q = None
    if wgrad and cfg.activation_block == TILE_1x128 and cfg.rows_multiple == 1:
        # wgrad contracts over M: x.T [K, M] tiled along tokens, in FP8, row-major, made in the
        # same pass as fprop's x (one read of x on a GPU; there x.T's tokens are padded to a
        # multiple of 128, so wgrad finds them laid out); once for layers that read one tensor
        x_q, ctx.x_t = _LAST_INPUT.get(x2d, cfg)
        if x_q is None:
            where = f"{owner.name}: input"
            x_q, ctx.x_t = quantize_dual(
                x2d, cfg.forward_fmt, power_of_two=p2, where=where, rows_multiple=16, pad_tokens=True
            )
            _LAST_INPUT.put(x2d, cfg, x_q, ctx.x_t)
    elif wgrad:
        where = f"{owner.name}: input (wgrad copy)"
        ctx.x_t = quantize(x2d.t(), cfg.forward_fmt, cfg.activation_block, power_of_two=p2, where=where)
    y = fprop_gemm(x2d, owner.fprop_gemm, w_q, bias, cfg, owner.name, x_q)
    ctx.wgrad_triton = wgrad and owner.fprop_gemm.wgrad_triton()
    ctx.owner = owner
    ctx.w_q = w_q
    ctx.x_dtype = x2d.dtype
    ctx.w_dtype = w_dtype
    return y


def train_backward(
    ctx: Any, grad_y: torch.Tensor, need_dx: bool, need_dw: bool, need_db: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(dx, dW, db)`` of :func:`train_forward`'s GEMM for ``grad_y [M, N]`` (None where not
    needed): dgrad through the owner's bound GEMM, wgrad from the FP8 ``x.T`` kept in forward."""
    owner = ctx.owner
    cfg = owner.config
    p2 = cfg.power_of_two_scales
    grad_x = grad_w = grad_b = None
    where = f"{owner.name}: output gradient"
    g_q = g_t = None
    if need_dx and need_dw and cfg.grad_block == TILE_1x128:  # both layouts from one read of dy
        pad = ctx.x_t.shape[1] != grad_y.shape[0]  # x.T's tokens were padded: pad dy.T's alike
        g_q, g_t = quantize_dual(
            grad_y, cfg.grad_fmt, power_of_two=p2, where=where, rows_multiple=16, pad_tokens=pad
        )
    if need_dx:
        if g_q is None:
            g_q = _quantize_rows(grad_y, cfg.grad_fmt, cfg.grad_block, cfg, where)  # [M', N], M' >= M
        grad_x = owner.dgrad_gemm.bound(ctx.w_q, cfg, g_q.device, ctx.x_dtype)(g_q)  # [M', K]
        grad_x = grad_x[: grad_y.shape[0]].to(ctx.x_dtype)  # [M, K]
    if need_dw:
        if g_t is None:
            g_t = quantize(grad_y.t(), cfg.grad_fmt, cfg.grad_block, power_of_two=p2, where=where)  # [N, M]
        x_t = ctx.x_t
        if ctx.wgrad_triton and g_t.block == TILE_1x128 and x_t.block == TILE_1x128:
            from workers.fp8.triton_wgrad import wgrad_gemm

            # over the tokens both hold (x.T's padded ones are left out), float32 per 128 tokens
            grad_w = wgrad_gemm(g_t.data, g_t.scale, x_t.data, x_t.scale, ctx.w_dtype)
        else:
            if x_t.shape[1] != g_t.shape[1]:  # x.T padded, dy.T not: the GEMM pads both again
                x_t = Fp8Tensor(x_t.data[:, : g_t.shape[1]], x_t.scale, x_t.block, x_t.fmt)
            # float32 accumulation, written in the master weight's dtype by the kernel itself
            grad_w = owner.wgrad_gemm(g_t, x_t, cfg, ctx.w_dtype)
    if need_db:
        grad_b = grad_y.to(torch.float32).sum(dim=0)  # [N]
    return grad_x, grad_w, grad_b
