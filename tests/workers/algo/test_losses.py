"""clipped_policy_loss, kl_penalty and aggregate on hand-worked examples."""

from __future__ import annotations

import math

import pytest
import torch

from workers.algo import AGGREGATIONS, aggregate, clipped_policy_loss, kl_penalty

NAN, INF = float("nan"), float("inf")


def logs(values: list[list[float]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).log().float()


def test_clipped_loss_both_signs_by_hand() -> None:
    # logp_old = 0, so ratio = exp(logp); bounds [0.8, 1.2].
    # Row 0, A = +1:
    #   r = 1.0: min(1.0, 1.0) = 1.0 unclipped   -> loss -1.0, grad -r*A = -1.0
    #   r = 1.5: min(1.5, 1.2) = 1.2 clipped     -> loss -1.2, grad 0
    #   r = 0.5: min(0.5, 0.8) = 0.5 unclipped   -> loss -0.5, grad -0.5
    # Row 1, A = -2:
    #   r = 1.1: min(-2.2, -2.2) = -2.2 unclipped -> loss 2.2, grad -r*A = 2.2
    #   r = 1.5: min(-3.0, -2.4) = -3.0 unclipped -> loss 3.0, grad 3.0
    #   r = 0.5: min(-1.0, -1.6) = -1.6 clipped   -> loss 1.6, grad 0
    logp = logs([[1.0, 1.5, 0.5], [1.1, 1.5, 0.5]]).requires_grad_()
    logp_old = torch.zeros(2, 3, requires_grad=True)
    adv = torch.tensor([1.0, -2.0], requires_grad=True)
    terms = clipped_policy_loss(logp, logp_old, adv)
    torch.testing.assert_close(terms.loss, torch.tensor([[-1.0, -1.2, -0.5], [2.2, 3.0, 1.6]]))
    torch.testing.assert_close(terms.clipped, torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]))
    terms.loss.sum().backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, 0.0, -0.5], [2.2, 3.0, 0.0]]))
    # Gradient flows through logp only.
    assert logp_old.grad is None
    assert adv.grad is None


def test_clip_higher_is_asymmetric() -> None:
    # clip_low 0.2, clip_high 0.28: bounds [0.8, 1.28], A = +1.
    #   r = 1.25 is inside -> loss -1.25, not clipped; r = 1.3 -> capped at 1.28, clipped.
    #   r = 0.7 with A = +1: min(0.7, 0.8) = 0.7, unclipped (clip_low only binds for A < 0).
    logp = logs([[1.25, 1.3, 0.7]])
    terms = clipped_policy_loss(logp, torch.zeros(1, 3), torch.tensor([1.0]), clip_low=0.2, clip_high=0.28)
    torch.testing.assert_close(terms.loss, torch.tensor([[-1.25, -1.28, -0.7]]))
    torch.testing.assert_close(terms.clipped, torch.tensor([[0.0, 1.0, 0.0]]))


def test_log_ratio_clamped_before_exp() -> None:
    # logp - logp_old = 60 -> clamped to 20; A = -1 keeps the unclipped -e^20 term: loss e^20.
    terms = clipped_policy_loss(torch.tensor([[30.0]]), torch.tensor([[-30.0]]), torch.tensor([-1.0]))
    torch.testing.assert_close(terms.loss, torch.tensor([[math.exp(20.0)]]))


def test_zero_advantage_gives_zero_loss_and_no_clipping() -> None:
    terms = clipped_policy_loss(logs([[2.0, 0.5]]), torch.zeros(1, 2), torch.tensor([0.0]))
    torch.testing.assert_close(terms.loss, torch.zeros(1, 2))
    torch.testing.assert_close(terms.clipped, torch.zeros(1, 2))


def test_policy_loss_input_errors() -> None:
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="advantages must be"):
        clipped_policy_loss(x, x, torch.zeros(3))
    with pytest.raises(ValueError, match="differ in shape"):
        clipped_policy_loss(x, torch.zeros(2, 4), torch.zeros(2))
    with pytest.raises(ValueError, match="clip_low"):
        clipped_policy_loss(x, x, torch.zeros(2), clip_low=1.5)
    with pytest.raises(ValueError, match="clip_high"):
        clipped_policy_loss(x, x, torch.zeros(2), clip_high=-0.1)


def test_kl_estimators_by_hand() -> None:
    # pi = 0.5, ref = 0.25: logp - logp_ref = ln 2.
    #   k1 = ln 2; k2 = (ln 2)^2 / 2; k3 = exp(-ln 2) - (-ln 2) - 1 = ln 2 - 0.5.
    # Second token: equal log-probs, every estimator is 0.
    ln2 = math.log(2.0)
    logp = logs([[0.5, 0.3]])
    logp_ref = logs([[0.25, 0.3]])
    torch.testing.assert_close(kl_penalty(logp, logp_ref, "k1"), torch.tensor([[ln2, 0.0]]))
    torch.testing.assert_close(kl_penalty(logp, logp_ref, "k2"), torch.tensor([[ln2**2 / 2, 0.0]]))
    torch.testing.assert_close(kl_penalty(logp, logp_ref), torch.tensor([[ln2 - 0.5, 0.0]]))


