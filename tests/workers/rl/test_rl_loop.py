"""The RL loop (``rollout.max_staleness`` = k) in one process, without Ray: policy versions, the
staleness bound, the refusal of a batch older than the bound, k = 0 as the synchronous loop, and a
fault returned with the step as far as it got.

The expected order of the actors' calls and each batch's lag are worked out by hand from the
design (workers/rl/loop.py's docstring); versions are counted here from the weight syncs the
actors saw, not read from the loop.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rljob import JobSpec, parse_spec
from tests import helpers
from tests.helpers import ONE_DIGIT_SUMS
from tests.workers.inprocess_actors import Done, InProcessActors
from tests.workers.rl.test_rl_step import ByteSumTask, byte_sum_score
from workers.algo.mismatch import mismatch_metrics
from workers.engines.batching import concat_rollouts
from workers.engines.protocols import Rollouts, TrainStats
from workers.models.tokenizer import Tokenizer, build_tokenizer
from workers.rl.faults import ActorFault
from workers.rl.loop import RlLoop, StepOutcome, busy_overlap
from workers.rl.protocol import Generated, StepContext, WeightTransfer
from workers.rl.step import Batch, step_seed, sync_weights


def async_spec(k: int, steps: int = 3, generators: int = 1) -> JobSpec:
    return parse_spec(
        helpers.tiny_spec(
            task={"params": ONE_DIGIT_SUMS, "size": 50},
            rollout={"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 3, "max_staleness": k},
            resources={"generators": generators},
            optimizer={"lr": 1e-2, "micro_batch_size": 8},
            steps=steps,
        )
    )


class LoggingActors(InProcessActors):
    """In-process actors that log every call: ``gen<step>`` (the step read back from the seeds),
    ``train`` and ``sync``; each generation's version is the number of syncs before it, minus the
    first (which sends version 0)."""

    def __init__(self, spec: JobSpec, tok: Tokenizer) -> None:
        super().__init__(spec, tok)
        self.events: list[str] = []
        self.syncs = 0
        self.version_of: dict[int, int] = {}  # step -> version its (last) batch was generated with
        self.generated: dict[int, list[Generated]] = {}
        self.trained: list[Rollouts] = []
        seeds = {step_seed(spec, s, 0): s for s in range(1, spec.steps + 1)}
        self.step_of_seed = seeds

    def start_generate(
        self, chunks: list[list[list[int]]], seeds: list[int], temperature: float | None = None
    ) -> Done:
        step = self.step_of_seed[seeds[0]]
        self.events.append(f"gen{step}")
        self.version_of[step] = self.syncs - 1
        out = super().start_generate(chunks, seeds, temperature)
        self.generated[step] = out.result()
        return out

    def train(self, parts: list[Rollouts], rewards: list[torch.Tensor]) -> list[TrainStats]:
        self.events.append("train")
        self.trained.append(parts[0])
        return super().train(parts, rewards)

    def send_and_receive_weights(self) -> WeightTransfer:
        self.events.append("sync")
        self.syncs += 1
        return super().send_and_receive_weights()


def line_of(outcome: StepOutcome) -> dict[str, float]:
    """The line of a step that ended without a fault."""
    assert outcome.fault is None and outcome.row is not None, outcome.fault
    return dict(outcome.row)  # type: ignore[arg-type]


def setup(k: int, steps: int = 3) -> tuple[JobSpec, ByteSumTask, Tokenizer, LoggingActors]:
    spec = async_spec(k, steps)
    task, tok = ByteSumTask(spec.task, spec.validation.size), build_tokenizer(spec)
    actors = LoggingActors(spec, tok)
    sync_weights(actors)  # the generators start from version 0, as in the driver
    return spec, task, tok, actors


@pytest.mark.parametrize(
    ("k", "events", "lags"),
    [
        # k = 1: batch s+1 is asked for (with the weights of s-1) before step s trains
        (1, "sync gen1 gen2 train sync gen3 train sync train sync", [0, 1, 1]),
        # k = 2: three batches at version 0 before the first training; batch 3 trained from v2
        (2, "sync gen1 gen2 gen3 train sync train sync train sync", [0, 1, 2]),
    ],
)
def test_versions_and_the_bound(k: int, events: str, lags: list[int]) -> None:
    spec, task, tok, actors = setup(k)
    loop = RlLoop(StepContext(spec, task, tok, actors), 1)
    rows = [line_of(loop.step(s)) for s in (1, 2, 3)]
    assert " ".join(actors.events) == events
    for s, row in enumerate(rows, start=1):
        lag = (s - 1) - actors.version_of[s]  # step s trains from v_{s-1}
        assert lag == lags[s - 1] <= k
        assert row["staleness/mean"] == row["staleness/max"] == lag
        assert row["staleness/dropped_batches"] == 0.0
        assert all(math.isfinite(float(v)) for v in row.values())
        # the trainer trained on exactly the rollouts generated for step s
        batch = concat_rollouts([o.rollouts for o in actors.generated[s]], tok.pad_id)
        assert torch.equal(actors.trained[s - 1].response_ids, batch.response_ids)
        rewards = [
            byte_sum_score(tok.decode(r[: int(mk.sum())].tolist()))
            for r, mk in zip(batch.response_ids, batch.response_mask, strict=True)
        ]
        assert row["reward/mean"] == pytest.approx(sum(rewards) / len(rewards), abs=1e-6)
        # FP8 alone (lag 0) is reported apart, on the steps that have lag-0 sequences only
        assert ("mismatch_lag0/num_tokens" in row) == (lag == 0)
    assert rows[0]["mismatch_lag0/num_tokens"] == rows[0]["mismatch/num_tokens"] > 0
    assert rows[0]["mismatch_lag0/gen_kl_error"] == rows[0]["mismatch/gen_kl_error"]


def test_a_batch_older_than_the_bound_is_never_trained_on() -> None:
    """A hand-built queue: at step 3 (weights v2) the queue holds a batch of version 0 (lag 2 > k = 1):
    the trainer refuses it, counts it, and trains on the batch regenerated with v2."""
    spec, task, tok, actors = setup(1)
    for _ in range(2):  # two more syncs: the generators hold v2, as after step 2
        sync_weights(actors)
    loop = RlLoop(StepContext(spec, task, tok, actors), 3)
    stale_rollouts = actors.generators[0].generate([tok.encode("1+2=")] * 8, 3, 1.0, 1.0, 7)
    stale_rollouts.response_ids.fill_(tok.eos_id)  # a pattern no sampled batch holds
    stale = Generated(stale_rollouts, 0, 0, 0.0, 0.0)
    loop.queue.append(Batch(3, 0, [], Done([stale])))
    loop.next_step = 4  # the stale batch stands for step 3
    row = line_of(loop.step(3))
    assert row["staleness/dropped_batches"] == 1.0 and loop.dropped == 1
    assert row["staleness/max"] == 0.0  # regenerated with the newest weights: lag 0
    assert actors.events[-3:] == ["gen3", "train", "sync"] and actors.version_of[3] == 2
    (trained,) = actors.trained
    assert not torch.equal(trained.response_ids[:, :1], stale_rollouts.response_ids[:, :1])
    regenerated = concat_rollouts([o.rollouts for o in actors.generated[3]], tok.pad_id)
    assert torch.equal(trained.response_ids, regenerated.response_ids)


def test_max_staleness_0_is_todays_loop(tmp_path: Path) -> None:
    """k = 0 of the one loop: its rows hold the synchronous keys only, and its values are bit for
    bit those of the synchronous loop written out here (generate, score, train, sync) on a second
    pair of actors from the same seed."""
    spec = async_spec(0)
    task, tok = ByteSumTask(spec.task, spec.validation.size), build_tokenizer(spec)
    a, b = InProcessActors(spec, tok), InProcessActors(spec, tok)
    sync_weights(a)
    b.send_and_receive_weights()
    isc = spec.algorithm.importance_sampling
    r = spec.rollout
    loop = RlLoop(StepContext(spec, task, tok, a), 1)
    for step in (1, 2, 3):
        row = line_of(loop.step(step))
        assert not any(k.startswith(("staleness/", "mismatch_lag0/")) or k == "timing/overlap_s" for k in row)
        problems = [p for p in task.sample(step, r.prompts_per_step, r.seed) for _ in range(r.group_size)]
        prompts = [tok.encode(task.prompt(p)) for p in problems]
        batch = concat_rollouts(
            [o.rollouts for o in b.generate([prompts], [step_seed(spec, step, 0)])], tok.pad_id
        )
        rewards = torch.tensor(
            [
                byte_sum_score(tok.decode(x[: int(mk.sum())].tolist()))
                for x, mk in zip(batch.response_ids, batch.response_mask, strict=True)
            ]
        )
        (res,) = b.train([batch], [rewards])
        b.send_and_receive_weights()
        expected = {
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std()),
            **mismatch_metrics(
                res.logprobs_old, batch.logprobs, batch.response_mask, isc.low, isc.high, isc.mode
            ),
            **{k: v for k, v in res.stats.items() if k != "train/tokens"},
        }
        assert {k: row[k] for k in expected} == expected, step


def test_busy_overlap_is_the_union_of_the_generators_spans_within_training() -> None:
    def gen(start: float, end: float) -> Generated:
        return Generated(Rollouts(*[torch.zeros(1, 1)] * 5), 0, 0, start, end)

    # training 10..20; generators busy 8..12 and 11..15 (union 10..15 inside), and 19..25 (19..20)
    assert busy_overlap((10.0, 20.0), [gen(11, 15), gen(8, 12), gen(19, 25)]) == pytest.approx(6.0)
    assert busy_overlap((10.0, 20.0), [gen(0, 10), gen(20, 30)]) == 0.0


def test_k_0_asks_for_each_batch_only_after_the_last_sync() -> None:
    """Synchronous RL is k = 0 of the same loop: worked by hand, batch s is asked for once v_{s-1}
    is synced, so generation never overlaps training and every batch is trained at lag 0."""
    spec, task, tok, actors = setup(0)
    loop = RlLoop(StepContext(spec, task, tok, actors), 1)
    for s in (1, 2, 3):
        line_of(loop.step(s))
    assert " ".join(actors.events) == "sync gen1 train sync gen2 train sync gen3 train sync"
    assert [actors.version_of[s] for s in (1, 2, 3)] == [0, 1, 2]


class FailingSync(LoggingActors):
    """Actors whose generator 0 is lost in the weight sync numbered ``bad`` (the first is 0)."""

    bad = 1

    def send_and_receive_weights(self) -> WeightTransfer:
        if self.syncs == self.bad:
            self.syncs += 1
            raise ActorFault("generator", 0, "died", "receive_weights")
        return super().send_and_receive_weights()


class FailingGenerate(LoggingActors):
    def start_generate(
        self, chunks: list[list[list[int]]], seeds: list[int], temperature: float | None = None
    ) -> Done:
        raise ActorFault("generator", 0, "died", "generate")


@pytest.mark.parametrize("k", [0, 1])
def test_a_fault_comes_back_with_the_step_as_far_as_it_got(k: int) -> None:
    """A generator lost in the sync after step 1's update: the outcome holds the fault and step 1's
    trained line (its reward, no sync keys), so recovery does not train it twice. Lost while
    generating: the fault, and no line (the step is not trained)."""
    spec = async_spec(k)
    task, tok = ByteSumTask(spec.task, spec.validation.size), build_tokenizer(spec)
    actors = FailingSync(spec, tok)
    sync_weights(actors)  # sync 0 (version 0)
    out = RlLoop(StepContext(spec, task, tok, actors), 1).step(1)
    assert isinstance(out.fault, ActorFault) and out.fault.call == "receive_weights" and out.step == 1
    assert out.row is not None and actors.events.count("train") == 1
    row: dict[str, float] = dict(out.row)  # type: ignore[arg-type]
    assert 0.0 <= row["reward/mean"] <= 1.0 and "weight_sync/bytes" not in row
    lost = FailingGenerate(spec, tok)
    sync_weights(lost)
    out = RlLoop(StepContext(spec, task, tok, lost), 1).step(1)
    assert out == StepOutcome(1, None, out.fault) and isinstance(out.fault, ActorFault)
    assert "train" not in lost.events
