"""The job driver: one per job, on the laptop (``fp8rl run``) or in a KubeRay RayJob.

Each step:  prompts -> generators (sample + logprobs) -> rewards -> trainers (logprobs with the
weights that generated, GRPO advantages, IS-corrected update) -> trainer quantizes -> broadcast to
generators. Every ``validation.interval`` steps (and at the last) the generators then answer the
task's held-out problems, and the step's line gets ``val/accuracy`` and ``val/reward_mean``.
Metrics go to ``metrics.jsonl`` (one line per step), Prometheus and the progress bar.

Nothing is lost on a stop or crash: checkpoints are atomic (``workers.checkpoint``), and
``resume=True`` restarts from the newest one, dropping metric lines of steps after it, so every
step appears exactly once. Prompts and sampling seeds are functions of (seed, step), so the
resumed steps see the same prompts. ``python -m workers.driver SPEC`` is the RayJob entrypoint.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rljob import metrics as m
from rljob.metrics import MetricsLog, StepMetrics, TrainMetrics, ValidatedStepMetrics, ValidationMetrics
from rljob.resource import RAY_GROUP_RESOURCES, RAY_GROUPS_ENV
from rljob.spec import JobSpec
from rljob.status import EXIT_OUT_OF_MEMORY
from workers import checkpoint
from workers.algo.mismatch import mismatch_metrics
from workers.engines.factory import check_engines, uses_weight_channel
from workers.engines.protocols import Rollouts, concat_rollouts, even_split, left_pad, split_rows
from workers.metrics import PromExporter
from workers.tasks import Problem, Task
from workers.tokenizer import Tokenizer, build_tokenizer


@dataclass
class RunOptions:
    """How to run a job (what is not part of the job itself)."""

    resume: bool = False
    metrics_port: int | None = None  # None: no HTTP server; 0: any free port
    job: str = ""
    namespace: str = "default"
    stop: threading.Event = field(default_factory=threading.Event)
    on_step: Callable[[StepMetrics], None] | None = None  # progress display
    log: Callable[[str], None] = print
    ray_address: str | None = None


@dataclass
class RunResult:
    output_dir: Path
    last_step: int
    stopped: bool
    rows: list[Mapping[str, Any]]  # the log's lines: resumed ones as read, then this run's
    metrics_port: int | None


def actor_options(spec: JobSpec, role: str) -> dict[str, Any]:
    """Ray options of a generator or trainer actor. In a RayJob built by the operator
    (``FP8RL_RAY_GROUPS=1``) each also asks for its worker group's custom resource."""
    res = spec.resources
    gpus: float = res.gpus_per_generator if role == "generation" else res.gpus_per_trainer
    if res.share_gpu:  # every actor on the one GPU
        gpus = 1.0 / (res.trainers + res.generators)
    opts: dict[str, Any] = {"num_cpus": res.cpus_per_actor, "num_gpus": gpus}
    if os.environ.get(RAY_GROUPS_ENV) == "1":
        opts["resources"] = {RAY_GROUP_RESOURCES[role]: 1}
    return opts


def collective_backend(spec: JobSpec) -> str:
    """NCCL when every actor has GPUs of its own; gloo on CPUs and on a shared GPU (NCCL refuses
    two ranks on one device). Collectives always run on the tensors' own device."""
    res = spec.resources
    own_gpus = res.gpus_per_trainer > 0 and res.gpus_per_generator > 0 and not res.share_gpu
    return "nccl" if own_gpus else "gloo"


class _Cluster:
    """The job's actors: trainers (ranks 0..T-1) and generators."""

    def __init__(self, spec: JobSpec, vocab_size: int, tok: Tokenizer) -> None:
        import ray

        from workers.actors import GeneratorWorker, TrainerWorker, open_weight_channel

        res = spec.resources
        t, g = res.trainers, res.generators
        world = t + g
        spec_json = spec.model_dump_json()
        trainer_cls: Any = ray.remote(**actor_options(spec, "training"))(TrainerWorker)
        gen_cls: Any = ray.remote(**actor_options(spec, "generation"))(GeneratorWorker)
        self.trainers: list[Any] = [trainer_cls.remote(spec_json, r, world, vocab_size) for r in range(t)]
        self.generators: list[Any] = [
            gen_cls.remote(spec_json, t + i, world, vocab_size, tok.eos_id, tok.pad_id) for i in range(g)
        ]
        backend = collective_backend(spec)
        address = ray.get(self.trainers[0].free_address.remote())
        audits = ray.get([a.setup.remote(address, backend) for a in self.all()])
        self.trainer_audit, self.generator_audit = audits[0], audits[t]
        if uses_weight_channel(spec):  # vLLM or Megatron: weights over an NCCL group of their own
            open_weight_channel(spec, self.trainers[0], self.generators)
        self.fp8_names: list[str] = ray.get(self.generators[0].fp8_weight_names.remote())

    def all(self) -> list[Any]:
        return self.trainers + self.generators

    def shutdown(self) -> None:
        import ray

        for a in self.all():
            ray.kill(a)


