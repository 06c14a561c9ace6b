"""One RL step of the driver (asked for with :func:`start_batch`, trained and synced with
:func:`train_and_sync`; :mod:`workers.rl.loop` runs the steps), and what every phase of a run
shares: sampling over the generators, grading, the weight sync from the trainers to the
generators (checked against the precision contract) and checkpoints. The supervised warm-up
(:mod:`workers.rl.warmup`) and validation on held-out problems (:mod:`workers.rl.validation`) sit
beside it and use these.

A step:  prompts -> generators (sample + logprobs) -> rewards -> trainers (logprobs with the
weights that generated, GRPO advantages, IS-corrected update) -> trainer quantizes -> broadcast to
generators; its ``StepMetrics`` row is one line of ``metrics.jsonl``. Prompts and sampling seeds
are functions of (seed, step), so a resumed step sees the same prompts.

Plain orchestration over :class:`~workers.rl.protocol.StepActors`: which transport runs the
trainers and generators (Ray actors in a job, one process in the tests) is not this module's
business; each actors call says what runs concurrently inside it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple, cast

import torch

from rljob import metrics as m
from rljob.metrics import StepMetrics, SyncMetrics
from rljob.spec import JobSpec
from workers.algo.mismatch import mismatch_metrics
from workers.engines.batching import concat_rollouts, even_split, left_pad, split_rows
from workers.engines.layer_diff import ExactMismatchError, compare_traces, describe
from workers.engines.protocols import Rollouts, TrainStats
from workers.models import checkpoint
from workers.models.tokenizer import Tokenizer
from workers.rl.faults import ActorFault
from workers.rl.protocol import Generated, PendingRollouts, StepActors, StepContext
from workers.tasks import Grade, GraderReport, Problem, Task
from workers.weight_sync.contract import compare


def step_seed(spec: JobSpec, step: int, generator: int) -> int:
    return (spec.rollout.seed * 1_000_003 + step * 1009 + generator) % 2**63


def chunked(items: list[list[int]], sizes: list[int]) -> list[list[list[int]]]:
    """``items`` cut in order into consecutive chunks of ``sizes``."""
    chunks, start = [], 0
    for n in sizes:
        chunks.append(items[start : start + n])
        start += n
    return chunks


def generate(
    spec: JobSpec,
    actors: StepActors,
    prompts: list[list[int]],
    sizes: list[int],
    step: int,
    temperature: float | None = None,
) -> list[Generated]:
    """``prompts`` shared out in order (generator ``i`` takes ``sizes[i]``), sampled with seeds
    of ``step``; every generator at once."""
    seeds = [step_seed(spec, step, i) for i in range(len(sizes))]
    return actors.generate(chunked(prompts, sizes), seeds, temperature)


def scores(
    task: Task, tok: Tokenizer, batch: Rollouts, problems: list[Problem]
) -> tuple[list[Grade], dict[str, GraderReport]]:
    """The task's grade of each decoded response (up to and including its stop id), and each
    grader's report (raises :class:`~workers.tasks.GraderFailure` past the task's error fraction)."""
    texts = [
        tok.decode(row[: int(mask.sum())].tolist())
        for row, mask in zip(batch.response_ids, batch.response_mask, strict=True)
    ]
    return task.grade_batch(texts, problems)


def grader_metrics(reports: Mapping[str, GraderReport]) -> dict[str, float]:
    """Each grader's ``reward/<grader>/mean`` and ``grader/<grader>/{errors,timeouts,seconds}``."""
    out: dict[str, float] = {}
    for name, r in reports.items():
        out[m.grader_reward_key(name)] = r.mean
        out[m.grader_stat_key(name, "errors")] = float(r.errors)
        out[m.grader_stat_key(name, "timeouts")] = float(r.timeouts)
        out[m.grader_stat_key(name, "seconds")] = r.seconds
    return out


def truncated_fraction(batch: Rollouts, eos_ids: tuple[int, ...]) -> float:
    """Fraction of the responses that hit ``max_new_tokens`` without a stop id: none of their valid
    tokens (``response_mask`` 1) is one of ``eos_ids``."""
    stops = torch.isin(batch.response_ids, torch.tensor(eos_ids)) & (batch.response_mask != 0)  # [B, L]
    return float((~stops.any(dim=1)).float().mean())  # mean over [B]


def unreadable_fraction(grades: list[Grade]) -> float:
    """Fraction of the responses from which no answer could be read (``task.answer_format``)."""
    return sum(not g.readable for g in grades) / max(len(grades), 1)


