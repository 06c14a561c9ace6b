"""grpo_loss: the micro-batch share makes the sum of micro-batch gradients the whole batch's."""

from __future__ import annotations

import pytest
import torch

from rljob import AlgorithmSpec
from workers.algo.grpo import grpo_loss, loss_units, loss_units_tensor


def batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    b, length = 8, 6
    lengths = torch.tensor([6, 1, 4, 0, 3, 6, 2, 5])  # one empty sequence
    mask = (torch.arange(length)[None, :] < lengths[:, None]).double()
    logp_old = -torch.rand(b, length, generator=g, dtype=torch.float64) * 3
    return {
        "logp": (logp_old + 0.3 * torch.randn(b, length, generator=g, dtype=torch.float64)),
        "logp_old": logp_old,
        "logp_gen": logp_old + 0.2 * torch.randn(b, length, generator=g, dtype=torch.float64),
        "logp_ref": logp_old + 0.1 * torch.randn(b, length, generator=g, dtype=torch.float64),
        "advantages": torch.randn(b, generator=g, dtype=torch.float64),
        "mask": mask,
    }


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("mode", ["tis", "icepop", "seq-mask-tis"])
def test_micro_batches_add_up_to_the_whole_batch(seed: int, aggregation: str, mode: str) -> None:
    cfg = AlgorithmSpec.model_validate(
        {"loss_aggregation": aggregation, "kl": {"coef": 0.05}, "importance_sampling": {"mode": mode}}
    )
    data = batch(seed)
    total = loss_units(data["mask"], aggregation)
    # by hand: 27 valid tokens; 7 non-empty sequences
    assert total == {"token-mean": 27, "seq-mean-token-mean": 7}[aggregation]

    def run(rows: list[slice]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        logp = data["logp"].clone().requires_grad_(True)
        outs = []
        for r in rows:
            out = grpo_loss(
                logp[r], data["logp_old"][r], data["logp_gen"][r], data["advantages"][r],
                data["mask"][r], cfg, total, data["logp_ref"][r],
            )  # fmt: skip
            out.loss.backward()
            outs.append(torch.stack([out.loss.detach(), out.clipped_tokens, out.is_weight_sum, out.kl_sum]))
        assert logp.grad is not None
        return logp.grad, outs

    whole_grad, whole = run([slice(0, 8)])
    micro_grad, micro = run([slice(0, 3), slice(3, 5), slice(5, 8)])
    torch.testing.assert_close(micro_grad, whole_grad, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(sum(micro), whole[0], rtol=1e-12, atol=1e-15)


def test_units_as_a_tensor_match_the_count() -> None:
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    assert loss_units_tensor(mask, "token-mean").item() == 3.0
    assert loss_units_tensor(mask, "seq-mean-token-mean").item() == 2.0