def _ray_init(opts: RunOptions, spec: JobSpec) -> bool:
    """Start a local Ray (or join ``RAY_ADDRESS``); True when this call started it."""
    import ray

    if ray.is_initialized():
        return False
    address = opts.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, logging_level=logging.WARNING)
    else:
        res = spec.resources
        need = (res.trainers + res.generators) * res.cpus_per_actor
        ray.init(
            num_cpus=max(int(need + 0.999), os.cpu_count() or 1),
            include_dashboard=False,
            logging_level=logging.WARNING,
        )
    return True


def _prepare_output(spec: JobSpec, out: Path, resume: bool) -> tuple[int, Path | None]:
    """Check the output dir; return (first step, checkpoint to load)."""
    out.mkdir(parents=True, exist_ok=True)
    last = checkpoint.latest(out)
    if not resume:
        if last is not None or (out / "metrics.jsonl").exists():
            raise FileExistsError(
                f"{out} already holds a run; pass --resume to continue it, or choose another --output"
            )
        return 1, None
    if last is None:
        return 1, None
    return last[0] + 1, last[1]


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def _sft_batch(task: Task, tok: Tokenizer, problems: list[Problem]) -> Rollouts:
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


def _step_seed(spec: JobSpec, step: int, generator: int) -> int:
    return (spec.rollout.seed * 1_000_003 + step * 1009 + generator) % 2**63


def validation_due(spec: JobSpec, step: int) -> bool:
    """Whether ``step`` ends with a validation: every ``validation.interval`` steps and the last."""
    interval = spec.validation.interval
    return interval > 0 and (step % interval == 0 or step == spec.steps)


def _validate(spec: JobSpec, task: Task, tok: Tokenizer, cluster: _Cluster, step: int) -> ValidationMetrics:
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
            g.generate.remote(c, _step_seed(spec, -step, i), temperature)
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


def run(spec: JobSpec, output_dir: str | Path | None = None, opts: RunOptions | None = None) -> RunResult:
    """Run ``spec`` to its last step (or until ``opts.stop`` is set); see the module docstring."""
    import ray

    opts = opts or RunOptions()
    out = Path(output_dir or spec.output_dir)
    check_engines(spec)  # an engine that is not installed fails here, before Ray does any work
    # a bad task, held-out split (validation.size) or tokenizer fails here, before Ray starts
    task, tok = Task.for_job(spec), build_tokenizer(spec)
    first_step, ckpt = _prepare_output(spec, out, opts.resume)
    _write_json(out / "spec.resolved.json", spec.model_dump(mode="json"))
    log = MetricsLog(out / "metrics.jsonl")
    rows: list[Mapping[str, Any]] = list(log.truncate(first_step - 1)) if opts.resume else []
    prom = PromExporter(opts.job or out.name, opts.namespace, spec.precision.recipe)
    port = prom.serve(opts.metrics_port) if opts.metrics_port is not None else None
    if port is not None:
        opts.log(f"Prometheus metrics on http://0.0.0.0:{port}/metrics")
    if first_step > spec.steps:
        opts.log(f"{out} already completed step {spec.steps}; raise --steps to continue")
        prom.stop()
        return RunResult(out, first_step - 1, False, rows, port)
    started_ray = _ray_init(opts, spec)
    cluster: _Cluster | None = None
    step = first_step - 1
    try:
        cluster = _Cluster(spec, tok.vocab_size, tok)
        audits = {"trainer": cluster.trainer_audit, "generator": cluster.generator_audit}
        _write_json(out / "quantization_audit.json", audits)
        for role, audit in audits.items():
            opts.log(f"quantization audit ({role}):\n{audit['table']}")
        if ckpt is not None:
            ray.get([t.load.remote(str(ckpt)) for t in cluster.trainers])
            opts.log(f"resumed from {ckpt} at step {first_step}")
        elif spec.warmup.sft_steps:
            _warmup(spec, task, tok, cluster, out, opts)
        _sync(cluster)  # generators start from the trainer's weights
        for step in range(first_step, spec.steps + 1):
            row: StepMetrics = _rl_step(spec, task, tok, cluster, step)
            if validation_due(spec, step):  # after the step's weight sync: the updated policy
                validated: ValidatedStepMetrics = {**row, **_validate(spec, task, tok, cluster, step)}
                row = validated
            due = step % spec.checkpoint_interval == 0 or step == spec.steps
            if due:  # before the metrics line: a line never refers to weights that were not saved
                _save(cluster, out, step)
            log.append(row)
            rows.append(row)
            prom.observe(row)
            if opts.on_step is not None:
                opts.on_step(row)
            if opts.stop.is_set():
                if not due:
                    _save(cluster, out, step)
                opts.log(f"stopped after step {step}; continue with --resume")
                break
        return RunResult(out, step, opts.stop.is_set(), rows, port)
    finally:
        if cluster is not None:
            cluster.shutdown()
        if started_ray:
            ray.shutdown()
        prom.stop()


