"""The audit's input-activation statistics (workers/fp8/input_stats.py) on inputs built by hand,
so that amax, the nearest-rank 99.9th percentile and the outlier ratio are known in closed form."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from torch import nn

from tests.workers.fp8.models import tiny_model
from workers.fp8 import convert_model
from workers.fp8.input_stats import input_stats, measure_inputs, nearest_rank


class OneLinear(nn.Module):
    """Called like a causal LM, but ``input_ids`` are the linear's input activations [B, L, C]."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.proj = nn.Linear(c, 2, bias=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.proj(input_ids)


def hand_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """2000 real tokens as 2 sequences of 1000, each right-padded by one token; 3 channels.

    channel 0: the tokens take the values 1, 2, ..., 2000 (in order over both sequences)
    channel 1: 1.0 everywhere except token 777, which is 50.0
    channel 2: 0.0 everywhere
    the pad rows hold 1e6 in every channel: measured, they would win every statistic.
    """
    x = torch.zeros(2000, 3)
    x[:, 0] = torch.arange(1, 2001, dtype=torch.float32)
    x[:, 1] = 1.0
    x[777, 1] = 50.0
    pad = torch.full((1, 3), 1e6)
    seqs = [torch.cat([x[:1000], pad]), torch.cat([x[1000:], pad])]
    mask = torch.ones(2, 1001, dtype=torch.long)
    mask[:, 1000] = 0
    return torch.stack(seqs), mask  # [2, 1001, 3], [2, 1001]


def test_nearest_rank_is_exact_rational_arithmetic() -> None:
    # rank = ceil(0.999 n): n = 1000 -> 999 (0.999 * 1000 in binary floating point is
    # 999.0000000000001, whose ceiling would be 1000); n = 2000 -> 1998; below 1000 tokens the
    # rank is n (the percentile is the max); n = 1 -> 1
    assert nearest_rank(1000) == 999
    assert nearest_rank(2000) == 1998
    assert nearest_rank(999) == 999 and nearest_rank(1) == 1
    assert nearest_rank(10, Fraction(50)) == 5
    with pytest.raises(ValueError, match="at least one"):
        nearest_rank(0)


def test_statistics_of_a_hand_built_batch() -> None:
    # T = 2000 real tokens, k = ceil(0.999 * 2000) = 1998.
    # channel 0: sorted values 1..2000, the 1998th is 1998: ratio 2000 / 1998 = 1.001
    # channel 1: 1999 ones then 50: the 1998th is 1.0: ratio 50 / 1 = 50
    # channel 2: all zeros: ratio 1 by definition
    # amax = 2000 (channel 0); the largest ratio is channel 1's, 50; the pads (1e6) are left out
    x, mask = hand_batch()
    stats = measure_inputs(OneLinear(3), x, mask)
    s = stats["proj"]
    assert s.tokens == 2000
    assert s.amax == 2000.0
    assert s.outlier_ratio == 50.0 and s.outlier_channel == 1
    rows = x.reshape(-1, 3)[mask.reshape(-1).bool()]
    direct = input_stats(rows[:, [0, 2]])  # without channel 1: channel 0 leads with 2000 / 1998
    assert direct.outlier_channel == 0
    assert direct.outlier_ratio == pytest.approx(2000 / 1998, rel=1e-6)


def test_without_a_mask_the_pads_count() -> None:
    # all 2002 rows: k = ceil(0.999 * 2002) = 2000; channel 2 is 0 except two pads of 1e6, so its
    # 2000th value is 0 and its max 1e6: an infinite ratio
    x, _ = hand_batch()
    s = measure_inputs(OneLinear(3), x)["proj"]
    assert s.tokens == 2002 and s.amax == 1e6
    assert s.outlier_ratio == float("inf") and s.outlier_channel == 2


def test_the_audit_carries_weight_and_input_statistics() -> None:
    model = tiny_model("llama", layers=2, hidden=64)
    q = model.model.layers[1].self_attn.q_proj
    with torch.no_grad():
        q.weight.clamp_(-1.0, 1.0)
        q.weight[3, 5] = -7.5  # its max |W| by construction
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (4, 300))  # 1200 tokens
    mask = torch.ones(4, 300, dtype=torch.long)
    # the first layer's q_proj input, computed here by the model's own modules, no hook:
    # the input norm of the embeddings
    with torch.no_grad():
        x0 = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids)).reshape(-1, 64)
    expected = input_stats(x0)
    audit = convert_model(model, "fp8-e2e")
    rows = {r.name: r for r in audit.rows}
    assert rows["model.layers.1.self_attn.q_proj"].weight_amax == 7.5
    assert rows["model.embed_tokens"].weight_amax is None  # not a linear
    assert rows["lm_head"].weight_amax is not None  # a linear kept high precision still has one
    audit = audit.with_inputs(measure_inputs(model, ids, mask), "4 prompts, 1200 tokens")
    rows = {r.name: r for r in audit.rows}
    q0 = rows["model.layers.0.self_attn.q_proj"]
    assert q0.input_amax == pytest.approx(expected.amax, rel=1e-6)
    assert q0.outlier_ratio == pytest.approx(expected.outlier_ratio, rel=1e-6)
    assert q0.outlier_channel == expected.outlier_channel
    for sibling in ("k_proj", "v_proj"):  # one input, one measurement
        assert rows[f"model.layers.0.self_attn.{sibling}"].outlier_ratio == q0.outlier_ratio
    assert all(r.outlier_ratio is not None for r in rows.values() if r.kind in ("linear", "lm_head"))
    top = [float(r.outlier_ratio or 0.0) for r in audit.top_outliers(3)]
    measured = [float(r.outlier_ratio or 0.0) for r in rows.values() if r.outlier_ratio is not None]
    assert top == sorted(measured, reverse=True)[:3]
    table = audit.format()
    assert "outlier@ch" in table and "input statistics on 4 prompts, 1200 tokens" in table
    assert audit.to_dict()["calibration"] == "4 prompts, 1200 tokens"
