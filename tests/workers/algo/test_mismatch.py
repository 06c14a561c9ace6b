"""mismatch_metrics: identities, a hand-worked example with w = 2, and a float64 loop reference."""

from __future__ import annotations

import math

import pytest
import torch

from workers.algo import mismatch_metrics

NAN, INF = float("nan"), float("inf")

KEYS = {
    "mismatch/token_mult_prob_error",
    "mismatch/gen_kl_error",
    "mismatch/policy_kl_error",
    "mismatch/js_divergence_error",
    "mismatch/sampling_importance_ratio",
    "mismatch/is_oob_ratio",
    "mismatch/chi2_token",
    "mismatch/num_tokens",
}
IDENTITY = {key: 0.0 for key in KEYS} | {
    "mismatch/token_mult_prob_error": 1.0,
    "mismatch/sampling_importance_ratio": 1.0,
}


def test_identical_policies_give_identity_values(seed: int) -> None:
    logp = -torch.rand(3, 5) * 4
    mask = torch.tensor([[1.0] * 5, [1.0, 1.0, 0.0, 0.0, 0.0], [0.0] * 5])
    out = mismatch_metrics(logp, logp.clone(), mask)
    assert set(out) == KEYS
    assert all(type(v) is float for v in out.values())
    assert out == pytest.approx(IDENTITY | {"mismatch/num_tokens": 7.0}, abs=1e-12)


@pytest.mark.parametrize("mask", [torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.bool)])
def test_no_valid_tokens_gives_identity_values(mask: torch.Tensor) -> None:
    garbage = torch.tensor([[NAN, INF, -INF], [1.0, NAN, 2.0]])
    assert mismatch_metrics(garbage, -garbage, mask) == IDENTITY


def test_hand_example_with_w_equal_two() -> None:
    # Valid tokens: (trainer 0.5, gen 0.25), so d = ln 2, w = 2; and (0.3, 0.3), so d = 0, w = 1.
    # Padding holds nan / inf; row 1 is all padding.
    #   token_mult_prob_error = (e^|ln 2| + e^0) / 2 = (2 + 1) / 2 = 1.5
    #   gen_kl_error    = ((2 - ln 2 - 1) + 0) / 2 = (1 - ln 2) / 2
    #   policy_kl_error = ((2 ln 2 - (2 - 1)) + 0) / 2 = (2 ln 2 - 1) / 2
    #   js: p = 0.25, q = 0.5, m = 0.375, q/p = 2:
    #       0.5 ln(0.25 / 0.375) + 0.5 * 2 * ln(0.5 / 0.375) = 0.5 ln(2/3) + ln(4/3); second token 0
    #   sampling_importance_ratio = (2 + 1) / 2 = 1.5
    #   chi2_token = ((2 - 1)^2 + 0) / 2 = 0.5
    ln2 = math.log(2.0)
    logp_trainer = torch.tensor([[math.log(0.5), math.log(0.3), NAN], [INF, NAN, -INF]])
    logp_gen = torch.tensor([[math.log(0.25), math.log(0.3), -INF], [NAN, -INF, INF]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    expected = {
        "mismatch/token_mult_prob_error": 1.5,
        "mismatch/gen_kl_error": (1 - ln2) / 2,
        "mismatch/policy_kl_error": (2 * ln2 - 1) / 2,
        "mismatch/js_divergence_error": (0.5 * math.log(2 / 3) + math.log(4 / 3)) / 2,
        "mismatch/sampling_importance_ratio": 1.5,
        "mismatch/is_oob_ratio": 0.5,  # w = 2 > high = 1.5; w = 1 inside
        "mismatch/chi2_token": 0.5,
        "mismatch/num_tokens": 2.0,
    }
    # float32 inputs: d is ln 2 to about 1e-7.
    assert mismatch_metrics(logp_trainer, logp_gen, mask, high=1.5) == pytest.approx(expected, rel=1e-6)
    # With high = 3 both tokens are inside the bounds.
    wide = mismatch_metrics(logp_trainer, logp_gen, mask.bool(), high=3.0)
    assert wide["mismatch/is_oob_ratio"] == 0.0


def test_log_ratio_clamped() -> None:
    # d = 100 -> 20: ratio e^20 and finite metrics everywhere.
    out = mismatch_metrics(torch.tensor([[100.0]]), torch.tensor([[0.0]]), torch.ones(1, 1))
    assert out["mismatch/sampling_importance_ratio"] == pytest.approx(math.exp(20.0))
    assert all(math.isfinite(v) for v in out.values())


def test_matches_float64_loop(seed: int) -> None:
    logp_gen = -torch.rand(4, 6) * 3
    logp_trainer = logp_gen + torch.randn(4, 6) * 0.4
    mask = torch.rand(4, 6) < 0.7
    mask[0, 0] = True
    low, high = 0.7, 1.4
    sums = dict.fromkeys(KEYS, 0.0)
    n = 0
    for lt_row, lg_row, m_row in zip(logp_trainer.tolist(), logp_gen.tolist(), mask.tolist(), strict=True):
        for lt, lg, m in zip(lt_row, lg_row, m_row, strict=True):
            if not m:
                continue
            n += 1
            p, q = math.exp(lg), math.exp(lt)
            w, d, mid = q / p, lt - lg, (p + q) / 2
            sums["mismatch/token_mult_prob_error"] += max(q / p, p / q)
            sums["mismatch/gen_kl_error"] += w - math.log(w) - 1
            sums["mismatch/policy_kl_error"] += w * d - (w - 1)
            sums["mismatch/js_divergence_error"] += 0.5 * math.log(p / mid) + 0.5 * (q / p) * math.log(
                q / mid
            )
            sums["mismatch/sampling_importance_ratio"] += w
            sums["mismatch/is_oob_ratio"] += float(not low <= w <= high)
            sums["mismatch/chi2_token"] += (w - 1) ** 2
    expected = {k: v / n for k, v in sums.items()} | {"mismatch/num_tokens": float(n)}
    out = mismatch_metrics(logp_trainer, logp_gen, mask, low=low, high=high)
    assert out == pytest.approx(expected, rel=1e-9, abs=1e-12)
    # Both KL estimators are >= 0 per token, hence in the mean.
    assert out["mismatch/gen_kl_error"] >= 0.0 and out["mismatch/policy_kl_error"] >= 0.0


def test_inputs_with_grad_and_bad_bounds() -> None:
    logp = torch.zeros(1, 2, requires_grad=True)
    out = mismatch_metrics(logp, torch.zeros(1, 2), torch.ones(1, 2))
    assert out["mismatch/num_tokens"] == 2.0
    with pytest.raises(ValueError, match="low <= high"):
        mismatch_metrics(logp, logp, torch.ones(1, 2), low=3.0, high=2.0)
    with pytest.raises(ValueError, match="same shape"):
        mismatch_metrics(logp, logp, torch.ones(1, 3))