def _warmup(
    spec: JobSpec, task: Task, tok: Tokenizer, cluster: _Cluster, out: Path, opts: RunOptions
) -> None:
    import ray

    w = spec.warmup
    sizes = even_split(w.batch_size, 1, len(cluster.trainers))
    with (out / "warmup.jsonl").open("w") as f:
        for i in range(1, w.sft_steps + 1):
            batch = _sft_batch(task, tok, task.sample(-i, w.batch_size, spec.rollout.seed))
            losses = ray.get(
                [
                    t.sft_step.remote(b)
                    for t, b in zip(cluster.trainers, split_rows(batch, sizes), strict=True)
                ]
            )
            # every trainer returns the loss of the whole batch (reduced over the trainers)
            f.write(json.dumps({"sft_step": i, "loss": losses[0]}) + "\n")
    opts.log(f"supervised warm-up: {w.sft_steps} steps, final loss {losses[0]:.3f}")
    _save(cluster, out, 0)


def _sync(cluster: _Cluster) -> dict[str, float]:
    import ray

    send = cluster.trainers[0].send_weights.remote(cluster.fp8_names)
    others = [t.send_weights.remote(cluster.fp8_names) for t in cluster.trainers[1:]]
    recv = [g.receive_weights.remote() for g in cluster.generators]
    sent: dict[str, float] = ray.get([send, *others, *recv])[0]
    return sent


def _save(cluster: _Cluster, out: Path, step: int) -> None:
    import ray

    tmp = checkpoint.begin(out, step)
    ray.get([t.save.remote(str(tmp)) for t in cluster.trainers])  # trainer 0 writes
    checkpoint.commit(out, tmp, step, {})


def _rl_step(spec: JobSpec, task: Task, tok: Tokenizer, cluster: _Cluster, step: int) -> StepMetrics:
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
            g.generate.remote(c, _step_seed(spec, step, i))
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
    results: list[tuple[torch.Tensor, TrainMetrics]] = ray.get(
        [t.train_step.remote(b, rw) for t, b, rw in zip(cluster.trainers, parts, rparts, strict=True)]
    )
    logp_old = torch.cat([x[0] for x in results])
    stats = results[0][1]  # each trainer's stats already cover the whole batch (all-reduced)
    t3 = time.perf_counter()

    sync = _sync(cluster)
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
        m.WEIGHT_SYNC_BYTES: float(sync.get("bytes", 0)),
        m.KV_CACHE_BYTES: float(sum(o[1]["kv_cache"] for o in outs)),
        m.WEIGHTS_BYTES: float(sum(o[1]["weights"] for o in outs)),
        m.TIME: time.time(),
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m workers.driver SPEC``: the entrypoint of a RayJob (no progress bar, a line per step)."""
    import argparse

    from rljob.spec import SpecError, load_spec

    parser = argparse.ArgumentParser(prog="python -m workers.driver", description=main.__doc__)
    parser.add_argument("spec", help="job spec file (YAML/JSON, or an RLJob manifest)")
    parser.add_argument("--output", help="override output_dir")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    parser.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics here")
    parser.add_argument("--job", default="", help="job label of the metrics")
    parser.add_argument("--namespace", default="default", help="namespace label of the metrics")
    args = parser.parse_args(argv)
    try:
        spec = load_spec(args.spec)
    except SpecError as err:
        print(f"error: {err}", flush=True)
        return 2

    def line(row: StepMetrics) -> None:
        print(
            json.dumps({k: row[k] for k in (m.STEP, m.REWARD_MEAN, m.TOKEN_MULT_PROB_ERROR)}),
            flush=True,
        )

    opts = RunOptions(
        resume=args.resume,
        metrics_port=args.metrics_port,
        job=args.job,
        namespace=args.namespace,
        on_step=line,
    )
    # SIGINT/SIGTERM (suspend, pod eviction): finish the step, checkpoint, exit 130
    import signal

    previous = {
        sig: signal.signal(sig, lambda signum, frame: opts.stop.set())
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        result = run(spec, args.output, opts)
    except MemoryError:
        # over the process's memory limit (the service sets RLIMIT_AS per tenant): say so, and exit
        # with the code the service reads as OutOfMemory
        print("error: out of memory: the driver went over its memory limit", flush=True)
        return EXIT_OUT_OF_MEMORY
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 130 if result.stopped else 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
