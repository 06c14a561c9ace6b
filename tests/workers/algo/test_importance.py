"""importance_weights: every mode on hand-worked ratios, plus a float64 loop reference."""

from __future__ import annotations

import math

import pytest
import torch

from workers.algo import IS_MODES, IsCorrection, importance_weights

NAN, INF = float("nan"), float("inf")

Grid = list[list[float]]


def make_logps(ratios: list[list[float]], mask: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp_trainer_old, logp_gen) with exp(difference) = ratio on valid tokens, garbage elsewhere."""
    logp_gen = torch.full((len(ratios), len(ratios[0])), -1.0, dtype=torch.float64)
    logp_old = logp_gen + torch.tensor(ratios, dtype=torch.float64).log()
    padding = torch.tensor(mask) == 0
    logp_gen[padding] = -INF
    logp_old[padding] = NAN
    return logp_old.float(), logp_gen.float()


# Example A, 2 x 3, bounds [0.5, 2]: ratios w = [[4, 1, 0.25], [1.5, 3, (padding)]].
# Sequence ratios s = 4 * 1 * 0.25 = 1 and 1.5 * 3 = 4.5; geometric means g = 1 and sqrt(4.5) ~ 2.12.
A_RATIOS: Grid = [[4.0, 1.0, 0.25], [1.5, 3.0, 1.0]]
A_MASK: Grid = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
A_RAW: Grid = [[4.0, 1.0, 0.25], [1.5, 3.0, 0.0]]
A_EXPECTED: dict[str, tuple[Grid, Grid]] = {
    # mode: (weights, out_of_bounds)
    # none: weight 1 on valid tokens; 4, 0.25 and 3 are outside [0.5, 2].
    "none": ([[1, 1, 1], [1, 1, 0]], [[1, 0, 1], [0, 1, 0]]),
    # tis: min(w, 2); only 4 and 3 exceed high.
    "tis": ([[2, 1, 0.25], [1.5, 2, 0]], [[1, 0, 0], [0, 1, 0]]),
    # icepop: keep w inside [0.5, 2], zero outside.
    "icepop": ([[0, 1, 0], [1.5, 0, 0]], [[1, 0, 1], [0, 1, 0]]),
    # seq-tis: min(s, 2) -> row 0 gets 1, row 1 gets 2 (and counts as out of bounds).
    "seq-tis": ([[1, 1, 1], [2, 2, 0]], [[0, 0, 0], [1, 1, 0]]),
    # seq-mask-tis (NeMo RL): g = 1 kept, its tokens keep their raw w; g ~ 2.12 > 2 drops row 1.
    "seq-mask-tis": ([[4, 1, 0.25], [0, 0, 0]], [[0, 0, 0], [1, 1, 0]]),
    # geo-mask: g = 1 kept (weight 1); g ~ 2.12 > 2 dropped.
    "geo-mask": ([[1, 1, 1], [0, 0, 0]], [[0, 0, 0], [1, 1, 0]]),
}

# Example B, 3 x 4, bounds [0.5, 2], told apart by the sequence modes:
#   row 0: w = 1.5 x 4, s = 1.5^4 = 5.0625 > 2, g = 1.5 inside;
#   row 1: w = [0.25, 0.75, pad, pad], s = 0.1875 < 0.5, g = sqrt(0.1875) ~ 0.433 < 0.5;
#   row 2: all padding.
B_RATIOS: Grid = [[1.5] * 4, [0.25, 0.75, 1.0, 1.0], [1.0] * 4]
B_MASK: Grid = [[1.0] * 4, [1.0, 1.0, 0.0, 0.0], [0.0] * 4]
B_RAW: Grid = [[1.5] * 4, [0.25, 0.75, 0, 0], [0] * 4]
B_EXPECTED: dict[str, tuple[Grid, Grid]] = {
    "none": ([[1] * 4, [1, 1, 0, 0], [0] * 4], [[0] * 4, [1, 0, 0, 0], [0] * 4]),
    "tis": ([[1.5] * 4, [0.25, 0.75, 0, 0], [0] * 4], [[0] * 4] * 3),
    "icepop": ([[1.5] * 4, [0, 0.75, 0, 0], [0] * 4], [[0] * 4, [1, 0, 0, 0], [0] * 4]),
    # seq-tis truncates only from above: row 0 -> 2 (oob), row 1 keeps s = 0.1875 (not oob).
    "seq-tis": ([[2] * 4, [0.1875, 0.1875, 0, 0], [0] * 4], [[1] * 4, [0] * 4, [0] * 4]),
    # seq-mask-tis filters on g, like geo-mask: row 0 (g = 1.5) keeps its raw w = 1.5 per token,
    # row 1 (g ~ 0.433) is dropped; the sequence product s plays no part.
    "seq-mask-tis": ([[1.5] * 4, [0] * 4, [0] * 4], [[0] * 4, [1, 1, 0, 0], [0] * 4]),
    # geo-mask keeps row 0 (g = 1.5) with weight 1, drops row 1 (g ~ 0.433).
    "geo-mask": ([[1] * 4, [0] * 4, [0] * 4], [[0] * 4, [1, 1, 0, 0], [0] * 4]),
}


def check(
    out: IsCorrection, raw: list[list[float]], weights: list[list[float]], oob: list[list[float]]
) -> None:
    torch.testing.assert_close(out.raw, torch.tensor(raw, dtype=torch.float32))
    torch.testing.assert_close(out.weights, torch.tensor(weights, dtype=torch.float32))
    torch.testing.assert_close(out.out_of_bounds, torch.tensor(oob, dtype=torch.float32))


@pytest.mark.parametrize("mode", IS_MODES)
@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.bool])
def test_example_a_by_hand(mode: str, mask_dtype: torch.dtype) -> None:
    logp_old, logp_gen = make_logps(A_RATIOS, A_MASK)
    out = importance_weights(logp_old, logp_gen, torch.tensor(A_MASK).to(mask_dtype), mode)
    check(out, A_RAW, *A_EXPECTED[mode])


@pytest.mark.parametrize("mode", IS_MODES)
def test_example_b_by_hand(mode: str) -> None:
    logp_old, logp_gen = make_logps(B_RATIOS, B_MASK)
    out = importance_weights(logp_old, logp_gen, torch.tensor(B_MASK), mode)
    check(out, B_RAW, *B_EXPECTED[mode])


@pytest.mark.parametrize("mode", IS_MODES)
def test_weights_are_detached(mode: str) -> None:
    logp_old, logp_gen = make_logps(A_RATIOS, A_MASK)
    logp_old.requires_grad_()
    logp_gen.requires_grad_()
    out = importance_weights(logp_old, logp_gen, torch.tensor(A_MASK), mode)
    assert not any(t.requires_grad for t in out)


def test_log_ratios_clamped() -> None:
    # Token: log w = 100 -> clamped to 20, raw = e^20, tis weight = high = 2.
    # Sequence: log w = 15 + 15 = 30 -> clamped to 20, seq-tis weight min(e^20, 2) = 2.
    e20 = math.exp(20.0)
    tis = importance_weights(torch.tensor([[100.0]]), torch.tensor([[0.0]]), torch.ones(1, 1), "tis")
    torch.testing.assert_close(tis.raw, torch.tensor([[e20]]))
    torch.testing.assert_close(tis.weights, torch.tensor([[2.0]]))
    seq = importance_weights(torch.tensor([[15.0, 15.0]]), torch.zeros(1, 2), torch.ones(1, 2), "seq-tis")
    torch.testing.assert_close(seq.weights, torch.tensor([[2.0, 2.0]]))
    torch.testing.assert_close(seq.out_of_bounds, torch.tensor([[1.0, 1.0]]))


def reference(
    logp_old: torch.Tensor, logp_gen: torch.Tensor, mask: torch.Tensor, mode: str, low: float, high: float
) -> tuple[Grid, Grid]:
    """Straight float64 loops over the definitions in the brief."""
    weights: Grid = []
    oob: Grid = []
    for a_row, b_row, m_row in zip(logp_old.tolist(), logp_gen.tolist(), mask.tolist(), strict=True):
        logw = [
            max(-20.0, min(20.0, a - b)) if m else 0.0 for a, b, m in zip(a_row, b_row, m_row, strict=True)
        ]
        n = sum(1 for m in m_row if m)
        s = math.exp(max(-20.0, min(20.0, sum(logw))))
        g = math.exp(sum(logw) / max(n, 1))
        w_row: list[float] = []
        o_row: list[float] = []
        for lw, m in zip(logw, m_row, strict=True):
            w = math.exp(lw)
            if not m:
                w_row.append(0.0)
                o_row.append(0.0)
                continue
            inside = low <= w <= high
            if mode == "none":
                w_row.append(1.0)
                o_row.append(float(not inside))
            elif mode == "tis":
                w_row.append(min(w, high))
                o_row.append(float(w > high))
            elif mode == "icepop":
                w_row.append(w if inside else 0.0)
                o_row.append(float(not inside))
            elif mode == "seq-tis":
                w_row.append(min(s, high))
                o_row.append(float(s > high))
            elif mode == "seq-mask-tis":
                w_row.append(w if low <= g <= high else 0.0)
                o_row.append(float(not low <= g <= high))
            else:
                w_row.append(float(low <= g <= high))
                o_row.append(float(not low <= g <= high))
        weights.append(w_row)
        oob.append(o_row)
    return weights, oob


@pytest.mark.parametrize("mode", IS_MODES)
def test_matches_float64_loop(mode: str, seed: int) -> None:
    # Short rows and small log-ratios, so that sequence ratios land on both sides of the bounds.
    logp_gen = -torch.rand(16, 4) * 3
    logp_old = logp_gen + torch.randn(16, 4) * 0.5
    mask = (torch.rand(16, 4) < 0.8).float()
    out = importance_weights(logp_old, logp_gen, mask, mode, low=0.6, high=1.7)
    weights, oob = reference(logp_old, logp_gen, mask, mode, low=0.6, high=1.7)
    torch.testing.assert_close(out.weights, torch.tensor(weights), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.out_of_bounds, torch.tensor(oob))


@pytest.mark.parametrize(
    ("mode", "low", "high", "match"),
    [
        ("seq-is", 0.5, 2.0, "mode must be one of"),
        ("tis", 2.0, 0.5, "low <= high"),
        ("icepop", -0.1, 2.0, "0 <= low"),
    ],
)
def test_errors(mode: str, low: float, high: float, match: str) -> None:
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=match) as info:
        importance_weights(x, x, torch.ones(1, 2), mode, low=low, high=high)
    if "mode" in match:
        assert all(m in str(info.value) for m in IS_MODES)
