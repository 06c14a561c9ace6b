"""FP8 KV-cache scale calibration and rounding against numpy percentiles and hand-worked values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.workers.fp8 import reference as ref
from workers.fp8 import KvScaleCalibrator, abs_percentile, quantize_kv
from workers.fp8.formats import get_format
from workers.fp8.kv_cache import Fp8KvCache, KvRoundingCache, KvScales, round_kv


def test_percentile_matches_numpy_nearest_rank(seed: int) -> None:
    x = torch.randn(4, 8, 33, 16)
    for p in (50.0, 99.0, 99.9, 100.0):
        expected = np.percentile(np.abs(x.numpy().ravel()), p, method="inverted_cdf")
        assert abs_percentile(x, p) == pytest.approx(float(expected), rel=0, abs=0)


def test_hand_worked_scale() -> None:
    # The rule: 2 ** ceil(log2(amax * margin / 448)), margin 1.
    # K of layer 0: |k| = 1..1000, amax 1000: 1000 / 448 = 2.23 -> 4; layer 1: amax 100: 0.223 -> 0.25.
    # V: amax 2: 2 / 448 = 0.00446 -> 2^-7 = 0.0078125; amax 4: 2^-6. 448 exactly: 1.0 (no rounding up).
    cal = KvScaleCalibrator(num_layers=3)
    k = torch.arange(1, 1001, dtype=torch.float32)
    cal.observe(0, k, torch.full((10,), 2.0))
    cal.observe(1, -k / 10, torch.full((10,), -4.0))
    cal.observe(2, torch.tensor([448.0, -3.0]), torch.zeros(4))
    s = cal.scales()
    assert s.k.tolist() == [4.0, 0.25, 1.0]
    assert s.v.tolist() == [2.0**-7, 2.0**-6, 1.0]  # all zeros: 1.0


def test_the_earlier_percentile_rule_is_still_available() -> None:
    # p99.9 by nearest rank of 1..1000 is 999; x 1.05 / 448, not rounded
    cal = KvScaleCalibrator(num_layers=1, percentile=99.9, margin=1.05, power_of_two=False)
    cal.observe(0, torch.arange(1, 1001, dtype=torch.float32), torch.full((10,), 2.0))
    assert cal.scales().k.item() == pytest.approx(999 * 1.05 / 448, rel=1e-6)


def test_largest_observation_wins_and_reset_forgets() -> None:
    cal = KvScaleCalibrator(num_layers=1, power_of_two=False)
    cal.observe(0, torch.tensor([3.0]), torch.tensor([1.0]))
    cal.observe(0, torch.tensor([2.0]), torch.tensor([5.0]))
    assert cal.scales().k.item() == pytest.approx(3 / 448) and cal.scales().v.item() == pytest.approx(5 / 448)
    cal.reset()
    assert cal.observations == 0 and cal.scales().k.item() == 1.0


def test_calibrated_cache_clips_nothing_it_saw_and_keeps_e4m3_precision(seed: int) -> None:
    # Keys with a heavy tail (outlier channels, a few huge values): the amax rule saturates none
    # of them, and every value keeps the E4M3 error bound (relative 1/16, or half a subnormal step).
    k = torch.randn(2, 4, 64, 32) * torch.rand(1, 4, 1, 32) * 5
    k.view(-1)[torch.randperm(k.numel())[:5]] *= 50
    cal = KvScaleCalibrator(num_layers=1)
    cal.observe(0, k, k)
    scale = cal.scales().k[0]
    assert math.log2(float(scale)).is_integer()
    deq = quantize_kv(k, scale).dequantize().double()
    assert float(k.abs().max()) <= float(scale) * 448
    u, sub = ref.unit_roundoff("e4m3"), ref.min_subnormal("e4m3")
    err = (deq - k.double()).abs()
    assert bool((err <= u * k.double().abs() + float(scale) * sub / 2 + 1e-12).all())


def test_round_kv_is_what_the_fp8_cache_reads_back_with_a_straight_through_gradient(seed: int) -> None:
    # the forward: the values Fp8KvCache stores and returns, bit for bit; the backward: identity
    k = (torch.randn(2, 3, 7, 16) * 3).to(torch.bfloat16)
    v = (torch.randn(2, 3, 7, 16) * 0.2).to(torch.bfloat16)
    scales = KvScales(torch.tensor([2.0**-5]), torch.tensor([2.0**-9]), get_format("e4m3"))
    cached_k, cached_v = Fp8KvCache(1, scales).update(k, v, 0)
    x = k.clone().requires_grad_(True)
    rounded = round_kv(x, scales.k[0])
    assert torch.equal(rounded, cached_k) and torch.equal(round_kv(v, scales.v[0]), cached_v)
    assert not torch.equal(rounded, k)  # it did round
    # round to nearest, by hand at one element: x / s on E4M3's grid (3 mantissa bits)
    y = float(k.flatten()[0]) / 2.0**-5
    e = math.floor(math.log2(abs(y)))
    step = 2.0 ** (max(e, -6) - 3)
    assert float(rounded.detach().flatten()[0]) == round(y / step) * step * 2.0**-5
    g = torch.randn_like(rounded)
    rounded.backward(g)
    assert x.grad is not None and torch.equal(x.grad, g)


def test_the_rounding_cache_hands_attention_rounded_kv_and_stores_nothing() -> None:
    scales = KvScales(torch.tensor([0.5, 2.0**-3]), torch.tensor([0.25, 1.0]), get_format("e4m3"))
    cache = KvRoundingCache(scales)
    k, v = torch.tensor([[1.2, 300.0, -0.01]]), torch.tensor([[0.3, 1000.0, 3.3]])
    got_k, got_v = cache.update(k, v, 0)
    # hand-worked, scale 0.5: 1.2 -> 2.4 -> 2.5 (E4M3 steps of 0.25 in [2, 4)) -> 1.25; 300 -> 600
    # saturates at 448 -> 224; -0.01 -> -0.02: subnormal steps of 2^-9: -10.24 steps -> -10 -> -0.009765625
    assert got_k.tolist()[0] == [1.25, 224.0, -10 * 2.0**-9 * 0.5]
    # scale 0.25: 0.3 -> 1.2 -> 1.25 -> 0.3125; 1000 -> 448 x 0.25 = 112; 3.3 -> 13.2 -> 13 -> 3.25
    assert got_v.tolist()[0] == [0.3125, 112.0, 3.25]
    assert cache.get_seq_length() == 0


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="percentile"):
        KvScaleCalibrator(2, percentile=0.0)
    with pytest.raises(ValueError, match="margin"):
        KvScaleCalibrator(2, margin=0.9)
    with pytest.raises(ValueError, match="layer=2"):
        KvScaleCalibrator(2).observe(2, torch.ones(1), torch.ones(1))
    with pytest.raises(ValueError, match="NaN"):
        KvScaleCalibrator(1).observe(0, torch.tensor([float("nan")]), torch.ones(1))
