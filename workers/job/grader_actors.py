"""A job's graders on its Ray cluster: the sandbox pool as Ray actors (:class:`RayGraderPool`) and
a ``model`` grader's model on an actor of its own (:func:`model_scorer`). :class:`JobRun
<workers.job.job_run.JobRun>` hands both to the task's :class:`~workers.tasks.grading.Graders`, so
that graders' code runs on the job's workers, spread over its nodes, and never in the process
that holds the job's state.

The pool: ``size`` actors (:func:`grader_actors`: ``FP8RL_GRADER_WORKERS``, else the cluster's
CPUs, at most :data:`MAX_GRADER_ACTORS`), each a :class:`~workers.tasks.sandbox.GraderPool` of one
sandboxed process (its limits, its wall clock, its replacement when it dies: that module's). The
actors reserve no CPU (``num_cpus=0``): grading runs between generation and training, so they
share the cores the trainers and generators reserve instead of waiting for cores of their own;
Ray spreads them over the nodes. A batch is shared out a chunk at a time, each actor holding one
chunk: a slow grader holds up one actor, not the batch. An actor that dies (its node lost, its
memory exceeded) is replaced and its chunk's samples are errors, counted like any grader error.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from typing import Any

from rljob.graders import ModelGrader
from workers.tasks.sandbox import START_TIMEOUT_S, WALL_SLACK_S, GraderPool

MAX_GRADER_ACTORS = 32
CHUNKS_PER_ACTOR = 4  # a batch in 4 chunks an actor: small enough to balance, few enough round trips


def grader_actors() -> int:
    """How many actors the job's grader pool has: ``FP8RL_GRADER_WORKERS`` when set, else the Ray
    cluster's CPUs, at most :data:`MAX_GRADER_ACTORS`."""
    import ray

    asked = os.environ.get("FP8RL_GRADER_WORKERS", "").strip()
    if asked:
        n = int(asked)
        if not 1 <= n <= MAX_GRADER_ACTORS:
            raise ValueError(f"FP8RL_GRADER_WORKERS={asked}: use 1 to {MAX_GRADER_ACTORS}")
        return n
    cpus = int(ray.cluster_resources().get("CPU", 1))  # type: ignore[no-untyped-call]
    return max(1, min(cpus, MAX_GRADER_ACTORS))


class RayGraderPool:
    """The grader sandbox as ``size`` Ray actors (module docstring); a
    :class:`~workers.tasks.grading.SandboxPool`."""

    def __init__(self, size: int, memory_mb: int) -> None:
        import ray

        if size < 1:
            raise ValueError(f"a grader pool needs at least 1 actor, not {size}")
        self.memory_mb = memory_mb
        self.restarts = 0
        self._loads: list[tuple[str, str, float]] = []
        self._actors = [self._start() for _ in range(size)]
        hows = set(ray.get([a.how.remote() for a in self._actors], timeout=START_TIMEOUT_S * 2))
        self.how = "; ".join(sorted(hows))  # one text unless the nodes differ

    def _start(self) -> Any:
        import ray

        cls: Any = ray.remote(num_cpus=0, scheduling_strategy="SPREAD")(GraderPool)
        return cls.remote(1, self.memory_mb)

    @property
    def size(self) -> int:
        return len(self._actors)

    def where(self) -> str:
        return f"a pool of {self.size} Ray actors, one sandboxed process each: {self.how}"

    def load(self, key: str, source: str, timeout_s: float) -> str | None:
        """Compile a python grader in every actor's process; the first error text, or None."""
        import ray

        errors = ray.get([a.load.remote(key, source, timeout_s) for a in self._actors])
        error = next((e for e in errors if e is not None), None)
        if error is None:
            self._loads.append((key, source, timeout_s))
        return error

    def _replace(self, i: int) -> None:
        import ray

        ray.kill(self._actors[i])
        self.restarts += 1
        actor = self._start()
        for key, source, timeout_s in self._loads:
            actor.load.remote(key, source, timeout_s)  # in order, before any batch it is sent
        self._actors[i] = actor

    def run(self, requests: list[tuple[dict[str, Any], float]]) -> list[dict[str, Any]]:
        """Each (request, timeout_s)'s answer, in order, as :meth:`GraderPool.run` gives them."""
        import ray
        from ray.exceptions import RayError

        size = max(1, math.ceil(len(requests) / (self.size * CHUNKS_PER_ACTOR)))
        chunks = deque((start, requests[start : start + size]) for start in range(0, len(requests), size))
        results: list[dict[str, Any]] = [{"error": "no answer"}] * len(requests)
        idle = list(range(self.size))
        running: dict[Any, tuple[int, int, int, float]] = {}  # ref -> (actor, start, length, deadline)
        while chunks or running:
            while idle and chunks:
                i = idle.pop()
                start, chunk = chunks.popleft()
                # each request's own wall clock, its slack, and a replaced process's start
                bound = sum(t + WALL_SLACK_S for _, t in chunk) + START_TIMEOUT_S
                running[self._actors[i].run.remote(chunk)] = (i, start, len(chunk), time.monotonic() + bound)
            wait = min(d for *_, d in running.values()) - time.monotonic()
            done, _ = ray.wait(list(running), num_returns=1, timeout=max(wait, 0.0))
            for ref in done:
                i, start, length, _ = running.pop(ref)
                try:
                    results[start : start + length] = ray.get(ref)
                except RayError as err:  # the actor died with the chunk
                    text = f"the grader's actor died: {type(err).__name__}"
                    results[start : start + length] = [{"error": text}] * length
                    self._replace(i)
                idle.append(i)
            now = time.monotonic()
            for ref, (i, start, length, deadline) in list(running.items()):
                if now >= deadline:  # the actor stopped answering: its chunk timed out
                    running.pop(ref)
                    results[start : start + length] = [{"timeout": True}] * length
                    self._replace(i)
                    idle.append(i)
        return results

    def close(self) -> None:
        import ray

        for actor in self._actors:
            ray.kill(actor)  # its process; its sandboxed one ends with it (bubblewrap's --die-with-parent, or
            # the end of its requests' pipe)
        self._actors = []


class _RayScorer:
    """A model grader's :class:`~workers.tasks.grading.Scorer` on its Ray actor."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def score(self, texts: list[str]) -> list[float | None]:
        import ray

        scores: list[float | None] = ray.get(self.actor.score.remote(texts))
        return scores

    def close(self) -> None:
        import ray

        ray.kill(self.actor)


def model_scorer(grader: ModelGrader) -> _RayScorer:
    """A ``model`` grader's model on a Ray actor of its own: 1 CPU, and a GPU with ``gpus: 1``
    (the job's Ray cluster must have one to spare)."""
    import ray

    from workers.job.ray_workers import ModelGraderWorker

    cls: Any = ray.remote(num_cpus=1, num_gpus=grader.gpus)(ModelGraderWorker)
    return _RayScorer(cls.remote(grader.model_dump_json(), grader.gpus))