def calibrate_kv(ctx: StepContext, step: int) -> None:
    """Before the first rollout of a run (fresh, resumed or recovered): the trainers calibrate
    the K/V-cache scales the next sync carries on the prompts step ``step`` will sample, so that
    vLLM's FP8 KV cache never generates with its default scale 1.0. Each prompt's last token
    stands as the response (its K and V are observed like the rest). A no-op on trainers that do
    not calibrate (``workers.fp8.kv_cache.calibrates_kv``); every later sync carries the
    scales the trainers calibrate after their update."""
    r, task, tok, actors = ctx.spec.rollout, ctx.task, ctx.tok, ctx.actors
    prompts = [tok.encode(task.prompt(p)) for p in task.sample(step, r.prompts_per_step, r.seed)]
    batch = prompt_batch(prompts, tok.pad_id)
    actors.calibrate_kv(split_rows(batch, even_split(batch.prompt_ids.shape[0], 1, actors.num_trainers)))


def prompt_batch(prompts: list[list[int]], pad_id: int) -> Rollouts:
    """Prompts alone as a batch the trainers can run: left-padded (so the last column is real in
    every row), each prompt's last token standing as its one-token response."""
    ids, mask = left_pad(prompts, pad_id)
    ones = torch.ones((ids.shape[0], 1))
    return Rollouts(ids[:, :-1], mask[:, :-1], ids[:, -1:], ones, torch.zeros_like(ones))


def sync_weights(actors: StepActors) -> SyncMetrics:
    """Trainer 0 sends the new weights to every generator; each generator's report of what it holds
    is checked against what was sent (:mod:`workers.weight_sync.contract`): a difference fails the step
    with :class:`~workers.weight_sync.contract.WeightContractError`, naming the generator and weight."""
    transfer = actors.send_and_receive_weights()
    checks = [compare(transfer.sent, held) for held in transfer.received]
    for i, check in enumerate(checks):
        check.raise_if_failed(f"generator {i}")
    return {
        m.WEIGHT_SYNC_BYTES: float(transfer.bytes),
        m.SYNC_LAYERS_CHECKED: float(sum(c.checked for c in checks)),
        m.SYNC_LAYERS_MISMATCHED: float(sum(len(c.mismatches) for c in checks)),
    }


def save(
    actors: StepActors,
    out: Path,
    step: int,
    row: Mapping[str, Any] | None = None,
    state: Mapping[str, Any] | None = None,
) -> None:
    """The trainers' state as the atomic checkpoint of ``step`` (:mod:`workers.models.checkpoint`), with
    the step's metrics line (``row``) in its ``state.json``: a kill between the checkpoint and the
    line's append loses no line, since a resume restores it from there (the driver). ``state``:
    more of the job's state for ``state.json`` (the precision actions in effect)."""
    tmp = checkpoint.begin(out, step)
    actors.save(tmp)
    checkpoint.commit(out, tmp, step, {**(state or {}), **({} if row is None else {METRICS_ROW: dict(row)})})


METRICS_ROW = "metrics_row"  # the state.json key of the checkpointed step's metrics line


def train(actors: StepActors, batch: Rollouts, rewards: torch.Tensor, sizes: list[int]) -> list[TrainStats]:
    """The trainers' update, trainer ``i`` on the next ``sizes[i]`` rows. Under ``precision.exact``
    a trainer that finds a log-prob differing from the generator's raises before updating, and this
    names the token and the first layer where the two engines' activations differ, traced on both
    (weights not yet synced)."""
    try:
        return actors.train(split_rows(batch, sizes), list(torch.split(rewards, sizes)))
    except ExactMismatchError as err:
        if err.row < 0:
            raise
        i = err.trainer_index
        row = sum(sizes[:i]) + err.row  # the row in the whole batch
        prompt = batch.prompt_ids[row][batch.prompt_mask[row] != 0]
        response = batch.response_ids[row, : err.position + 1]
        where = describe(compare_traces(*actors.trace_token(i, prompt, response)))
        raise ExactMismatchError(row, err.position, err.trainer, err.generator).with_detail(where) from err


class Batch(NamedTuple):
    """A step's rollout batch, asked of the generators and maybe not yet collected."""

    step: int  # the step that trains it (its prompts and seeds are functions of (seed, step))
    version: int  # the policy version that generates it: weights after that many optimizer steps
    problems: list[Problem]  # [B] each response's problem (groups are consecutive)
    pending: PendingRollouts


