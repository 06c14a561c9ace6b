"""The supervised warm-up before RL (``warmup``): ``warmup.sft_steps`` steps of next-token
training on the task's reference answers, stopped early once the policy answers
``warmup.target_accuracy`` of a fixed sample of training problems greedily; then the checkpoint of
step 0 that RL starts from. Runs over the same :class:`~workers.rl.protocol.StepActors` as a step
(:mod:`workers.rl.step`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from rljob.run_dir import RunDir
from workers.engines.batching import concat_rollouts, even_split, left_pad, split_rows
from workers.engines.protocols import Rollouts
from workers.models.tokenizer import Tokenizer
from workers.rl.protocol import StepContext
from workers.rl.step import generate, save, scores, sync_weights
from workers.tasks import Problem, Task


def sft_batch(task: Task, tok: Tokenizer, problems: list[Problem]) -> Rollouts:
    """The warm-up's batch: each prompt, and as its response the reference answer written as the
    task reads it (``Task.target``: in its tag or box for those formats), then ``tok.eos_id``
    (a chat model's end of turn). With a chat template the answer follows the generation prompt."""
    texts = [task.prompt(p) for p in problems]
    prompts = [tok.encode(t) for t in texts]
    # the answer's tokens as they continue the prompt (no BOS, merges at the seam as in generation)
    answers = [
        [*tok.encode(t + task.target(p))[len(q) :], tok.eos_id]
        for p, t, q in zip(problems, texts, prompts, strict=True)
    ]
    prompt_ids, prompt_mask = left_pad(prompts, tok.pad_id)
    width = max(len(a) for a in answers)
    resp = torch.full((len(answers), width), tok.pad_id, dtype=torch.long)
    mask = torch.zeros((len(answers), width))
    for i, a in enumerate(answers):
        resp[i, : len(a)] = torch.tensor(a)
        mask[i, : len(a)] = 1.0
    return Rollouts(prompt_ids, prompt_mask, resp, mask, torch.zeros_like(mask))


def warmup(ctx: StepContext, out: Path, log: Callable[[str], None]) -> None:
    """``warmup.sft_steps`` supervised steps on the task's answers (``warmup.jsonl``), then a
    checkpoint of step 0. With ``warmup.target_accuracy``, every ``check_interval`` steps the
    generators answer ``check_size`` training problems greedily with the current weights; the
    warm-up stops once that accuracy reaches the target (the line of the check has it)."""
    spec, task, tok, actors = ctx.spec, ctx.task, ctx.tok, ctx.actors
    w = spec.warmup
    sizes = even_split(w.batch_size, 1, actors.num_trainers)
    check = task.sample(WARMUP_CHECK_STEP, w.check_size, spec.rollout.seed) if w.target_accuracy else []
    loss, accuracy, done = float("nan"), None, 0
    with RunDir(out).warmup.open("w") as f:
        for i in range(1, w.sft_steps + 1):
            batch = sft_batch(task, tok, task.sample(-i, w.batch_size, spec.rollout.seed))
            loss = actors.sft_step(split_rows(batch, sizes))
            line: dict[str, float] = {"sft_step": i, "loss": loss}
            done = i
            if check and i % w.check_interval == 0:
                sync_weights(actors)
                accuracy = greedy_accuracy(ctx, check, WARMUP_CHECK_STEP)
                line["train_accuracy"] = accuracy
            f.write(json.dumps(line) + "\n")
            f.flush()
            if accuracy is not None and accuracy >= w.target_accuracy:
                break
    reached = "" if accuracy is None else f", greedy training accuracy {accuracy:.3f}"
    if w.target_accuracy and (accuracy is None or accuracy < w.target_accuracy):
        reached += f" (target {w.target_accuracy} not reached within sft_steps)"
    log(f"supervised warm-up: {done} steps, final loss {loss:.3f}{reached}")
    save(actors, out, 0)


WARMUP_CHECK_STEP = -(10**9)  # the step whose sample (and seeds) the warm-up's accuracy checks use


def greedy_accuracy(ctx: StepContext, problems: list[Problem], step: int) -> float:
    """Fraction of ``problems`` the generators answer fully correctly (``Grade.correct``) at
    temperature 0."""
    spec, task, tok, actors = ctx.spec, ctx.task, ctx.tok, ctx.actors
    prompts = [tok.encode(task.prompt(p)) for p in problems]
    outs = generate(spec, actors, prompts, even_split(len(prompts), 1, actors.num_generators), step, 0.0)
    batch = concat_rollouts([o.rollouts for o in outs], tok.pad_id)
    return sum(g.correct for g in scores(task, tok, batch, problems)[0]) / len(problems)
