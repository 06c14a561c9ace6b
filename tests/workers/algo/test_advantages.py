"""grpo_advantages against hand-worked groups and a float64 loop reference."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from workers.algo import grpo_advantages


def test_two_groups_of_two_by_hand() -> None:
    # Groups [1, 0] and [0, 1]: mean 0.5, centred [0.5, -0.5] and [-0.5, 0.5].
    # Unbiased std of [1, 0]: var = (0.25 + 0.25) / (2 - 1) = 0.5, std = sqrt(0.5).
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    torch.testing.assert_close(grpo_advantages(rewards, 2), torch.tensor([a, -a, -a, a]))
    torch.testing.assert_close(
        grpo_advantages(rewards, 2, normalize="none"), torch.tensor([0.5, -0.5, -0.5, 0.5])
    )


def test_group_of_three_by_hand() -> None:
    # [3, 0, 0]: mean 1, centred [2, -1, -1]; var = (4 + 1 + 1) / 2 = 3, std = sqrt(3).
    # Second group [2, 2, 2]: all equal, so 0 / (0 + eps) = 0.
    rewards = torch.tensor([3.0, 0.0, 0.0, 2.0, 2.0, 2.0])
    s = math.sqrt(3.0) + 1e-6
    expected = torch.tensor([2 / s, -1 / s, -1 / s, 0.0, 0.0, 0.0])
    torch.testing.assert_close(grpo_advantages(rewards, 3), expected)


def test_group_size_one_gives_zeros() -> None:
    # A group of one is its own baseline; the unbiased std (0/0) must not turn into nan.
    out = grpo_advantages(torch.tensor([1.0, 0.0, 5.0]), 1)
    torch.testing.assert_close(out, torch.zeros(3))


def test_integer_and_bool_rewards_become_float() -> None:
    # [True, False] is [1, 0]: centred [0.5, -0.5].
    out = grpo_advantages(torch.tensor([True, False]), 2, normalize="none")
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor([0.5, -0.5]))


def test_matches_float64_loop(seed: int) -> None:
    group_size, groups = 5, 7
    rewards = torch.randn(groups * group_size, dtype=torch.float64)
    out = grpo_advantages(rewards, group_size, eps=1e-6)
    values = rewards.tolist()
    expected = []
    for g in range(groups):
        chunk = values[g * group_size : (g + 1) * group_size]
        mean = statistics.fmean(chunk)
        std = statistics.stdev(chunk)  # unbiased, n - 1
        expected += [(r - mean) / (std + 1e-6) for r in chunk]
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float64))


@pytest.mark.parametrize(
    ("n", "group_size", "normalize", "match"),
    [
        (5, 2, "std", "multiple of group_size"),
        (4, 0, "std", "group_size must be >= 1"),
        (4, -1, "std", "group_size must be >= 1"),
        (4, 2, "mean", "normalize must be one of"),
    ],
)
def test_errors(n: int, group_size: int, normalize: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        grpo_advantages(torch.zeros(n), group_size, normalize=normalize)  # type: ignore[arg-type]


def test_rejects_2d_rewards() -> None:
    with pytest.raises(ValueError, match="1-D"):
        grpo_advantages(torch.zeros(2, 2), 2)
