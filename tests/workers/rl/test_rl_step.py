"""The RL step without Ray: :mod:`workers.rl.step` over :class:`InProcessActors` (a native trainer
and two native generators in this process) runs the warm-up, a weight sync, a whole step, a
validation and a checkpoint as the driver does; the Ray path keeps its own tests (test_driver).

Expected values come from outside the step: rewards from the test's own scoring of the responses
the generators returned, decoded here; byte counts from the model's parameter shapes; weights
from the two engines' own tensors.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rljob import JobSpec, parse_spec
from rljob.metrics import StepMetrics
from tests import helpers
from tests.helpers import ONE_DIGIT_SUMS
from tests.workers.inprocess_actors import Done, InProcessActors
from workers.engines.batching import concat_rollouts
from workers.engines.protocols import Rollouts
from workers.models import checkpoint
from workers.models.tokenizer import ByteTokenizer, Tokenizer, build_tokenizer
from workers.rl.loop import RlLoop
from workers.rl.protocol import Generated, StepContext
from workers.rl.step import save, sync_weights, truncated_fraction, unreadable_fraction
from workers.rl.validation import validate
from workers.rl.warmup import sft_batch, warmup
from workers.tasks import Grade, GraderReport, Problem, Task


def byte_sum_score(response: str) -> float:
    """The test's reward: the response's UTF-8 byte sum mod 11, over 10 (in [0, 1])."""
    return (sum(response.encode()) % 11) / 10


class ByteSumTask(Task):
    """The job's task (its prompts, its held-out problems) with :func:`byte_sum_score` for a
    reward (every response readable; correct at reward 1): an untrained model never answers a sum,
    so every reward would be 0, every GRPO advantage 0, and no update would move a weight."""

    def grade_batch(
        self, responses: list[str], problems: list[Problem]
    ) -> tuple[list[Grade], dict[str, GraderReport]]:
        grades = [Grade(r, r >= 1.0, True) for r in map(byte_sum_score, responses)]
        return grades, {"bytes": GraderReport("bytes", [g.reward for g in grades])}


class RecordingActors(InProcessActors):
    """:class:`InProcessActors` that keep what every generation returned."""

    def __init__(self, spec: JobSpec, tok: Tokenizer) -> None:
        super().__init__(spec, tok)
        self.generated: list[list[Generated]] = []
        self.temperatures: list[float | None] = []

    def start_generate(
        self, chunks: list[list[list[int]]], seeds: list[int], temperature: float | None = None
    ) -> Done:
        out = super().start_generate(chunks, seeds, temperature)
        self.generated.append(out.result())
        self.temperatures.append(temperature)
        return out


def step_spec(recipe: str) -> JobSpec:
    return parse_spec(
        helpers.tiny_spec(
            task={"params": ONE_DIGIT_SUMS, "size": 50},
            rollout={"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 3},
            resources={"generators": 2},
            optimizer={"lr": 1e-2, "micro_batch_size": 8},
            warmup={"sft_steps": 1, "batch_size": 4},
            validation={"interval": 1, "size": 4},
            precision={"recipe": recipe},
        )
    )


def decoded_scores(tok: Tokenizer, batch: Rollouts) -> list[float]:
    rows = zip(batch.response_ids, batch.response_mask, strict=True)
    return [byte_sum_score(tok.decode(ids[: int(mask.sum())].tolist())) for ids, mask in rows]


def stopped(tok: Tokenizer, batch: Rollouts) -> list[bool]:
    """Whether each response holds a stop id among its valid tokens (the test's own reading)."""
    rows = zip(batch.response_ids, batch.response_mask, strict=True)
    return [any(t in tok.eos_ids for t in ids[: int(mask.sum())].tolist()) for ids, mask in rows]


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_generators_hold(actors: InProcessActors, trainer: dict[str, torch.Tensor]) -> None:
    """Every weight a generator holds in BF16 is the trainer's master weight rounded to BF16
    (FP8 layers hold their FP8 copy only; the sync's weight contract checks those)."""
    for g in actors.generators:
        held = {n: p for n, p in g.model.named_parameters() if n not in actors.fp8_names}
        assert held and held.keys() == trainer.keys() - set(actors.fp8_names)
        for name, p in held.items():
            assert p.dtype == torch.bfloat16 and torch.equal(p, trainer[name].to(torch.bfloat16)), name


def payload_bytes(model: torch.nn.Module, fp8_names: list[str]) -> int:
    """What one sync moves, from the parameter shapes: an FP8 weight is 1 byte an element plus a
    float32 scale per 128x128 block; any other weight 2 bytes (BF16) an element; each tensor (an
    FP8 weight's data, its scales, any other weight) padded to a multiple of 16 bytes."""

    def padded(n: int) -> int:
        return 16 * math.ceil(n / 16)

    total = 0
    for name, p in model.named_parameters():
        if name in fp8_names:
            rows, cols = p.shape
            total += padded(p.numel()) + padded(4 * math.ceil(rows / 128) * math.ceil(cols / 128))
        else:
            total += padded(2 * p.numel())
    return total


@pytest.mark.parametrize("recipe", ["bf16", "fp8-e2e"])
def test_a_whole_step_runs_without_ray(recipe: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # from here on, any `import ray` raises ImportError
    spec = step_spec(recipe)
    task, tok = ByteSumTask(spec.task, spec.validation.size), build_tokenizer(spec)
    actors = RecordingActors(spec, tok)
    assert (actors.num_trainers, actors.num_generators) == (1, 2)
    assert bool(actors.fp8_names) == (recipe != "bf16")

    # the supervised warm-up: one logged step, then the checkpoint of step 0
    initial = params(actors.trainer.model)
    ctx = StepContext(spec, task, tok, actors)
    warmup(ctx, tmp_path, lambda line: None)
    (line,) = (tmp_path / "warmup.jsonl").read_text().splitlines()
    assert json.loads(line)["sft_step"] == 1 and 0 < json.loads(line)["loss"] < math.inf
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [0]
    warmed = params(actors.trainer.model)
    assert any(not torch.equal(initial[n], warmed[n]) for n in initial)

    sync = sync_weights(actors)  # the generators start from the trainer's weights
    assert_generators_hold(actors, warmed)
    assert sync["sync/layers_mismatched"] == 0.0
    assert sync["sync/layers_checked"] == 2 * len(warmed)  # every weight, on each of 2 generators

    outcome = RlLoop(ctx, 1).step(1)
    assert outcome.fault is None and outcome.row is not None
    row = outcome.row
    per_grader = {"reward/bytes/mean", "grader/bytes/errors", "grader/bytes/timeouts", "grader/bytes/seconds"}
    assert set(row) == set(StepMetrics.__required_keys__) | per_grader and row["step"] == 1
    per = dict(row)  # the per-grader keys are the row's dynamic part (rljob.metrics.grader_reward_key)
    assert per["reward/bytes/mean"] == pytest.approx(row["reward/mean"])  # one grader: the whole reward
    assert all(isinstance(v, int | float) and math.isfinite(v) for v in row.values()), row

    # the rewards of the responses the two generators returned (2 prompts x 4: one group each)
    (outs,) = actors.generated[-1:]
    assert len(outs) == 2 and [len(o.rollouts.response_ids) for o in outs] == [4, 4]
    batch = concat_rollouts([o.rollouts for o in outs], tok.pad_id)
    rewards = decoded_scores(tok, batch)
    assert row["reward/mean"] == pytest.approx(statistics.mean(rewards), abs=1e-6)
    assert row["reward/std"] == pytest.approx(statistics.stdev(rewards), abs=1e-6)
    assert row["reward/std"] > 0 and row["train/grad_norm"] > 0  # rewards differ: a real update
    assert row["response/truncated_fraction"] == sum(not s for s in stopped(tok, batch)) / 8
    assert row["response/unreadable_fraction"] == 0.0  # ByteSumTask reads every response
    assert row["tokens/generated"] == float(batch.response_mask.sum())
    assert row["tokens/trained"] == float(batch.response_mask.sum() + batch.prompt_mask.sum())
    assert row["kv_cache/bytes"] == sum(g.kv_cache_bytes for g in actors.generators) > 0
    assert row["weight_sync/bytes"] == payload_bytes(actors.trainer.model, actors.fp8_names)
    assert row["sync/layers_checked"] == 2 * len(warmed) and row["sync/layers_mismatched"] == 0.0

    # the update moved the trainer's weights, and the step's sync carried them to both generators
    trained = params(actors.trainer.model)
    assert any(not torch.equal(warmed[n], trained[n]) for n in warmed)
    assert_generators_hold(actors, trained)

    # validation: one response per held-out problem, shared out between the generators
    val = validate(ctx, 1)
    vouts = actors.generated[-1]
    assert sum(len(o.rollouts.response_ids) for o in vouts) == len(task.validation_problems()) == 4
    vrewards = decoded_scores(tok, concat_rollouts([o.rollouts for o in vouts], tok.pad_id))
    assert val["val/reward_mean"] == pytest.approx(statistics.mean(vrewards), abs=1e-6)
    assert val["val/accuracy"] == sum(r >= 1.0 for r in vrewards) / 4
    vbatch = concat_rollouts([o.rollouts for o in vouts], tok.pad_id)
    assert val["val/truncated_fraction"] == sum(not s for s in stopped(tok, vbatch)) / 4
    assert val["val/unreadable_fraction"] == 0.0

    # a checkpoint another pair of actors loads back exactly
    save(actors, tmp_path, 1)
    latest = checkpoint.latest(tmp_path)
    assert latest is not None and latest[0] == 1
    other = InProcessActors(spec, tok)
    other.load(latest[1])
    loaded = params(other.trainer.model)
    assert all(torch.equal(loaded[n], trained[n]) for n in trained)


def test_validation_reports_pass_at_1_and_pass_at_k() -> None:
    """pass@k: each of the 4 held-out problems sampled 3 times (problem i's responses consecutive,
    shared out between the 2 generators), solved when one of its 3 is fully correct; worked here
    from the decoded responses with the task's own rule (byte sum mod 11 = 10)."""
    spec = step_spec("bf16")
    spec = spec.model_copy(
        update={"validation": spec.validation.model_copy(update={"pass_k": 3, "pass_k_temperature": 1.5})}
    )
    task, tok = ByteSumTask(spec.task, spec.validation.size), build_tokenizer(spec)
    actors = RecordingActors(spec, tok)
    val = validate(StepContext(spec, task, tok, actors), 1)
    greedy, sampled = actors.generated[-2], actors.generated[-1]
    g_rewards = decoded_scores(tok, concat_rollouts([o.rollouts for o in greedy], tok.pad_id))
    s_rewards = decoded_scores(tok, concat_rollouts([o.rollouts for o in sampled], tok.pad_id))
    assert len(g_rewards) == 4 and len(s_rewards) == 12
    assert val["val/pass@1"] == val["val/accuracy"] == sum(r >= 1.0 for r in g_rewards) / 4
    solved = [any(r >= 1.0 for r in s_rewards[3 * i : 3 * i + 3]) for i in range(4)]
    assert val["val/pass@k"] == sum(solved) / 4 and val["val/pass_k"] == 3.0
    assert actors.temperatures[-2:] == [0.0, 1.5]  # greedy, then sampled at pass_k_temperature


@pytest.mark.slow  # a fresh interpreter (torch, transformers) and a step: ~25 s on 2 cores
def test_the_step_never_imports_ray() -> None:
    """A fresh interpreter runs a step, its sync and a validation: Ray is never imported."""
    code = """
import sys
from rljob import parse_spec
from tests import helpers
from tests.workers.inprocess_actors import Done, InProcessActors
from workers.rl.loop import RlLoop
from workers.rl.step import sync_weights
from workers.rl.protocol import StepContext
from workers.rl.validation import validate
from workers.tasks import Task
from workers.models.tokenizer import build_tokenizer

spec = parse_spec(helpers.tiny_spec(validation={"interval": 1, "size": 2}))
tok = build_tokenizer(spec)
task = Task.for_job(spec, tok)
actors = InProcessActors(spec, tok)
sync_weights(actors)
ctx = StepContext(spec, task, tok, actors)
row = RlLoop(ctx, 1).step(1).row
validate(ctx, 1)
print(row["step"], "ray" in sys.modules)
"""
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["1", "False"]


def test_a_response_is_truncated_when_no_valid_token_is_a_stop_id() -> None:
    """Stop ids 2 and 5, pad 0. Row 0 stops at 2; row 1 stops at 5 (a second stop id); row 2 ran
    to the limit; row 3 has a 2 only past its mask (padding): truncated. 2 of 4."""
    ids = torch.tensor([[7, 2, 0], [7, 8, 5], [7, 8, 9], [7, 0, 2]])  # [B=4, L=3]
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 1], [1, 1, 1], [1, 0, 0]])  # [B, L]
    batch = Rollouts(torch.ones(4, 1, dtype=torch.long), torch.ones(4, 1), ids, mask, torch.zeros(4, 3))
    assert truncated_fraction(batch, (2, 5)) == 0.5
    assert truncated_fraction(batch, (2,)) == 0.75  # 5 no longer stops row 1


