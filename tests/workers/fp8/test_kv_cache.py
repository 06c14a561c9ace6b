"""FP8 KV-cache scale calibration against numpy percentiles and hand-worked values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.workers.fp8 import reference as ref
from workers.fp8 import KvScaleCalibrator, abs_percentile, quantize_kv


def test_percentile_matches_numpy_nearest_rank(seed: int) -> None:
    x = torch.randn(4, 8, 33, 16)
    for p in (50.0, 99.0, 99.9, 100.0):
        expected = np.percentile(np.abs(x.numpy().ravel()), p, method="inverted_cdf")
        assert abs_percentile(x, p) == pytest.approx(float(expected), rel=0, abs=0)


def test_hand_worked_scale() -> None:
    # |k| = 1..1000: the 99.9th percentile by nearest rank is element 999 -> 999.
    # scale = 999 * 1.05 / 448 = 2.341406...; v is all 2s -> 2 * 1.05 / 448.
    cal = KvScaleCalibrator(num_layers=2)
    k = torch.arange(1, 1001, dtype=torch.float32)
    cal.observe(0, k, torch.full((10,), 2.0))
    cal.observe(1, -k / 10, torch.full((10,), -4.0))
    s = cal.scales()
    assert s.k.tolist() == pytest.approx([999 * 1.05 / 448, 99.9 * 1.05 / 448], rel=1e-6)
    assert s.v.tolist() == pytest.approx([2 * 1.05 / 448, 4 * 1.05 / 448], rel=1e-6)


def test_largest_observation_wins_and_reset_forgets() -> None:
    cal = KvScaleCalibrator(num_layers=1, percentile=100.0, margin=1.0)
    cal.observe(0, torch.tensor([3.0]), torch.tensor([1.0]))
    cal.observe(0, torch.tensor([2.0]), torch.tensor([5.0]))
    assert cal.scales().k.item() == pytest.approx(3 / 448) and cal.scales().v.item() == pytest.approx(5 / 448)
    cal.reset()
    assert cal.observations == 0 and cal.scales().k.item() == 1.0


def test_calibrated_cache_keeps_precision_and_saturates_only_the_tail(seed: int) -> None:
    # Keys with a heavy tail: a percentile scale clips at most 0.1% of values; everything
    # below the clip point keeps the E4M3 error bound.
    k = torch.randn(2, 4, 64, 32) * torch.rand(1, 4, 1, 32) * 5
    k.view(-1)[torch.randperm(k.numel())[:5]] *= 50
    cal = KvScaleCalibrator(num_layers=1)
    cal.observe(0, k, k)
    scale = cal.scales().k[0]
    q = quantize_kv(k, scale)
    deq = q.dequantize().double()
    clip = float(scale) * 448
    saturated = k.abs() > clip
    assert float(saturated.float().mean()) <= 0.001
    inside = ~saturated
    u, sub = ref.unit_roundoff("e4m3"), ref.min_subnormal("e4m3")
    err = (deq - k.double()).abs()[inside]
    assert bool((err <= u * k.double().abs()[inside] + float(scale) * sub / 2 + 1e-12).all())
    assert bool((deq.abs() <= clip * (1 + 1e-6)).all())


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="percentile"):
        KvScaleCalibrator(2, percentile=0.0)
    with pytest.raises(ValueError, match="margin"):
        KvScaleCalibrator(2, margin=0.9)
    with pytest.raises(ValueError, match="layer=2"):
        KvScaleCalibrator(2).observe(2, torch.ones(1), torch.ones(1))
    with pytest.raises(ValueError, match="NaN"):
        KvScaleCalibrator(1).observe(0, torch.tensor([float("nan")]), torch.ones(1))