def test_kl_k3_gradient_and_clamp() -> None:
    # d k3 / d logp = d/dlogp [exp(ref - logp) - (ref - logp) - 1] = 1 - exp(ref - logp) = 1 - 0.5.
    logp = logs([[0.5]]).requires_grad_()
    logp_ref = logs([[0.25]]).requires_grad_()
    kl_penalty(logp, logp_ref, "k3").sum().backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, torch.tensor([[0.5]]))
    assert logp_ref.grad is None
    # logp_ref - logp = 100 -> clamped to 20: k3 = e^20 - 20 - 1, finite.
    out = kl_penalty(torch.tensor([[-100.0]]), torch.tensor([[0.0]]), "k3")
    torch.testing.assert_close(out, torch.tensor([[math.exp(20.0) - 21.0]]))


def test_kl_unknown_kind() -> None:
    with pytest.raises(ValueError, match="kind must be one of"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")  # type: ignore[arg-type]


# Three sequences; padding holds inf and nan. Row 2 has no valid token at all.
GARBAGE_LOSS = [[1.0, 2.0, INF], [4.0, NAN, -INF], [INF, NAN, 5.0]]
GARBAGE_MASK = [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]


@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.bool])
def test_aggregate_token_mean_by_hand(mask_dtype: torch.dtype) -> None:
    # Valid tokens 1, 2, 4: (1 + 2 + 4) / 3 = 7/3; each valid token's gradient is 1/3.
    loss = torch.tensor(GARBAGE_LOSS, requires_grad=True)
    mask = torch.tensor(GARBAGE_MASK).to(mask_dtype)
    out = aggregate(loss, mask, "token-mean")
    torch.testing.assert_close(out, torch.tensor(7.0 / 3.0))
    out.backward()
    third = 1.0 / 3.0
    assert loss.grad is not None
    torch.testing.assert_close(loss.grad, torch.tensor([[third, third, 0.0], [third, 0.0, 0.0], [0.0] * 3]))


@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.bool])
def test_aggregate_seq_mean_token_mean_by_hand(mask_dtype: torch.dtype) -> None:
    # Row 0 mean (1 + 2) / 2 = 1.5; row 1 mean 4; row 2 has no tokens and is left out.
    # (1.5 + 4) / 2 = 2.75. Gradients: row 0 tokens 1/(2*2) = 0.25, row 1 token 1/(2*1) = 0.5.
    loss = torch.tensor(GARBAGE_LOSS, requires_grad=True)
    mask = torch.tensor(GARBAGE_MASK).to(mask_dtype)
    out = aggregate(loss, mask, "seq-mean-token-mean")
    torch.testing.assert_close(out, torch.tensor(2.75))
    out.backward()
    assert loss.grad is not None
    torch.testing.assert_close(loss.grad, torch.tensor([[0.25, 0.25, 0.0], [0.5, 0.0, 0.0], [0.0] * 3]))


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_aggregate_empty_mask_is_zero_with_graph(mode: str) -> None:
    loss = torch.tensor([[1.0, NAN], [INF, 2.0]], requires_grad=True)
    out = aggregate(loss, torch.zeros(2, 2), mode)  # type: ignore[arg-type]
    assert out.item() == 0.0
    assert out.requires_grad
    out.backward()
    assert loss.grad is not None
    torch.testing.assert_close(loss.grad, torch.zeros(2, 2))


def test_aggregate_errors() -> None:
    with pytest.raises(ValueError, match="mode must be one of"):
        aggregate(torch.zeros(2, 2), torch.ones(2, 2), "seq-sum")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"\[B, L\]"):
        aggregate(torch.zeros(2, 2), torch.ones(2, 3), "token-mean")


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_garbage_in_padding_does_not_reach_value_or_grad(mode: str) -> None:
    # End to end: padding of logp, logp_old holds inf / nan. Valid tokens (column 0):
    # row 0 ratio 1.1, A = +1 -> loss -1.1, grad -1.1; row 1 ratio 0.9, A = -1 -> loss 0.9, grad 0.9.
    # Both are single-token rows, so both modes give (-1.1 + 0.9) / 2 = -0.1 and halve the grads.
    logp = torch.cat([logs([[1.1], [0.9]]), torch.tensor([[NAN, INF], [-INF, NAN]])], dim=1)
    logp.requires_grad_()
    logp_old = torch.tensor([[0.0, -INF, NAN], [0.0, INF, -INF]])
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    terms = clipped_policy_loss(logp, logp_old, torch.tensor([1.0, -1.0]))
    out = aggregate(terms.loss, mask, mode)  # type: ignore[arg-type]
    torch.testing.assert_close(out, torch.tensor(-0.1))
    out.backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.55, 0.0, 0.0], [0.45, 0.0, 0.0]]))