def start_batch(ctx: StepContext, step: int, version: int) -> Batch:
    """Ask the generators for the rollouts of ``step``; they generate with the weights they hold
    when they reach the request, whose version the caller knows (``version``)."""
    spec, task, tok, actors = ctx.spec, ctx.task, ctx.tok, ctx.actors
    r = spec.rollout
    problems = task.sample(step, r.prompts_per_step, r.seed)
    expanded = [p for p in problems for _ in range(r.group_size)]  # groups are consecutive
    prompts = [tok.encode(task.prompt(p)) for p in expanded]
    gsizes = even_split(r.prompts_per_step, r.group_size, actors.num_generators)
    seeds = [step_seed(spec, step, i) for i in range(len(gsizes))]
    return Batch(step, version, expanded, actors.start_generate(chunked(prompts, gsizes), seeds))


class Trained(NamedTuple):
    """What :func:`train_and_sync` measured: the step's row, and its inputs the RL loop splits
    further (:mod:`workers.rl.loop`). The step is trained either way; ``fault`` is the weight
    sync's, when it failed after the update: then ``row`` has no sync or step-time keys, and the
    recovery sends the weights again instead of training the step twice."""

    row: StepMetrics
    batch: Rollouts  # the rollouts trained on
    logp_old: torch.Tensor  # [B, L] the trainer's log-probs of them before the update
    train_wall: tuple[float, float]  # wall clock (Unix seconds) when training began and ended
    fault: ActorFault | None = None


def train_and_sync(
    ctx: StepContext,
    step: int,
    problems: list[Problem],
    outs: list[Generated],
    t0: float,
    generation_s: float,
) -> Trained:
    """Score, train and sync one generated batch; the row's step time runs from ``t0``
    (``time.perf_counter``), its generation time is ``generation_s``. A fault before the update
    is raised; one in the sync after it is returned (:class:`Trained`)."""
    spec, task, tok, actors = ctx.spec, ctx.task, ctx.tok, ctx.actors
    r = spec.rollout
    batch = concat_rollouts([o.rollouts for o in outs], tok.pad_id)
    t1 = time.perf_counter()

    grades, reports = scores(task, tok, batch, problems)
    rewards = torch.tensor([g.reward for g in grades])  # [B]
    t2 = time.perf_counter()

    tsizes = even_split(r.prompts_per_step, r.group_size, actors.num_trainers)
    wall_start = time.time()
    results = train(actors, batch, rewards, tsizes)
    wall_end = time.time()
    logp_old = torch.cat([x.logprobs_old for x in results])  # [B, L]
    stats = results[0].stats  # each trainer's stats already cover the whole batch (all-reduced)
    stats.pop(m.TRAIN_TOKENS, None)  # tokens/trained below says it
    t3 = time.perf_counter()

    isc = spec.algorithm.importance_sampling
    mismatch = mismatch_metrics(logp_old, batch.logprobs, batch.response_mask, isc.low, isc.high, isc.mode)
    gen_tokens = float(batch.response_mask.sum())
    train_tokens = gen_tokens + float(batch.prompt_mask.sum())
    trained: dict[str, Any] = {
        m.STEP: step,
        m.REWARD_MEAN: float(rewards.mean()),
        m.REWARD_STD: float(rewards.std()) if rewards.numel() > 1 else 0.0,
        m.RESPONSE_LENGTH_MEAN: gen_tokens / max(len(problems), 1),
        m.RESPONSE_TRUNCATED_FRACTION: truncated_fraction(batch, tok.eos_ids),
        m.RESPONSE_UNREADABLE_FRACTION: unreadable_fraction(grades),
        **grader_metrics(reports),
        **mismatch,
        **stats,
        m.TOKENS_GENERATED: gen_tokens,
        m.TOKENS_TRAINED: train_tokens,
        m.GENERATION_TOKENS_PER_S: gen_tokens / max(generation_s, 1e-9),
        m.TRAIN_TOKENS_PER_S: train_tokens / max(t3 - t2, 1e-9),
        m.TIMING_GENERATION_S: generation_s,
        m.TIMING_REWARD_S: t2 - t1,
        m.TIMING_TRAIN_S: t3 - t2,
        m.KV_CACHE_BYTES: float(sum(o.kv_cache_bytes for o in outs)),
        m.WEIGHTS_BYTES: float(sum(o.weight_bytes for o in outs)),
    }
    t_sync = time.perf_counter()
    try:
        sync = sync_weights(actors)
    except ActorFault as fault:  # the step is trained: its recovery must not train it again
        return Trained(cast(StepMetrics, trained), batch, logp_old, (wall_start, wall_end), fault)
    t4 = time.perf_counter()
    timing = {m.TIMING_WEIGHT_SYNC_S: t4 - t_sync, m.TIMING_STEP_S: t4 - t0, m.TIME: time.time()}
    row = cast(StepMetrics, {**trained, **timing, **sync})
    return Trained(row, batch, logp_old, (wall_start, wall_end))
