"""The compiled CPU quantizer of power-of-two scales (workers/fp8/cpu_compiled.py) against the
eager one it replaces (workers/fp8/quant.py's CPU path, itself held to a padded reference in
test_quant_cpu_fast.py): the same bytes, scales and BF16 dequantizations, over partial blocks,
both formats and both input dtypes; the eager path for a NaN; and an FP8 layer trained both ways.
Also the reuse of one input's quantization by the layers that read it (q/k/v).

The suite runs with the compiled quantizer off (tests/conftest.py); these tests turn it on, and
the first build costs 5-20 s: they are ``slow``."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from workers.fp8 import cpu_compiled, fp8_tensor, linear_gemm
from workers.fp8 import quant as Q
from workers.fp8.block_ops import scaled_cast_cpu
from workers.fp8.formats import get_format
from workers.fp8.fp8_tensor import BLOCK_128x128, TILE_1x128
from workers.fp8.guard import NonFiniteError
from workers.fp8.linear import Fp8Linear
from workers.fp8.linear_config import Fp8LinearConfig

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("seed")]  # random inputs: the seed is printed


@pytest.fixture
def compiled(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(cpu_compiled.CPU_COMPILE_ENV, "1")
    monkeypatch.setattr(cpu_compiled, "_COMPILED", None)
    yield


def eager(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_compiled, "_COMPILED", False)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("shape", [(300, 200), (128, 256), (257, 640), (1, 130), (64, 576), (130, 1)])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_compiled_quantizer_writes_the_eager_bytes_scales_and_bf16_values(
    compiled: None, shape: tuple[int, int], fmt: str, dtype: torch.dtype
) -> None:
    # magnitudes over 2^-20 .. 2^12 and exact zeros: subnormal FP8 codes, whole zero tiles
    x = torch.randn(*shape) * torch.exp2(torch.randint(-20, 12, shape).float())
    x[: shape[0] // 3, : shape[1] // 2] = 0
    x = x.to(dtype)
    got = Q._quantize_dual_compiled(x, get_format(fmt), "x")
    assert got is not None
    want = Q._quantize_dual_cpu(x, get_format(fmt), True, "x")
    for g, w in zip(got, want, strict=True):
        assert same_bytes(g.data, w.data) and torch.equal(g.scale, w.scale)
        assert (g.block, g.fmt) == (w.block, w.fmt)
        assert torch.equal(g.dequantize(torch.bfloat16), w.dequantize(torch.bfloat16))
        assert torch.equal(g.t().dequantize(torch.bfloat16), w.t().dequantize(torch.bfloat16))
        assert torch.equal(g.dequantize(torch.float32), w.dequantize(torch.float32))  # from the bytes
    assert got[0]._memo, "the BF16 values are kept for the GEMM"


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_extreme_magnitudes_quantize_as_the_eager_division_does(compiled: None, fmt: str) -> None:
    """The compiled call multiplies by each scale's reciprocal where the eager one divides by the
    scale. Both round the same real number while the reciprocal is exact: block maxima from 1e30
    down to 2^-80, beside values whose quotients fall among float32's subnormals or under the
    format's smallest subnormal. A block whose largest FP8 value times its scale would overflow
    BF16 (a maximum of 3.3e38: scale 2^120, over 2^119 for E4M3 and 2^112 for E5M2) cannot give
    its bytes back from BF16 values, so it takes the eager path."""
    f = get_format(fmt)
    maxima = torch.tensor([1e30, 1e25, 1e10, 1.0, 1e-20, 2.0**-80])
    # 2^-k for k in [0, 160): from k = 150 on that is float32's zero, so a 128x1 block (a column)
    # could be all zeros and tiny values, whose scale is too small to take this path (the case of
    # ..._a_block_too_small_for_that_goes_eager): the first row's k stays under 100, so every
    # column's maximum is over 1
    k = torch.randint(0, 160, (6, 200))
    k[0] = torch.randint(0, 100, (200,))
    x = maxima[:, None] * torch.exp2(-k.float()) * torch.randn(6, 200).sign()
    x[:, 0] = x[:, 150] = maxima  # each row's two 1x128 tiles (the second partial) and a partial 128x1
    got = Q._quantize_dual_compiled(x, f, "x")
    assert got is not None
    want = Q._quantize_dual_cpu(x, f, True, "x")
    for g, w in zip(got, want, strict=True):
        assert same_bytes(g.data, w.data) and torch.equal(g.scale, w.scale)
        assert torch.equal(g.dequantize(torch.bfloat16), w.dequantize(torch.bfloat16))
    x[1, 0] = 3.3e38
    assert Q._quantize_dual_compiled(x, f, "x") is None
    got = Q.quantize_dual(x, f, power_of_two=True)
    want = Q._quantize_dual_cpu(x, f, True, "x")
    assert all(
        same_bytes(g.data, w.data) and torch.equal(g.scale, w.scale) for g, w in zip(got, want, strict=True)
    )


def reference_pow2_scale(amax: float, fmt_max: float) -> float:
    """2^ceil(log2(max(amax / fmt_max, float32's tiny))), the division rounded to float32 first:
    by Python's float arithmetic, independent of torch."""
    ratio = float(np.float32(np.float32(amax) / np.float32(fmt_max)))
    ratio = max(ratio, float(np.finfo(np.float32).tiny))
    mantissa, exponent = math.frexp(ratio)  # ratio = mantissa * 2**exponent, mantissa in [0.5, 1)
    return math.ldexp(1.0, exponent - 1 if mantissa == 0.5 else exponent)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_the_compiled_scales_are_powers_of_two_at_every_boundary(compiled: None, fmt: str) -> None:
    """Block maxima at exactly fmt.max x 2^k (the scale stays 2^k), one float32 ulp either side
    (2^k, 2^(k+1)), zero (float32's smallest normal, the smallest scale), and random ones; each
    row of ``x`` is one 1x128 tile whose maximum is that value."""
    f = get_format(fmt)
    exact = [f.max * 2.0**k for k in (-100, -20, -1, 0, 1, 30)]
    near = [float(np.nextafter(np.float32(v), np.float32(sign * np.inf))) for v in exact for sign in (1, -1)]
    tiny = [0.0]  # the smallest scale; a nonzero block that small goes eager (the next test)
    rand = (torch.rand(20, dtype=torch.float64) * 2.0 ** torch.randint(-60, 60, (20,))).tolist()
    maxima = [float(np.float32(v)) for v in exact + near + tiny + rand]
    x = torch.zeros(len(maxima), 128)
    x[:, 5] = torch.tensor(maxima)
    x[::2, 5] *= -1  # |x| makes the maximum
    got = Q._quantize_dual_compiled(x, f, "x")
    assert got is not None
    want = [reference_pow2_scale(v, f.max) for v in maxima]
    assert got[0].scale[:, 0].tolist() == want
    assert torch.equal(got[0].scale, Q._quantize_dual_cpu(x, f, True, "x")[0].scale)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_the_bytes_are_made_on_first_read_and_a_block_too_small_for_that_goes_eager(
    compiled: None, fmt: str
) -> None:
    """The compiled call writes no FP8 bytes: the GEMMs' BF16 values come without them, and the
    bytes made from those values on first read are the eager ones. A nonzero block whose values
    times the scale fall under BF16's normals (maximum 1e-36: scale 2^-127..2^-120) cannot give
    its bytes back from BF16, so it takes the eager path."""
    f = get_format(fmt)
    x = torch.randn(200, 300)
    rows, cols = Q._quantize_dual_compiled(x, f, "x") or (None, None)
    assert rows is not None and cols is not None
    assert rows.shape == (200, 300) and cols.shape == (300, 200) and cols.t().shape == (200, 300)
    rows.dequantize(torch.bfloat16), cols.t().dequantize(torch.bfloat16)
    assert rows._bytes is None and cols._bytes is None  # type: ignore[attr-defined]
    want = Q._quantize_dual_cpu(x, f, True, "x")
    assert same_bytes(rows.data, want[0].data) and same_bytes(cols.data, want[1].data)
    assert same_bytes(cols.t().data, want[1].data.t())
    tiny = x.clone()
    tiny[7, :128] *= 1e-36
    assert Q._quantize_dual_compiled(tiny, f, "x") is None
    got = Q.quantize_dual(tiny, f, power_of_two=True)
    want = Q._quantize_dual_cpu(tiny, f, True, "x")
    assert all(
        same_bytes(g.data, w.data) and torch.equal(g.scale, w.scale) for g, w in zip(got, want, strict=True)
    )


def test_a_nan_takes_the_eager_path_and_its_error(compiled: None) -> None:
    x = torch.randn(70, 300)
    x[5, 17] = float("nan")
    assert Q._quantize_dual_compiled(x, get_format("e4m3"), "x") is None
    with pytest.raises(
        NonFiniteError, match=r"layers\.3: input: input of shape \(70, 300\) has 1 NaN.*\(5, 17\)"
    ):
        Q.quantize_dual(x, "e4m3", power_of_two=True, where="layers.3: input")  # the eager path names it


@pytest.mark.parametrize("shape", [(300, 200), (1, 130), (64, 576), (3, 1)])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_compiled_rows_are_the_eager_rows(
    compiled: None, shape: tuple[int, int], fmt: str, dtype: torch.dtype
) -> None:
    """A GEMM's first operand alone (generation's activations, dgrad's output gradient): the
    eager 1x128 quantizer's scales, its bytes made on first read, and their BF16 values."""
    x = torch.randn(*shape) * torch.exp2(torch.randint(-20, 12, shape).float())
    x[: shape[0] // 3, : shape[1] // 2] = 0
    x = x.to(dtype)
    got = Q.quantize_rows(x, fmt, power_of_two=True)
    assert got._bytes is None  # type: ignore[attr-defined]
    assert got.dequantize(torch.bfloat16) is got._memo[str(torch.bfloat16)]  # the GEMM's operand, kept
    want = Q.quantize(x, fmt, TILE_1x128, power_of_two=True)  # the eager quantizer of 1x128 tiles
    assert torch.equal(got.scale, want.scale) and same_bytes(got.data, want.data)
    assert torch.equal(got.dequantize(torch.bfloat16), want.dequantize(torch.bfloat16))


def test_rows_too_small_or_not_finite_take_the_eager_path(compiled: None) -> None:
    f = get_format("e4m3")
    x = torch.randn(70, 300)
    tiny = x.clone()
    tiny[7, :128] *= 1e-36
    assert Q._quantize_rows_compiled(tiny, f, "x") is None
    got, want = (
        Q.quantize_rows(tiny, f, power_of_two=True),
        Q.quantize(tiny, f, TILE_1x128, power_of_two=True),
    )
    assert torch.equal(got.scale, want.scale) and same_bytes(got.data, want.data)
    x[5, 17] = float("nan")
    assert Q._quantize_rows_compiled(x, f, "x") is None
    with pytest.raises(
        NonFiniteError, match=r"layers\.3: input: input of shape \(70, 300\) has 1 NaN.*\(5, 17\)"
    ):
        Q.quantize_rows(x, f, power_of_two=True, where="layers.3: input")
    assert Q.quantize_rows(torch.zeros(0, 128), f, power_of_two=True).shape == (0, 128)
    assert cpu_compiled._COMPILED not in (None, False)  # none of these turned it off


def test_an_fp8_layer_generates_alike_compiled_and_eager(
    compiled: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Generation's forward reads the activation's BF16 values from the compiled call: the same
    outputs bit for bit as the eager quantizer's."""
    torch.manual_seed(0)
    layer = Fp8Linear.from_linear(
        torch.nn.Linear(576, 384, bias=False), Fp8LinearConfig(power_of_two_scales=True)
    )
    x = torch.randn(37, 576, dtype=torch.bfloat16)
    with torch.inference_mode():
        y = layer(x)
        assert cpu_compiled._COMPILED not in (None, False)
        eager(monkeypatch)
        y0 = layer(x)
    assert torch.equal(y, y0)


def test_a_bad_switch_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_compiled.CPU_COMPILE_ENV, "yes")
    monkeypatch.setattr(cpu_compiled, "_COMPILED", None)
    with pytest.raises(ValueError, match="FP8RL_CPU_COMPILE='yes': use 1"):
        cpu_compiled.enabled()


def train(layer: Fp8Linear, x: torch.Tensor, dy: torch.Tensor) -> list[torch.Tensor]:
    layer.weight.grad = None
    xi = x.clone().requires_grad_(True)
    y = layer(xi)
    y.backward(dy)
    assert xi.grad is not None and layer.weight.grad is not None
    return [y.detach(), xi.grad, layer.weight.grad.clone()]


def test_an_fp8_layer_trains_alike_compiled_and_eager(
    compiled: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fprop and dgrad read the same BF16 operands in the same layout: equal bit for bit. wgrad
    reads them in another layout (x.T's values as ``[M, K]`` rows), so its float32 sums may run in
    another order: within the BF16 GEMM's bound, two of its roundings (test_cpu_bf16_gemm.py)."""
    torch.manual_seed(0)
    layer = Fp8Linear.from_linear(
        torch.nn.Linear(576, 384, bias=False), Fp8LinearConfig(power_of_two_scales=True)
    )
    x = torch.randn(200, 576, dtype=torch.bfloat16)
    dy = torch.randn(200, 384, dtype=torch.bfloat16)
    y, dx, dw = train(layer, x, dy)
    assert cpu_compiled._COMPILED not in (None, False)
    eager(monkeypatch)
    y0, dx0, dw0 = train(layer, x, dy)
    assert torch.equal(y, y0) and torch.equal(dx, dx0)
    scale = float(dw0.abs().max())
    torch.testing.assert_close(dw, dw0, rtol=2.0**-7, atol=2.0**-7 * scale)


def test_a_compiled_training_step_never_makes_the_fp8_bytes(
    compiled: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The BF16 GEMMs read the compiled quantizer's BF16 values; the bytes (a division and a cast
    per element) are made only when something reads them. A layer's forward and backward read
    none: wgrad's GEMM once planned itself from its operands' bytes (173254b), and fp8-e2e's
    training on SmolLM2 went from 1.44x to 1.89x of bf16's time."""
    made: list[tuple[int, ...]] = []
    real = scaled_cast_cpu  # fp8_tensor's own name for it is the one patched

    def counted(x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        made.append(tuple(x.shape))
        return real(x, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(fp8_tensor, "scaled_cast_cpu", counted)
    torch.manual_seed(2)
    layer = Fp8Linear.from_linear(
        torch.nn.Linear(256, 384, bias=False), Fp8LinearConfig(power_of_two_scales=True)
    )
    x, dy = torch.randn(200, 256, dtype=torch.bfloat16), torch.randn(200, 384, dtype=torch.bfloat16)
    train(layer, x, dy)
    train(layer, x, dy)  # a second step: whatever was planned on the first is reused
    assert cpu_compiled._COMPILED not in (None, False)
    assert made == []
    rows, _ = Q.quantize_dual(x, "e4m3", power_of_two=True, where="x")
    rows.data  # noqa: B018 (a read makes them: the count sees it)
    assert made == [(200, 256)]


class Counted:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = Q.quantize_dual

        def counted(*args: object, **kwargs: object) -> object:
            self.calls += 1
            return real(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(linear_gemm, "quantize_dual", counted)


def test_layers_that_read_one_input_quantize_it_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """q/k/v read one hidden state: one quantization of it, and the results of three separate
    ones; an in-place write to the input between two layers (a new version) quantizes again."""
    torch.manual_seed(1)
    cfg = Fp8LinearConfig(power_of_two_scales=True)
    layers = [
        Fp8Linear.from_linear(torch.nn.Linear(256, n, bias=False), cfg, name=f"l{n}") for n in (256, 128, 128)
    ]
    h = torch.randn(96, 256, dtype=torch.bfloat16, requires_grad=True)
    counted = Counted(monkeypatch)
    outs = [m(h) for m in layers]
    assert counted.calls == 1
    sum(o.float().square().sum() for o in outs).backward()
    grads = [h.grad.clone()] + [m.weight.grad.clone() for m in layers]  # type: ignore[union-attr]
    # the same, each layer quantizing on its own
    monkeypatch.setattr(linear_gemm._LAST_INPUT, "get", lambda x, cfg: (None, None))
    h.grad = None
    for m in layers:
        m.weight.grad = None
    before = counted.calls  # 1 + the three output gradients of the backward
    alone = [m(h) for m in layers]
    assert counted.calls - before == 3
    sum(o.float().square().sum() for o in alone).backward()
    for a, b in zip(outs, alone, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(grads, [h.grad] + [m.weight.grad for m in layers], strict=True):
        assert b is not None and torch.equal(a, b)
    monkeypatch.undo()
    counted = Counted(monkeypatch)
    x = torch.randn(96, 256, dtype=torch.bfloat16)
    layers[1](x.requires_grad_(True))
    with torch.no_grad():
        x.mul_(2.0)  # the same storage, a new version
    y2 = layers[2](x)
    assert counted.calls == 2
    y_fresh = layers[2](x.detach().clone().requires_grad_(True))
    assert torch.equal(y2, y_fresh)


def test_meta_tensors_are_never_taken_for_one_another(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every meta tensor's address is 0: two inputs of one shape on meta are quantized apart."""
    layer = Fp8Linear(256, 384, bias=False, device="meta", dtype=torch.bfloat16)
    counted = Counted(monkeypatch)
    for _ in range(2):
        layer(torch.empty(32, 256, device="meta", dtype=torch.bfloat16, requires_grad=True))
    assert counted.calls == 2


@pytest.mark.parametrize("shape", [(300, 200), (128, 256), (576, 1536), (1, 130), (130, 1)])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_compiled_weight_is_the_eager_weight(
    compiled: None, shape: tuple[int, int], fmt: str, dtype: torch.dtype
) -> None:
    """A master weight in 128x128 blocks: the eager quantizer's bytes and scales, and the BF16
    values its dequantization gives (kept for the GEMMs), over partial blocks and zero blocks."""
    w = torch.randn(*shape) * torch.exp2(torch.randint(-20, 12, shape).float())
    w[: shape[0] // 3, : shape[1] // 2] = 0
    w = w.to(dtype)
    got = Q.quantize_weight_compiled(w, get_format(fmt), "w")
    assert got is not None
    want = Q.quantize(w, fmt, BLOCK_128x128, power_of_two=True)
    assert same_bytes(got.data, want.data) and torch.equal(got.scale, want.scale)
    assert str(torch.bfloat16) in got._memo, "the BF16 values are kept for the GEMM"
    assert torch.equal(got.dequantize(torch.bfloat16), want.dequantize(torch.bfloat16))
    assert torch.equal(got.dequantize(torch.float32), want.dequantize(torch.float32))  # from the bytes


def test_a_weight_with_a_nan_takes_the_eager_path(compiled: None) -> None:
    w = torch.randn(200, 300)
    w[150, 7] = float("nan")
    assert Q.quantize_weight_compiled(w, get_format("e4m3"), "w") is None


def test_the_weight_batch_quantizes_compiled_with_the_eager_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A trainer's FP8 weights after an optimizer step (workers/fp8/weights.py's CPU branch), with
    power-of-two scales: compiled and eager give the same bytes, scales and BF16 operands, a fused
    gate/up group's too (its operand the members' stacked)."""
    from workers.fp8.fused import fuse_for_training
    from workers.fp8.weights import WeightBatch

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        cfg = Fp8LinearConfig(power_of_two_scales=True)
        m = torch.nn.Module()
        m.gate_proj = Fp8Linear(256, 384, bias=False, config=cfg)  # fused: whole 128-row blocks
        m.up_proj = Fp8Linear(256, 384, bias=False, config=cfg)
        m.down_proj = Fp8Linear(384, 200, bias=False, config=cfg)  # a partial block
        assert fuse_for_training(m) == 1
        return m

    results = []
    for on in (True, False):
        monkeypatch.setenv(cpu_compiled.CPU_COMPILE_ENV, "1" if on else "0")
        monkeypatch.setattr(cpu_compiled, "_COMPILED", None)
        m = model()
        assert WeightBatch(m).quantize() == 3
        layers = {n: getattr(m, n) for n in ("gate_proj", "up_proj", "down_proj")}
        assert all(isinstance(layer, Fp8Linear) for layer in layers.values())
        fused = layers["gate_proj"].fused_train
        assert fused is not None
        group = fused[0]
        weights = {n: layer.fp8_weight() for n, layer in layers.items()}
        results.append({**weights, "group": group.fp8_weight()})
    assert str(torch.bfloat16) in results[0]["group"]._memo  # stacked from the members' operands
    for name, got in results[0].items():
        want = results[1][name]
        assert same_bytes(got.data, want.data) and torch.equal(got.scale, want.scale), name
        assert torch.equal(got.dequantize(torch.bfloat16), want.dequantize(torch.bfloat16)), name
