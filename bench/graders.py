"""``fp8rl bench graders``: is grading the step's bottleneck? A trivial python grader that takes
``work_ms`` of CPU per sample, scored on ``samples`` samples three ways in one run:

- ``in process``: the grader's function called here, one sample after another (the baseline: what
  grading costs without a sandbox, on one core);
- ``pool``: through the grader sandbox's pool (:mod:`workers.tasks.sandbox`), ``workers``
  processes (default: the machine's cores), each sample a request;
- ``Ray actors``: through the pool a job grades with (:mod:`workers.job.grader_actors`), ``workers``
  actors of one sandboxed process each, on a local Ray of ``workers`` CPUs started for the bench;
- the cost of starting the pool (its processes and their limits) and of one round trip, and of
  starting the actors.

The target (issue 50): 512 samples of a 10 ms grader in at most 3 s on 2 cores. The grader burns
CPU (a loop on the clock), not a sleep, so the pool's speed-up is bounded by the cores.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from rljob.spec import TaskSpec
from workers.job.grader_actors import RayGraderPool
from workers.tasks.grading import Graders
from workers.tasks.sandbox import GraderPool, Launcher

SOURCE = """
import time
def grade(sample, item):
    end = time.process_time() + {seconds}
    while time.process_time() < end:
        pass
    return len(sample["output_text"]) % 2
"""


@dataclass(frozen=True)
class Row:
    entry: dict[str, Any]
    answer: str = ""


@dataclass(frozen=True)
class GraderBench:
    samples: int
    work_ms: float
    workers: int
    how: str
    in_process_s: float
    pool_s: float
    start_s: float
    round_trip_ms: float
    actors_s: float
    actors_start_s: float

    def table(self) -> str:
        ratio = self.in_process_s / self.pool_s if self.pool_s else float("inf")

        def row(name: str, seconds: float, vs: float) -> str:
            return f"{name:<28}{seconds:>10.3f}{self.samples / seconds:>12.1f}{vs:>14.2f}x"

        per_process = self.start_s / self.workers * 1e3
        return "\n".join(
            [
                f"grader sandbox: {self.how}; {self.workers} processes",
                f"{self.samples} samples x {self.work_ms:g} ms of CPU each",
                f"{'variant':<28}{'seconds':>10}{'samples/s':>12}{'vs in process':>15}",
                row("in process (baseline)", self.in_process_s, 1.0),
                row("sandbox pool", self.pool_s, ratio),
                row("Ray actors (a job's pool)", self.actors_s, self.in_process_s / self.actors_s),
                f"starting the pool: {self.start_s * 1e3:.0f} ms ({per_process:.0f} ms a process); "
                f"one round trip of an empty grader: {self.round_trip_ms:.2f} ms",
                f"starting {self.workers} Ray actors and their processes: {self.actors_start_s * 1e3:.0f} ms",
            ]
        )


def run(samples: int = 512, work_ms: float = 10.0, workers: int | None = None) -> GraderBench:
    if samples < 1 or work_ms < 0:
        raise ValueError("--samples >= 1 and --work-ms >= 0")
    workers = workers or os.cpu_count() or 1
    source = SOURCE.replace("{seconds}", repr(work_ms / 1000))
    texts = [f"sample {i}" for i in range(samples)]
    rows = [Row({}) for _ in texts]

    namespace: dict[str, Any] = {}
    exec(compile(source, "<bench grader>", "exec"), namespace)  # the bench's own code
    t0 = time.perf_counter()
    baseline = [namespace["grade"]({"output_text": t}, {}) for t in texts]
    in_process_s = time.perf_counter() - t0

    launcher = Launcher.choose()
    t0 = time.perf_counter()
    pool = GraderPool(workers, launcher=launcher)
    start_s = time.perf_counter() - t0
    try:
        pool.load("empty", "def grade(sample, item):\n    return 1.0\n", 10)
        trips = 200
        t0 = time.perf_counter()
        pool.run([({"op": "grade", "key": "empty", "sample": {}, "item": {}, "cpu_s": 5}, 5)] * trips)
        round_trip_ms = (time.perf_counter() - t0) / trips * workers * 1e3
    finally:
        pool.close()

    spec = TaskSpec.model_validate({"dataset": "rows.jsonl", "grader": {"type": "python", "source": source}})
    graders = Graders(spec.grader_list(), lambda a, r: 0.0, pool_size=workers, launcher=launcher)
    _, pool_s = _timed(graders, texts, rows, baseline, "the pool")
    actors_start_s, actors_s = _through_actors(spec, texts, rows, baseline, workers)
    return GraderBench(
        samples,
        work_ms,
        workers,
        launcher.how,
        in_process_s,
        pool_s,
        start_s,
        round_trip_ms,
        actors_s,
        actors_start_s,
    )


def _timed(
    graders: Graders, texts: list[str], rows: list[Row], baseline: list[Any], what: str
) -> tuple[float, float]:
    """Seconds ``graders`` take to be ready (their pool started, the grader loaded: not part of
    the grading) and then to grade ``texts``; their scores must be the function's own."""
    try:
        t0 = time.perf_counter()
        graders.check()
        ready_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        grades, _ = graders.grade(texts, rows)
        seconds = time.perf_counter() - t0
    finally:
        graders.close()
    if [g.reward for g in grades] != [float(b) for b in baseline]:
        raise AssertionError(f"{what}'s scores differ from the function's own")
    return ready_s, seconds


def _through_actors(
    spec: TaskSpec, texts: list[str], rows: list[Row], baseline: list[Any], workers: int
) -> tuple[float, float]:
    """Seconds to start a job's pool of Ray actors (on a local Ray of ``workers`` CPUs, unless one
    runs) and to grade ``texts`` through it."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=workers, include_dashboard=False, logging_level=logging.ERROR)
    try:
        graders = Graders(spec.grader_list(), lambda a, r: 0.0)
        graders.use_pool(lambda memory_mb: RayGraderPool(workers, memory_mb))  # started by check()
        return _timed(graders, texts, rows, baseline, "the Ray actors")
    finally:
        if started:
            ray.shutdown()
