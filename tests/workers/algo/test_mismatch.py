"""mismatch_metrics against NeMo RL's definitions, on values worked by hand.

The hand example (``prev`` = trainer log-prob, ``gen`` = generator log-prob, ``w = e^(prev-gen)``):

    row 0: token A  prev = ln 0.5, gen = ln 0.25   d = ln 2,  w = 2
           token B  prev = ln 0.3, gen = ln 0.3    d = 0,     w = 1
           (padding: nan / inf)
    row 1: token C  prev = ln 0.4, gen = ln 0.1    d = ln 4,  w = 4
           (padding)
    row 2: all padding

Over the 3 valid tokens:

    token_mult_prob_error = (2 + 1 + 4) / 3                                       = 7/3
    gen_kl_error    k3(gen, prev) = e^d - d - 1:
                    A: 2 - ln 2 - 1,  B: 0,  C: 4 - 2 ln 2 - 1                    -> (4 - 3 ln 2) / 3
    policy_kl_error k3(prev, gen) = e^-d + d - 1:
                    A: 1/2 + ln 2 - 1,  B: 0,  C: 1/4 + 2 ln 2 - 1                -> (3 ln 2 - 5/4) / 3
    js_divergence_error, m = log(e^prev / 2 + e^gen / 2):
                    A: m = ln 0.375; prev - m = ln(4/3), gen - m = ln(2/3);
                       0.5 (4/3 - ln(4/3) - 1) + 0.5 (2/3 - ln(2/3) - 1) = 0.5 ln(9/8)
                    B: 0
                    C: m = ln 0.25; prev - m = ln(8/5), gen - m = ln(2/5);
                       0.5 (8/5 - ln(8/5) - 1) + 0.5 (2/5 - ln(2/5) - 1) = 0.5 ln(25/16)
                                                                      -> (0.5 ln(9/8) + 0.5 ln(25/16)) / 3
    chi2_token      (w - 1)^2: 1, 0, 9                                            -> 10/3

and, with IS bounds [0.5, 3], per mode (geometric means: row 0 sqrt(2), row 1 4; sequence ratios:
row 0 2, row 1 4; row 2 has no valid token and is not a sequence):

    mode          weights as applied     sampling_importance_ratio   is_oob_ratio
    none          (raw) 2, 1, 4          7/3                         0 (nothing filtered)
    tis           min(w, 3): 2, 1, 3     2                           tokens: 1/3 (C)
    icepop        2, 1, 0                1                           tokens: 1/3 (C)
    seq-mask-tis  2, 1, 0 (row 1 out)    1                           sequences: 1/2
    geo-mask      1, 1, 0                2/3                         sequences: 1/2
    seq-tis       2, 2, 3                7/3                         sequences: 1/2 (row 1 > 3)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import pytest
import torch

from workers.algo import IS_MODES, mismatch_metrics

NAN, INF = float("nan"), float("inf")
LN2 = math.log(2.0)

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

PREV = [[math.log(0.5), math.log(0.3), NAN], [math.log(0.4), INF, -INF], [NAN, NAN, NAN]]
GEN = [[math.log(0.25), math.log(0.3), -INF], [math.log(0.1), NAN, INF], [INF, -INF, 0.0]]
MASK = [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
COMMON = {
    "mismatch/token_mult_prob_error": 7 / 3,
    "mismatch/gen_kl_error": (4 - 3 * LN2) / 3,
    "mismatch/policy_kl_error": (3 * LN2 - 5 / 4) / 3,
    "mismatch/js_divergence_error": (0.5 * math.log(9 / 8) + 0.5 * math.log(25 / 16)) / 3,
    "mismatch/chi2_token": 10 / 3,
    "mismatch/num_tokens": 3.0,
}
PER_MODE = {  # mode: (sampling_importance_ratio, is_oob_ratio)
    "none": (7 / 3, 0.0),
    "tis": (2.0, 1 / 3),
    "icepop": (1.0, 1 / 3),
    "seq-mask-tis": (1.0, 0.5),
    "geo-mask": (2 / 3, 0.5),
    "seq-tis": (7 / 3, 0.5),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mode", IS_MODES)
def test_hand_example(mode: str, dtype: torch.dtype) -> None:
    ratio, oob = PER_MODE[mode]
    expected = COMMON | {
        "mismatch/sampling_importance_ratio": ratio,
        "mismatch/is_oob_ratio": oob,
    }
    out = mismatch_metrics(
        torch.tensor(PREV, dtype=dtype), torch.tensor(GEN, dtype=dtype), torch.tensor(MASK), 0.5, 3.0, mode
    )
    assert set(out) == KEYS and all(type(v) is float for v in out.values())
    # float32 inputs hold each log-prob to about 1e-7 relative
    assert out == pytest.approx(expected, rel=1e-6 if dtype == torch.float32 else 1e-12)


def test_the_two_kl_directions_differ_as_named() -> None:
    # One token, gen = ln 0.1, prev = ln 0.4 (token C): gen_kl_error is k3(gen, prev) =
    # 4 - ln 4 - 1 ~ 1.614, policy_kl_error is k3(prev, gen) = 1/4 + ln 4 - 1 ~ 0.636.
    out = mismatch_metrics(torch.tensor([[math.log(0.4)]]), torch.tensor([[math.log(0.1)]]), torch.ones(1, 1))
    assert out["mismatch/gen_kl_error"] == pytest.approx(3 - 2 * LN2, rel=1e-6)
    assert out["mismatch/policy_kl_error"] == pytest.approx(2 * LN2 - 0.75, rel=1e-6)


def test_identical_policies_give_identity_values(seed: int) -> None:
    logp = -torch.rand(3, 5) * 4
    mask = torch.tensor([[1.0] * 5, [1.0, 1.0, 0.0, 0.0, 0.0], [0.0] * 5])
    for mode in IS_MODES:
        out = mismatch_metrics(logp, logp.clone(), mask, mode=mode)
        assert out == pytest.approx(IDENTITY | {"mismatch/num_tokens": 7.0}, abs=1e-12)


@pytest.mark.parametrize("mask", [torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.bool)])
def test_no_valid_tokens_gives_identity_values(mask: torch.Tensor) -> None:
    garbage = torch.tensor([[NAN, INF, -INF], [1.0, NAN, 2.0]])
    assert mismatch_metrics(garbage, -garbage, mask, mode="icepop") == IDENTITY


def test_no_clamp_on_large_log_ratios() -> None:
    # d = 100: NeMo RL does not clamp its metrics, and float64 holds e^100.
    out = mismatch_metrics(torch.tensor([[0.0]]), torch.tensor([[-100.0]]), torch.ones(1, 1))
    assert out["mismatch/token_mult_prob_error"] == pytest.approx(math.exp(100.0))
    assert out["mismatch/gen_kl_error"] == pytest.approx(math.exp(100.0) - 101.0)
    # JS = m - (prev + gen) / 2 (the two e^(a - m) average to 1), m = log((1 + e^-100) / 2):
    # -ln 2 + 50, to 1e-43
    assert out["mismatch/js_divergence_error"] == pytest.approx(50.0 - LN2)
    values: Mapping[str, Any] = out
    assert all(math.isfinite(v) for v in values.values())


def test_inputs_with_grad_and_bad_arguments() -> None:
    logp = torch.zeros(1, 2, requires_grad=True)
    out = mismatch_metrics(logp, torch.zeros(1, 2), torch.ones(1, 2))
    assert out["mismatch/num_tokens"] == 2.0
    with pytest.raises(ValueError, match="low <= high"):
        mismatch_metrics(logp, logp, torch.ones(1, 2), low=3.0, high=2.0)
    with pytest.raises(ValueError, match="same shape"):
        mismatch_metrics(logp, logp, torch.ones(1, 3))
    with pytest.raises(ValueError, match="mode must be one of"):
        mismatch_metrics(logp, logp, torch.ones(1, 2), mode="seq-is")


def test_the_multiplicative_error_counts_either_direction() -> None:
    # the hand example with trainer and generator swapped: every d changes sign, and
    # exp(|d|) stays 2, 1, 4 -> 7/3 (without the absolute value it would be (1/2 + 1 + 1/4) / 3 = 7/12);
    # the two KL directions trade places
    out = mismatch_metrics(torch.tensor(GEN), torch.tensor(PREV), torch.tensor(MASK))
    assert out["mismatch/token_mult_prob_error"] == pytest.approx(7 / 3, rel=1e-6)
    assert out["mismatch/gen_kl_error"] == pytest.approx(COMMON["mismatch/policy_kl_error"], rel=1e-6)
    assert out["mismatch/policy_kl_error"] == pytest.approx(COMMON["mismatch/gen_kl_error"], rel=1e-6)
