"""One RL step of the driver, and what runs between steps: the supervised warm-up, the weight sync
from the trainers to the generators, validation on held-out problems and checkpoints.

A step:  prompts -> generators (sample + logprobs) -> rewards -> trainers (logprobs with the
weights that generated, GRPO advantages, IS-corrected update) -> trainer quantizes -> broadcast to
generators; its ``StepMetrics`` row is one line of ``metrics.jsonl``. Prompts and sampling seeds
are functions of (seed, step), so a resumed step sees the same prompts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rljob import metrics as m
from rljob.metrics import StepMetrics, SyncMetrics, TrainMetrics, ValidationMetrics
from rljob.run_dir import RunDir
from rljob.spec import JobSpec
from workers import checkpoint
from workers.algo.mismatch import mismatch_metrics
from workers.cluster import Cluster
from workers.engines.batching import concat_rollouts, even_split, left_pad, split_rows
from workers.engines.native.layer_diff import ExactMismatchError, compare_traces, describe
from workers.engines.protocols import Rollouts
from workers.tasks import Problem, Task
from workers.tokenizer import Tokenizer
from workers.weight_contract import compare


def sft_batch(task: Task, tok: Tokenizer, problems: list[Problem]) -> Rollouts:
    prompts = [tok.encode(task.prompt(p)) for p in problems]
    # the answer's tokens as they continue the prompt (no BOS, merges at the seam as in generation)
    answers = [
        [*tok.encode(task.prompt(p) + p.answer)[len(q) :], tok.eos_id]
        for p, q in zip(problems, prompts, strict=True)
    ]
    prompt_ids, prompt_mask = left_pad(prompts, tok.pad_id)
    width = max(len(a) for a in answers)
    resp = torch.full((len(answers), width), tok.pad_id, dtype=torch.long)
    mask = torch.zeros((len(answers), width))
    for i, a in enumerate(answers):
        resp[i, : len(a)] = torch.tensor(a)
        mask[i, : len(a)] = 1.0
    return Rollouts(prompt_ids, prompt_mask, resp, mask, torch.zeros_like(mask))


def step_seed(spec: JobSpec, step: int, generator: int) -> int:
    return (spec.rollout.seed * 1_000_003 + step * 1009 + generator) % 2**63


def validation_due(spec: JobSpec, step: int) -> bool:
    """Whether ``step`` ends with a validation: every ``validation.interval`` steps and the last."""
    interval = spec.validation.interval
    return interval > 0 and (step % interval == 0 or step == spec.steps)


def validate(spec: JobSpec, task: Task, tok: Tokenizer, cluster: Cluster, step: int) -> ValidationMetrics:
    """``val/*`` of the held-out problems: one response each, shared out between the generators
    like rollouts, at ``validation.temperature`` (0: greedy) with a seed fixed per step."""
    import ray

    t0 = time.perf_counter()
    problems = task.validation_problems()
    prompts = [tok.encode(task.prompt(p)) for p in problems]
    chunks, start = [], 0
    for n in even_split(len(prompts), 1, len(cluster.generators)):
        chunks.append(prompts[start : start + n])
        start += n
    temperature = spec.validation.temperature
    outs = ray.get(
        [  # negative steps: seeds no rollout uses
            g.generate.remote(c, step_seed(spec, -step, i), temperature)
            for i, (g, c) in enumerate(zip(cluster.generators, chunks, strict=True))
            if c
        ]
    )
    batch = concat_rollouts([o[0] for o in outs], tok.pad_id)
    rewards = [
        task.score(tok.decode(row[: int(mask.sum())].tolist()), p)
        for row, mask, p in zip(batch.response_ids, batch.response_mask, problems, strict=True)
    ]
    return {
        m.VAL_ACCURACY: sum(r >= 1.0 for r in rewards) / len(rewards),
        m.VAL_REWARD_MEAN: sum(rewards) / len(rewards),
        m.TIMING_VALIDATION_S: time.perf_counter() - t0,
    }


def warmup(
    spec: JobSpec, task: Task, tok: Tokenizer, cluster: Cluster, out: Path, log: Callable[[str], None]
) -> None:
    import ray

    w = spec.warmup
    sizes = even_split(w.batch_size, 1, len(cluster.trainers))
    with RunDir(out).warmup.open("w") as f:
        for i in range(1, w.sft_steps + 1):
            batch = sft_batch(task, tok, task.sample(-i, w.batch_size, spec.rollout.seed))
            losses = ray.get(
                [
                    t.sft_step.remote(b)
                    for t, b in zip(cluster.trainers, split_rows(batch, sizes), strict=True)
                ]
            )
            # every trainer returns the loss of the whole batch (reduced over the trainers)
            f.write(json.dumps({"sft_step": i, "loss": losses[0]}) + "\n")
    log(f"supervised warm-up: {w.sft_steps} steps, final loss {losses[0]:.3f}")
    save(cluster, out, 0)


def sync_weights(cluster: Cluster) -> SyncMetrics:
    """Trainer 0 sends the new weights to every generator; each generator's report of what it holds
    is checked against what was sent (:mod:`workers.weight_contract`): a difference fails the step
    with :class:`~workers.weight_contract.WeightContractError`, naming the generator and weight."""
    import ray

    send = cluster.trainers[0].send_weights.remote(cluster.fp8_names)
    others = [t.send_weights.remote(cluster.fp8_names) for t in cluster.trainers[1:]]
    recv = [g.receive_weights.remote() for g in cluster.generators]
    results = ray.get([send, *others, *recv])
    sent, received = results[0], results[1 + len(others) :]
    checks = [compare(sent["report"], r["report"]) for r in received]
    for i, check in enumerate(checks):
        check.raise_if_failed(f"generator {i}")
    return {
        m.WEIGHT_SYNC_BYTES: float(sent["bytes"]),
        m.SYNC_LAYERS_CHECKED: float(sum(c.checked for c in checks)),
        m.SYNC_LAYERS_MISMATCHED: float(sum(len(c.mismatches) for c in checks)),
    }


def save(cluster: Cluster, out: Path, step: int) -> None:
    import ray

    tmp = checkpoint.begin(out, step)
    ray.get([t.save.remote(str(tmp)) for t in cluster.trainers])  # trainer 0 writes
    checkpoint.commit(out, tmp, step, {})


def train_results(
    refs: list[Any], cluster: Cluster, batch: Rollouts, sizes: list[int]
) -> list[tuple[torch.Tensor, TrainMetrics]]:
    """The trainers' results; under ``precision.exact`` a trainer that finds a log-prob differing
    from the generator's raises before updating, and this names the token and the first layer
    where the two engines' activations differ, traced on both (weights not yet synced)."""
    import ray

    try:
        out: list[tuple[torch.Tensor, TrainMetrics]] = ray.get(refs)
        return out
    except Exception as err:
        found = [(i, e) for i, e in enumerate(_errors(refs)) if e is not None and e.row >= 0]
        if not found:
            raise
        i, e = found[0]
        row = sum(sizes[:i]) + e.row
        prompt = batch.prompt_ids[row][batch.prompt_mask[row] != 0]
        response = batch.response_ids[row, : e.position + 1]
        gen = cluster.generators[0].trace_token.remote(prompt, response)
        train = cluster.trainers[i].trace_token.remote(prompt, response)
        where = describe(compare_traces(*ray.get([gen, train])))
        raise ExactMismatchError(row, e.position, e.trainer, e.generator).with_detail(where) from err


def _errors(refs: list[Any]) -> list[ExactMismatchError | None]:
    """Each trainer's :class:`ExactMismatchError` (from Ray's wrapper), or None."""
    import ray

    out: list[ExactMismatchError | None] = []
    for ref in refs:
        try:
            ray.get(ref)
            out.append(None)
        except Exception as err:  # Ray wraps the actor's exception; the original is its cause
            cause = err if isinstance(err, ExactMismatchError) else getattr(err, "cause", None)
            out.append(cause if isinstance(cause, ExactMismatchError) else None)
    return out


def rl_step(spec: JobSpec, task: Task, tok: Tokenizer, cluster: Cluster, step: int) -> StepMetrics:
    import ray

    r = spec.rollout
    t0 = time.perf_counter()
    problems = task.sample(step, r.prompts_per_step, r.seed)
    expanded = [p for p in problems for _ in range(r.group_size)]  # groups are consecutive
    prompts = [tok.encode(task.prompt(p)) for p in expanded]
    sizes = even_split(r.prompts_per_step, r.group_size, len(cluster.generators))
    chunks, start = [], 0
    for n in sizes:
        chunks.append(prompts[start : start + n])
        start += n
    outs = ray.get(
        [
            g.generate.remote(c, step_seed(spec, step, i))
            for i, (g, c) in enumerate(zip(cluster.generators, chunks, strict=True))
            if c
        ]
    )
    batch = concat_rollouts([o[0] for o in outs], tok.pad_id)
    t1 = time.perf_counter()

    texts = [
        tok.decode(row[: int(mask.sum())].tolist())
        for row, mask in zip(batch.response_ids, batch.response_mask, strict=True)
    ]
    rewards = torch.tensor([task.score(t, p) for t, p in zip(texts, expanded, strict=True)])  # [B]
    t2 = time.perf_counter()

    tsizes = even_split(r.prompts_per_step, r.group_size, len(cluster.trainers))
    parts = split_rows(batch, tsizes)
    rparts = torch.split(rewards, tsizes)
    refs = [t.train_step.remote(b, rw) for t, b, rw in zip(cluster.trainers, parts, rparts, strict=True)]
    results = train_results(refs, cluster, batch, tsizes)
    logp_old = torch.cat([x[0] for x in results])
    stats = results[0][1]  # each trainer's stats already cover the whole batch (all-reduced)
    stats.pop(m.TRAIN_TOKENS, None)  # tokens/trained below says it
    t3 = time.perf_counter()

    sync = sync_weights(cluster)
    t4 = time.perf_counter()

    isc = spec.algorithm.importance_sampling
    mismatch = mismatch_metrics(logp_old, batch.logprobs, batch.response_mask, isc.low, isc.high, isc.mode)
    gen_tokens = float(batch.response_mask.sum())
    train_tokens = gen_tokens + float(batch.prompt_mask.sum())
    return {
        m.STEP: step,
        m.REWARD_MEAN: float(rewards.mean()),
        m.REWARD_STD: float(rewards.std()) if rewards.numel() > 1 else 0.0,
        m.RESPONSE_LENGTH_MEAN: gen_tokens / max(len(expanded), 1),
        **mismatch,
        **stats,
        m.TOKENS_GENERATED: gen_tokens,
        m.TOKENS_TRAINED: train_tokens,
        m.GENERATION_TOKENS_PER_S: gen_tokens / max(t1 - t0, 1e-9),
        m.TRAIN_TOKENS_PER_S: train_tokens / max(t3 - t2, 1e-9),
        m.TIMING_GENERATION_S: t1 - t0,
        m.TIMING_REWARD_S: t2 - t1,
        m.TIMING_TRAIN_S: t3 - t2,
        m.TIMING_WEIGHT_SYNC_S: t4 - t3,
        m.TIMING_STEP_S: t4 - t0,
        **sync,
        m.KV_CACHE_BYTES: float(sum(o[1]["kv_cache"] for o in outs)),
        m.WEIGHTS_BYTES: float(sum(o[1]["weights"] for o in outs)),
        m.TIME: time.time(),
    }
