"""The statistics of one RL update, as every trainer engine reports them: sums kept on the device
through the step, reduced over the trainers, then read back once (:func:`train_stats`)."""

from __future__ import annotations

import torch

from rljob import metrics as m

# Step statistics every trainer sums over the trainers on the device (plus the maxima ``is_max``
# and ``grad_norm``), then reads back once: :func:`train_stats`.
STEP_SUMS = ("loss", "clipped", "is_sum", "kl", "tokens", "adv_abs_sum", "sequences")


def train_stats(totals: dict[str, torch.Tensor]) -> m.TrainMetrics:
    """The ``train/*`` and ``is/*`` statistics of one RL step from its totals (0-d tensors on the
    device, already reduced over the trainers), read back in one transfer."""
    values = dict(zip(totals, torch.stack(list(totals.values())).tolist(), strict=True))
    tokens = max(values["tokens"], 1.0)
    return {
        m.TRAIN_LOSS: values["loss"],
        m.TRAIN_GRAD_NORM: values["grad_norm"],
        m.TRAIN_CLIP_FRACTION: values["clipped"] / tokens,
        m.TRAIN_KL: values["kl"] / tokens,
        m.IS_WEIGHT_MEAN: values["is_sum"] / tokens,
        m.IS_WEIGHT_MAX: values["is_max"],
        m.TRAIN_ADVANTAGE_ABS_MEAN: values["adv_abs_sum"] / max(values["sequences"], 1.0),
        m.TRAIN_TOKENS: values["tokens"],
    }
