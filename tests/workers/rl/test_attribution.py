"""Per-layer attribution of the mismatch (workers/rl/attribution.py, workers/engines/layer_diff.py).

References: hand-worked traces and batches; on real engines, ``precision.exact`` (where the two
engines agree bit for bit, so every contribution must be exactly 0) and a float64 recomputation
of the contributions with numpy from the engines' own traces."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rljob import JobSpec, parse_spec
from tests import helpers
from tests.helpers import ONE_DIGIT_SUMS, TWO_LAYER_MODEL
from tests.workers.inprocess_actors import InProcessActors
from workers.engines.layer_diff import layer_contributions, relative_divergence
from workers.engines.protocols import Rollouts
from workers.models.tokenizer import build_tokenizer
from workers.rl.attribution import attribute, probes_of, traceable, worst_layers
from workers.rl.loop import RlLoop
from workers.rl.protocol import StepContext
from workers.rl.step import sync_weights
from workers.tasks import Task


def t(*values: float) -> torch.Tensor:
    return torch.tensor([values])


def test_contributions_are_the_growth_of_the_relative_divergence_layer_by_layer() -> None:
    # by hand: embeddings agree (r = 0); layer 0: |(0, 0.5)| / |(3, 4)| = 0.5 / 5 = 0.1;
    # layer 1: |(0, 3)| / |(6, 8)| = 3 / 10 = 0.3; layer 2: |(0, 1)| / |(6, 8)| = 0.1
    trainer = {
        "model.embed_tokens": t(1.0, 2.0),
        "model.layers.0.self_attn": t(9.0, 9.0),  # a submodule: not a decoder layer's output
        "model.layers.0": t(3.0, 4.0),
        "model.layers.1": t(6.0, 8.0),
        "model.layers.2": t(6.0, 8.0),
        "model.norm": t(1.0, 1.0),
    }
    generator = {
        "model.embed_tokens": t(1.0, 2.0),
        "model.layers.0.self_attn": t(0.0, 0.0),
        "model.layers.0": t(3.0, 4.5),
        "model.layers.1": t(6.0, 11.0),
        "model.layers.2": t(6.0, 9.0),
        "model.norm": t(5.0, 1.0),
    }
    got = layer_contributions(generator, trainer)
    assert got == pytest.approx([0.1, 0.2, -0.2], abs=1e-12)  # layer 2 brings them closer
    assert relative_divergence(t(0.0, 0.0), t(0.0, 0.0)) == 0.0
    assert worst_layers(got, 2) == [1, 0]
    # a layer missing from one trace ends the count there (no layer is skipped silently)
    del trainer["model.layers.1"]
    assert layer_contributions(generator, trainer) == pytest.approx([0.1], abs=1e-12)


def test_probes_are_the_tokens_that_differ_most() -> None:
    # 3 rows, responses of 3 tokens; row 1's last token is padding, so its 5.0 there does not count
    batch = Rollouts(
        prompt_ids=torch.tensor([[0, 7, 8], [9, 9, 9], [0, 0, 5]]),
        prompt_mask=torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1]]),
        response_ids=torch.tensor([[1, 2, 3], [4, 5, 0], [6, 7, 8]]),
        response_mask=torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]),
        logprobs=torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]]),
    )
    trainer = torch.tensor([[-1.1, -1.3, -1.0], [-1.0, -1.2, 4.0], [-1.0, -1.0, -1.4]])
    probes = probes_of(batch, trainer, 2)
    # largest |diff| per row: row 0 0.3 at 1, row 1 0.2 at 1, row 2 0.4 at 2 -> rows 2 and 0
    assert [p.logprob_diff for p in probes] == pytest.approx([0.4, 0.3])
    assert probes[0].prompt.tolist() == [5] and probes[0].response.tolist() == [6, 7, 8]
    assert probes[1].prompt.tolist() == [7, 8] and probes[1].response.tolist() == [1, 2]
    assert len(probes_of(batch, trainer, 10)) == 3


def two_layer_spec(recipe: str, **precision: object) -> JobSpec:
    return parse_spec(
        helpers.tiny_spec(
            model={"tiny": TWO_LAYER_MODEL, "init_seed": 5},
            task={"params": ONE_DIGIT_SUMS, "size": 50},
            rollout={"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4},
            precision={"recipe": recipe, **precision},
            steps=1,
        )
    )


def one_step(spec: JobSpec) -> tuple[InProcessActors, list[float], tuple]:  # type: ignore[type-arg]
    tok = build_tokenizer(spec)
    actors = InProcessActors(spec, tok)
    sync_weights(actors)
    outcome = RlLoop(StepContext(spec, Task.for_job(spec, tok), tok, actors), 1).step(1)
    assert outcome.fault is None and len(outcome.probes) == spec.precision.mismatch_slo.attribution_sequences
    return actors, attribute(actors, outcome.probes), outcome.probes


def test_under_exact_mode_every_layer_contributes_exactly_nothing() -> None:
    spec = two_layer_spec("bf16", exact=True)
    assert traceable(spec)
    _, contributions, _ = one_step(spec)
    assert contributions == [0.0, 0.0]


def test_fp8_gen_contributions_match_a_float64_recomputation() -> None:
    spec = two_layer_spec("fp8-gen", fp8_kv_cache=True)
    actors, contributions, probes = one_step(spec)
    assert len(contributions) == 2
    want = np.zeros(2)
    for probe in probes:
        gen, train = actors.trace_token(0, probe.prompt, probe.response)
        names = ("model.embed_tokens", "model.layers.0", "model.layers.1")
        a = [gen[n].double().numpy() for n in names]
        b = [train[n].double().numpy() for n in names]
        r = [np.linalg.norm(x - y) / np.linalg.norm(y) for x, y in zip(a, b, strict=True)]
        want += np.diff(r) / len(probes)
    assert contributions == pytest.approx(want.tolist(), rel=1e-9, abs=1e-15)
    # FP8 weights and an FP8 KV cache against BF16: the last hidden state differs
    assert sum(contributions) > 0 and not any(math.isnan(c) for c in contributions)