def test_the_unreadable_fraction_counts_grades_without_an_answer() -> None:
    grades = [
        Grade(1.0, True, True),
        Grade(0.0, False, False),
        Grade(0.0, False, True),
        Grade(0, False, False),
    ]
    assert unreadable_fraction(grades) == 0.5


def test_the_warm_up_answers_a_chat_prompt_and_ends_the_turn(tmp_path: Path) -> None:
    """The chat tokenizer of tests/workers/models/test_tokenizer.py: the prompt "a b ?" as a chat is
    <s> <|user|> a b ? <|end|> <|assistant|> = [1, 3, 7, 8, 9, 2, 4]; the answer "7" (id 10)
    follows the generation prompt, then the end of turn <|end|> (2, the tokenizer's EOS)."""
    from tests.workers.models.test_tokenizer import chat_tokenizer_dir

    data = tmp_path / "qa.jsonl"
    data.write_text(json.dumps({"question": "a b", "answer": 7}) + "\n")
    spec = parse_spec(
        {
            "tokenizer": {"kind": "huggingface", "name": chat_tokenizer_dir(tmp_path / "tok")},
            "task": {"dataset": str(data), "prompt_template": "{question} ?", "chat_template": True},
        }
    )
    tok = build_tokenizer(spec)
    task = Task.for_job(spec, tok)
    batch = sft_batch(task, tok, task.sample(0, 1, 0))
    assert batch.prompt_ids.tolist() == [[1, 3, 7, 8, 9, 2, 4]]
    assert batch.response_ids.tolist() == [[10, 2]] and batch.response_mask.tolist() == [[1.0, 1.0]]


def test_the_warm_up_writes_the_answer_in_the_tag_asked_for(tmp_path: Path) -> None:
    """Bytes: the prompt "q\nAnswer: " is BOS + its bytes; the response is the bytes of
    "<answer>7</answer>" and EOS (257)."""
    data = tmp_path / "qa.jsonl"
    data.write_text(json.dumps({"question": "q", "answer": "7"}) + "\n")
    spec = parse_spec({"task": {"dataset": str(data), "answer_format": "answer-tag"}})
    tok = ByteTokenizer()
    task = Task.for_job(spec, tok)
    batch = sft_batch(task, tok, task.sample(0, 1, 0))
    assert batch.prompt_ids.tolist() == [[256, *b"q\nAnswer: "]]
    assert batch.response_ids.tolist() == [[*b"<answer>7</answer>", 257]]
