"""The CPU quantizer without padded copies (workers/fp8/quant.py, ``_*_cpu``) against the padded
formula written out here: bytes, scales, dequantized values, their memory layout and the
emulated GEMMs, bit for bit, on shapes whose last block is partial.

The reference is the straightforward one (pad with zeros to whole blocks, reshape to
``[nR, br, nC, bc]``, amax, divide, clamp, cast; dequantize: pad, multiply, slice), using torch's
own float8 casts and none of fp8rl's helpers. Layout matters for the dequantized operands: a
float32 GEMM is only promised to sum alike over the same layout, so the fast path must hand the
GEMM what the padded formula did (a view into a padded buffer where a block is partial).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from workers.fp8 import finite_guard, get_format, quantize
from workers.fp8.linear import Fp8Linear
from workers.fp8.matmul import matmul_emulated
from workers.fp8.quant import block_amax, cast_to_fp8, quantize_dual

TINY = torch.finfo(torch.float32).tiny
ROWS = [1, 37, 3648]
COLS = [576, 200, 1536, 128, 1]


def ref_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    br, bc = block
    rows, cols = x.shape[-2:]
    xp = F.pad(x.float(), (0, -cols % bc, 0, -rows % br))  # zeros never raise a max
    return xp.reshape(*x.shape[:-2], xp.shape[-2] // br, br, xp.shape[-1] // bc, bc).abs().amax(dim=(-3, -1))


def ref_scale(amax: torch.Tensor, fmt: str, power_of_two: bool) -> torch.Tensor:
    fmax = torch.tensor(get_format(fmt).max, dtype=torch.float32)
    scale = (amax / fmax).clamp(min=TINY)
    if power_of_two:  # the next power of two at or above, worked out in float64
        scale = (2.0 ** torch.ceil(torch.log2(scale.double()))).float()
    return scale


def ref_quantize(
    x: torch.Tensor, fmt: str, block: tuple[int, int], power_of_two: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 data, float32 scales) of ``x [*lead, R, C]`` by the padded formula."""
    f = get_format(fmt)
    br, bc = block
    rows, cols = x.shape[-2:]
    n_r, n_c = math.ceil(rows / br), math.ceil(cols / bc)
    xp = F.pad(x.float(), (0, n_c * bc - cols, 0, n_r * br - rows))
    blocks = xp.reshape(*x.shape[:-2], n_r, br, n_c, bc)
    scale = ref_scale(ref_amax(x, block), fmt, power_of_two)
    scaled = (blocks / scale[..., :, None, :, None]).reshape(xp.shape)[..., :rows, :cols]
    return scaled.clamp(-f.max, f.max).to(f.dtype).contiguous(), scale


