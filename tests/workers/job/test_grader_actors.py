"""The grader sandbox as a job runs it: a pool of Ray actors (workers.job.grader_actors), each holding
one sandboxed process. Expected scores are worked by hand from the grader's source."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rljob.spec import TaskSpec
from workers.job.grader_actors import MAX_GRADER_ACTORS, RayGraderPool, grader_actors
from workers.tasks.grading import Graders

pytestmark = pytest.mark.slow  # a local Ray: ~15 s to start

# the score is the sample's length over 10; "loop" never returns (its wall clock cuts it off)
SOURCE = """
def grade(sample, item):
    text = sample["output_text"]
    if text == "loop":
        while True:
            pass
    if text == "raise":
        raise ValueError("asked to")
    return len(text) / 10
"""


class Row:
    def __init__(self, entry: dict[str, Any]) -> None:
        self.entry, self.answer = entry, ""


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    import ray

    ray.init(num_cpus=2, include_dashboard=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def request(text: str, timeout_s: float = 2.0) -> tuple[dict[str, Any], float]:
    return {
        "op": "grade",
        "key": "g",
        "sample": {"output_text": text},
        "item": {},
        "cpu_s": timeout_s,
    }, timeout_s


def children_of(pid: int) -> list[str]:
    """The command lines of ``pid``'s child processes."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                out.append((stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, IndexError, ValueError):
            continue
    return out


def test_the_pool_answers_in_order_across_its_actors(ray_cluster: Any) -> None:
    pool = RayGraderPool(2, 256)
    try:
        assert pool.load("g", SOURCE, 5.0) is None
        texts = ["a" * (i % 10) for i in range(40)]
        answers = pool.run([request(t) for t in texts])
        assert [a["score"] for a in answers] == [(i % 10) / 10 for i in range(40)]
        # the sandboxed processes are the actors' children, not this process's
        assert not [c for c in children_of(os.getpid()) if "child.py" in c]
        assert "a pool of 2 Ray actors" in pool.where()
    finally:
        pool.close()


def test_a_looping_or_raising_grader_costs_its_sample_only(ray_cluster: Any) -> None:
    pool = RayGraderPool(2, 256)
    try:
        assert pool.load("g", SOURCE, 5.0) is None
        answers = pool.run([request("abc"), request("loop", 1.0), request("raise"), request("abcde")])
        assert answers[0] == {"score": 0.3} and answers[3] == {"score": 0.5}
        assert answers[1].get("timeout") is True
        assert "asked to" in answers[2]["error"]
    finally:
        pool.close()


def kill_and_wait(ray: Any, actor: Any) -> None:
    """Kill an actor and return once it is dead: ``ray.kill`` only asks, and a call sent just after
    it may still be answered by the living actor (it was, once, on a busy CI machine)."""
    from ray.exceptions import RayActorError

    ray.kill(actor)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get(actor.how.remote(), timeout=10)
        except RayActorError:
            return
        time.sleep(0.1)
    raise AssertionError("the killed actor still answered after 30 s")


def test_a_dead_actor_is_replaced_with_its_graders_loaded(ray_cluster: Any) -> None:
    ray = ray_cluster
    pool = RayGraderPool(1, 256)
    try:
        assert pool.load("g", SOURCE, 5.0) is None
        kill_and_wait(ray, pool._actors[0])  # its node lost, say
        answers = pool.run([request("ab"), request("abcd")])  # two chunks of one
        assert "the grader's actor died" in answers[0]["error"]  # the chunk sent to the dead actor
        assert answers[1] == {"score": 0.4}  # its replacement, with the grader loaded
        assert pool.restarts == 1
        assert pool.run([request("ab"), request("abcd")]) == [{"score": 0.2}, {"score": 0.4}]
    finally:
        pool.close()


def test_a_jobs_graders_grade_on_the_actors(ray_cluster: Any) -> None:
    spec = TaskSpec.model_validate({"dataset": "rows.jsonl", "grader": {"type": "python", "source": SOURCE}})
    g = Graders(spec.grader_list(), lambda a, r: 0.0, pool_size=1)
    try:
        assert g.check() == []  # compiled in a process of this one's first, as the driver does
        g.use_pool(lambda memory_mb: RayGraderPool(2, memory_mb))
        grades, reports = g.grade(["abc", "raise", "abcdefghij"], [Row({})] * 3)
        assert [x.reward for x in grades] == [0.3, 0.0, 1.0]
        assert reports["python"].errors == 1
        assert isinstance(g._pool, RayGraderPool)
    finally:
        g.close()


def test_the_pool_is_sized_to_the_clusters_cpus(ray_cluster: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FP8RL_GRADER_WORKERS", raising=False)
    assert grader_actors() == 2  # the cluster's num_cpus
    monkeypatch.setenv("FP8RL_GRADER_WORKERS", "3")
    assert grader_actors() == 3
    monkeypatch.setenv("FP8RL_GRADER_WORKERS", str(MAX_GRADER_ACTORS + 1))
    with pytest.raises(ValueError, match="FP8RL_GRADER_WORKERS"):
        grader_actors()
