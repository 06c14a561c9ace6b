"""NaN/inf detection without a host sync per call: the guard names the first bad call and block."""

from __future__ import annotations

import pytest
import torch

from workers.fp8 import NonFiniteError, finite_guard, quantize


def test_inside_a_guard_nothing_raises_until_the_end() -> None:
    x = torch.ones(40, 300)
    x[33, 260] = float("nan")
    with pytest.raises(NonFiniteError) as info, finite_guard() as guard:
        quantize(torch.ones(8, 128), "e4m3", (1, 128), where="first")
        quantize(x, "e4m3", (1, 128), where="second")  # returns: the check is deferred
        quantize(x * float("inf"), "e4m3", (128, 128), where="third")
        assert guard.calls == 3
    # by hand: row 33, column 260 is in the 1x128 tile (33, 260 // 128 = 2), columns 256..299
    message = str(info.value)
    assert message.startswith("second: input of shape (40, 300)")
    assert "block (33, 2): rows 33..33, columns 256..299" in message and "call 2 of 3" in message


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize(
    "block,expected",
    [
        (None, "one scale per tensor"),
        ((1, 128), "block (2, 2): rows 2..2, columns 256..299"),
        ((128, 128), "block (0, 2): rows 0..3, columns 256..299"),
    ],
)
def test_every_kind_of_non_finite_is_caught(bad: float, block: tuple[int, int] | None, expected: str) -> None:
    x = torch.randn(4, 300)
    x[2, 257] = bad
    with (
        pytest.raises(NonFiniteError, match=expected.replace("(", r"\(").replace(")", r"\)")),
        finite_guard(),
    ):
        quantize(x, "e5m2", block)


def test_finite_inputs_pass_and_check_false_defers_to_the_caller() -> None:
    with finite_guard():
        quantize(torch.randn(64, 256), "e4m3", (1, 128))
    with finite_guard(check=False) as guard:
        quantize(torch.full((2, 128), float("nan")), "e4m3", (1, 128))
    with pytest.raises(NonFiniteError):
        guard.check()
    guard.reset()
    guard.check()  # nothing recorded any more


def test_outside_a_guard_a_cpu_tensor_is_checked_at_once() -> None:
    x = torch.ones(4, 300)
    x[2, 257] = float("nan")
    with pytest.raises(NonFiniteError, match=r"first at index \(2, 257\)"):
        quantize(x, "e4m3", (1, 128))


def test_kv_calibration_is_checked_too() -> None:
    from workers.fp8.kv_cache import KvScaleCalibrator

    cal = KvScaleCalibrator(num_layers=2)
    with pytest.raises(NonFiniteError, match="KV calibration of layer 1 \\(V\\)"), finite_guard():
        cal.observe(1, torch.ones(3, 4), torch.tensor([1.0, float("inf")]))