def ref_dequantize(data: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``data * scale`` by the padded formula, in its layout (torch's own float8 decode)."""
    br, bc = block
    rows, cols = data.shape[-2:]
    n_r, n_c = scale.shape[-2:]
    x = data.to(torch.float32)
    padded = n_r * br != rows or n_c * bc != cols
    xp = F.pad(x, (0, n_c * bc - cols, 0, n_r * br - rows)) if padded else x
    blocks = xp.reshape(*x.shape[:-2], n_r, br, n_c, bc)
    out = (blocks * scale.reshape(*scale.shape[:-2], n_r, 1, n_c, 1)).reshape(
        *x.shape[:-2], n_r * br, n_c * bc
    )
    return out[..., :rows, :cols] if padded else out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def layout(t: torch.Tensor) -> tuple[int, ...]:
    """Strides where they place elements (a dim of size 1 has none to place)."""
    return tuple(st for st, n in zip(t.stride(), t.shape, strict=True) if n > 1)


def same_floats(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns (NaN payloads and signed zeros included) in the same layout."""
    return (
        a.shape == b.shape
        and layout(a) == layout(b)
        and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))
    )


def activation(rows: int, cols: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Normal values with outliers, a zero row and a tiny block (the clamps and subnormals)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp(2 * torch.randn(rows, 1, generator=g))
    x.view(-1)[torch.randint(0, x.numel(), (max(1, x.numel() // 500),), generator=g)] *= 1000.0
    x[0, : min(cols, 100)] = 1e-39  # below float32's smallest normal: the scale clamps to tiny
    if rows > 2:
        x[rows // 2] = 0.0  # all-zero tiles
    return x.to(dtype)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("cols", COLS)
@pytest.mark.parametrize("block", [(1, 128), (128, 128)])
def test_quantize_matches_padded_formula(rows: int, cols: int, block: tuple[int, int]) -> None:
    for fmt, dtype, p2 in (("e4m3", torch.float32, False), ("e5m2", torch.bfloat16, True)):
        x = activation(rows, cols, dtype)
        q = quantize(x, fmt, block, power_of_two=p2)
        data, scale = ref_quantize(x, fmt, block, p2)
        assert same_bytes(q.data, data) and q.data.is_contiguous(), (fmt, dtype)
        assert torch.equal(q.scale, scale)
        assert same_floats(q.dequantize(), ref_dequantize(data, scale, block))
        # the transposed operand (a weight's W.T, wgrad's x.T.T): column-major bytes
        assert same_floats(q.t().dequantize(), ref_dequantize(data.t(), scale.t(), block[::-1]))
        assert torch.equal(block_amax(x, block), ref_amax(x, block))


@pytest.mark.parametrize("rows", [*ROWS, 3584])
@pytest.mark.parametrize("cols", [576, 200, 1536])
def test_quantize_dual_is_the_two_padded_quantizations(rows: int, cols: int) -> None:
    """x in 1x128 tiles along K and x.T in 1x128 tiles along M (fprop's and wgrad's operands)."""
    for fmt, dtype in (("e4m3", torch.float32), ("e5m2", torch.bfloat16)):
        x = activation(rows, cols, dtype, seed=1)
        q, q_t = quantize_dual(x, fmt)
        data, scale = ref_quantize(x, fmt, (1, 128))
        data_t, scale_t = ref_quantize(x.t(), fmt, (1, 128))
        assert same_bytes(q.data, data) and torch.equal(q.scale, scale)
        assert same_bytes(q_t.data, data_t) and torch.equal(q_t.scale, scale_t)
        assert q_t.data.is_contiguous() and q_t.block == (1, 128)
        # wgrad dequantizes x.T.T: [M, K] with 128x1 blocks, column-major bytes
        assert same_floats(q_t.t().dequantize(), ref_dequantize(data_t.t(), scale_t.t(), (128, 1)))


def test_block_amax_with_leading_dims_and_float64() -> None:
    x = activation(3 * 37, 200, torch.float64, seed=2).reshape(3, 37, 200)
    for block in ((1, 128), (16, 64), (128, 128)):
        assert torch.equal(block_amax(x, block), ref_amax(x, block))
        q = quantize(x, "e4m3", block)
        data, scale = ref_quantize(x, "e4m3", block)
        assert same_bytes(q.data, data) and torch.equal(q.scale, scale)
        assert same_floats(q.dequantize(), ref_dequantize(data, scale, block))


def test_cast_to_fp8_with_given_scales_saturates() -> None:
    """Scales that do not come from x's maxima: the clamp is needed and kept."""
    x = activation(37, 576, torch.float32, seed=3)
    scale = torch.full((37, 5), 1e-3)
    q = cast_to_fp8(x, scale, "e4m3", (1, 128))
    want = ref_dequantize(torch.zeros(37, 640, dtype=torch.float8_e4m3fn), scale, (1, 128))  # layout only
    xp = F.pad(x, (0, 64)).reshape(37, 5, 128) / scale[..., None]
    data = xp.reshape(37, 640)[:, :576].clamp(-448, 448).to(torch.float8_e4m3fn)
    assert same_bytes(q.data, data)
    assert (q.data.float().abs() == 448).any()  # it did saturate
    assert layout(q.dequantize()) == layout(want)


@pytest.mark.parametrize("fmt,bound", [("e4m3", 464.0), ("e5m2", 61440.0)])
def test_cast_rounds_down_to_max_below_the_bound(fmt: str, bound: float) -> None:
    """Why quantize needs no clamp: every float32 from max/2 up to ``bound`` (exclusive), of
    either sign, casts to what it casts to once clamped at max; x / scale stays below max * (1 +
    2^-23) when the scale comes from x's block maximum."""
    f = get_format(fmt)
    lo = int(torch.tensor(f.max / 2).view(torch.int32))
    hi = int(torch.tensor(bound).view(torch.int32))
    v = torch.arange(lo, hi, dtype=torch.int32).view(torch.float32)
    v = torch.cat([v, -v])
    assert same_bytes(v.to(f.dtype), v.clamp(-f.max, f.max).to(f.dtype))


def test_quotients_above_max_occur_and_match() -> None:
    """Block maxima whose quotient by their float32 scale lands above 448: the bytes still match
    the clamped reference (448)."""
    amax = torch.rand(4096) * 100 + 1
    over = amax / (amax / 448.0) > 448.0
    assert over.any()
    x = torch.zeros(4096, 128)
    x[:, 7] = -amax
    x[:, 0] = amax * 0.5
    q = quantize(x, "e4m3", (1, 128))
    data, scale = ref_quantize(x, "e4m3", (1, 128))
    assert same_bytes(q.data, data) and torch.equal(q.scale, scale)
    assert (q.data[over, 7].float() == -448).all()


def test_non_finite_inputs_give_the_same_bytes() -> None:
    """NaN of either sign and infinities (reported by the guard): same bytes, NaN signs included."""
    x = activation(37, 576, torch.float32, seed=4)
    x[1, 3], x[2, 130], x[3, 560], x[4, 0], x[5, 520] = math.nan, -math.nan, math.inf, -math.inf, math.inf
    x[5, 521] = -math.inf
    with finite_guard(check=False) as guard:
        q, q_t = quantize_dual(x, "e4m3")
        q1 = quantize(x, "e5m2", (1, 128))
        q2 = quantize(x, "e4m3", (128, 128))
    assert guard is not None
    for got, (data, scale) in (
        (q, ref_quantize(x, "e4m3", (1, 128))),
        (q_t, ref_quantize(x.t(), "e4m3", (1, 128))),
        (q1, ref_quantize(x, "e5m2", (1, 128))),
        (q2, ref_quantize(x, "e4m3", (128, 128))),
    ):
        assert same_bytes(got.data, data)
        assert torch.equal(got.scale.view(torch.int32), scale.view(torch.int32))
    for block in ((1, 128), (128, 1), (128, 128)):
        assert torch.equal(block_amax(x, block).view(torch.int32), ref_amax(x, block).view(torch.int32))


@pytest.mark.parametrize("rows", [1, 37, 200])
def test_emulated_gemms_match_padded_operands(rows: int) -> None:
    """fprop, dgrad and wgrad of an FP8 linear (576 -> 1536 -> 576), forward and backward, equal
    float32 GEMMs of operands dequantized by the padded formula, bit for bit."""
    torch.manual_seed(rows)
    up, down = torch.nn.Linear(576, 1536), torch.nn.Linear(1536, 576)
    layers = [Fp8Linear.from_linear(up, name="up"), Fp8Linear.from_linear(down, name="down")]
    x = activation(rows, 576, torch.float32, seed=5).clamp(-50, 50).requires_grad_(True)
    h = layers[0](x)
    y = layers[1](torch.relu(h))
    g = torch.randn_like(y)
    y.backward(g)

    def deq(t: torch.Tensor, fmt: str, block: tuple[int, int]) -> torch.Tensor:
        return ref_dequantize(*ref_quantize(t, fmt, block), block)

    w_up, w_down = (deq(m.weight.detach(), "e4m3", (128, 128)) for m in (up, down))
    x0 = x.detach()
    h_ref = deq(x0, "e4m3", (1, 128)) @ w_up.t() + up.bias.detach()
    a1 = torch.relu(h_ref)
    y_ref = deq(a1, "e4m3", (1, 128)) @ w_down.t() + down.bias.detach()
    assert torch.equal(h.detach(), h_ref) and torch.equal(y.detach(), y_ref)
    # down: dgrad and wgrad
    da1 = deq(g, "e4m3", (1, 128)) @ w_down
    d_t, s_t = ref_quantize(a1.t(), "e4m3", (1, 128))
    dw_down = deq(g.t(), "e4m3", (1, 128)) @ ref_dequantize(d_t.t(), s_t.t(), (128, 1))
    assert down.weight.grad is not None and torch.equal(down.weight.grad, dw_down)
    dh = da1 * (h_ref > 0)
    dx = deq(dh, "e4m3", (1, 128)) @ w_up
    x_t, sx_t = ref_quantize(x0.t(), "e4m3", (1, 128))
    dw_up = deq(dh.t(), "e4m3", (1, 128)) @ ref_dequantize(x_t.t(), sx_t.t(), (128, 1))
    assert up.weight.grad is not None and x.grad is not None
    assert torch.equal(up.weight.grad, dw_up) and torch.equal(x.grad, dx)
    # and the GEMM entry point itself, with a column-major second operand
    qa, qb = quantize(dh.t(), "e4m3", (1, 128)), quantize(x0.t(), "e4m3", (1, 128)).t()
    assert torch.equal(matmul_emulated(qa, qb), dw_up)
