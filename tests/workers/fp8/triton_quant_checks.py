"""Checks of the Triton quantizers that need Triton's interpreter, which must be switched on before
Triton is imported: ``test_triton_quant.py`` runs this module in a fresh interpreter with
``TRITON_INTERPRET=1`` (``python -m tests.workers.fp8.triton_quant_checks``).

The interpreter's FP8 casts round a few values differently from the GPU's and torch's, so FP8
bytes are compared kernel against kernel (the dual-layout pass against two calls of the one-layout
kernel, as :func:`workers.fp8.quant.quantize` makes them on a GPU); scales, which need no FP8 cast,
are compared with torch's quantizer exactly.
"""

from __future__ import annotations

import torch

from workers.fp8.quant import quantize
from workers.fp8.triton_quant import quantize_1x128, quantize_1x128_dual

E4M3 = ("e4m3", 448.0, torch.float8_e4m3fn)
E5M2 = ("e5m2", 57344.0, torch.float8_e5m2)
NONE = torch.iinfo(torch.int64).max


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.stride() == b.stride()
        and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    )


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)


def dual_layout_pass_writes_the_two_calls_bytes_and_scales() -> None:
    """Odd shapes (partial tiles along both dims), one token, padded rows, E4M3/E5M2, power-of-two
    scales, a strided input (a transposed view), values over five decades."""
    g = torch.Generator().manual_seed(0)
    for rows, cols, fmt, pow2, transposed in (
        (200, 300, E4M3, False, False),
        (130, 256, E5M2, False, False),
        (1, 128, E4M3, True, False),
        (40, 384, E4M3, False, True),
    ):
        x = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 2, cols)
        if transposed:
            x = x.t().contiguous().t()  # the same values, column-major
        x = x.to(torch.bfloat16)
        rows_out = -(-rows // 16) * 16
        data, scale, data_t, scale_t = quantize_1x128_dual(x, *fmt, pow2, None, rows_out)
        one, one_scale = quantize_1x128(x, *fmt, pow2, None, rows_out)
        t, t_scale = quantize_1x128(x.t(), *fmt, pow2, None, cols)
        case = (rows, cols, fmt[0], pow2, transposed)
        assert same_bytes(data, one) and same(scale, one_scale), case
        assert same_bytes(data_t, t) and same(scale_t, t_scale), case
        assert torch.equal(scale[:rows], quantize(x, fmt[0], (1, 128), power_of_two=pow2).scale), case
        assert torch.equal(scale_t, quantize(x.t(), fmt[0], (1, 128), power_of_two=pow2).scale), case
        assert bool((data[rows:].float() == 0).all()) and bool((scale[rows:] == 1).all()), case


def the_guard_is_touched_only_by_a_non_finite_tile() -> None:
    """All finite: the guard's code stays "none". A NaN at row 33, column 200 of a 256-wide tensor
    is tile 33 * 2 + 1 of the call: both kernels fold exactly that code."""
    x = torch.randn(40, 256)
    for kernel in ("one", "dual"):
        code = torch.full((), NONE, dtype=torch.int64)
        run(kernel, x, code)
        assert int(code) == NONE, kernel
        bad = x.clone()
        bad[33, 200] = float("nan")
        bad[39, 0] = float("inf")  # a later tile: the minimum names the first
        run(kernel, bad, code)
        assert int(code) == 5 * 2**32 + 33 * 2 + 1, (kernel, int(code))


def run(kernel: str, x: torch.Tensor, code: torch.Tensor) -> None:
    if kernel == "one":
        quantize_1x128(x, *E4M3, False, (code, 5), 48)
    else:
        quantize_1x128_dual(x, *E4M3, False, (code, 5), 48)


CHECKS = (
    dual_layout_pass_writes_the_two_calls_bytes_and_scales,
    the_guard_is_touched_only_by_a_non_finite_tile,
)

if __name__ == "__main__":
    for check in CHECKS:
        check()
        print(f"ok {check.__name__}")
