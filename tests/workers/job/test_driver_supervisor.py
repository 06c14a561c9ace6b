"""In-place retries (``workers.job.supervisor``): the rule, worked out case by case from the
module's list of when a retry on the same Ray cluster is not safe, and the supervisor running real
processes (a stand-in driver that exits as told) and the real driver's command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rljob.status import EXIT_OUT_OF_MEMORY, EXIT_TOO_MANY_FAULTS
from workers.job.supervisor import ATTEMPT_ENV, PREVIOUS_EXIT_ENV, decide, supervise


@pytest.mark.parametrize(
    ("code", "start", "now", "retried", "limit", "retry", "why"),
    [
        (0, 3, 3, 0, 2, False, "the driver finished"),
        (1, 3, 3, 0, 2, True, "the driver exited with 1 on a whole Ray cluster (3 nodes)"),
        (1, 3, 3, 1, 2, True, "the driver exited with 1 on a whole Ray cluster (3 nodes)"),
        (1, 3, 3, 2, 2, False, "the 2 in-place retries are spent"),
        (-9, 3, 3, 0, 2, True, "the driver exited with -9 on a whole Ray cluster (3 nodes)"),  # SIGKILL
        (1, 3, 2, 0, 2, False, "the Ray cluster lost nodes (2 alive of 3): a new cluster is needed"),
        (
            1,
            3,
            -1,
            0,
            2,
            False,
            "the Ray cluster does not say which nodes are alive: it cannot be trusted whole",
        ),
        (2, 3, 3, 0, 2, False, "the driver refused its spec or input"),
        (
            EXIT_OUT_OF_MEMORY,
            3,
            3,
            0,
            2,
            False,
            "the driver ran out of memory (the same pods have the same memory)",
        ),
        (
            EXIT_TOO_MANY_FAULTS,
            3,
            3,
            0,
            2,
            False,
            "more actor faults than the job allows: fresh pods are the remedy",
        ),
        (130, 3, 3, 0, 2, False, "the driver was stopped"),
        (-15, 3, 3, 0, 2, False, "the driver was stopped"),  # SIGTERM: an eviction
        (1, 3, 4, 0, 0, False, "the 0 in-place retries are spent"),  # a node more is fine; none allowed
    ],
)
def test_when_a_retry_on_the_same_cluster_is_safe(
    code: int, start: int, now: int, retried: int, limit: int, retry: bool, why: str
) -> None:
    decision = decide(code, start, now, retried, limit)
    assert (decision.retry, decision.why) == (retry, why)


def stand_in(tmp_path: Path, codes: list[int]) -> list[str]:
    """A driver that records its attempt's environment and exits with the next of ``codes``."""
    script = tmp_path / "driver.py"
    script.write_text(
        "import json, os, sys\n"
        f"log = {str(tmp_path / 'runs.jsonl')!r}\n"
        "runs = open(log).read().splitlines() if os.path.exists(log) else []\n"
        f"codes = {codes!r}\n"
        "with open(log, 'a') as f:\n"
        f"    env = [os.environ.get({ATTEMPT_ENV!r}), os.environ.get({PREVIOUS_EXIT_ENV!r})]\n"
        "    f.write(json.dumps([sys.argv[1:], *env]) + '\\n')\n"
        "sys.exit(codes[len(runs)])\n"
    )
    return [sys.executable, str(script)]


def runs(tmp_path: Path) -> list[list[object]]:
    return [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]


def test_a_driver_that_fails_is_started_again_with_its_attempt_and_the_last_exit(tmp_path: Path) -> None:
    lines: list[str] = []
    code = supervise(
        ["spec.json", "--resume"], 2, nodes=lambda: 3, log=lines.append, command=stand_in(tmp_path, [1, 7, 0])
    )
    assert code == 0
    assert runs(tmp_path) == [
        [["spec.json", "--resume"], "1", None],
        [["spec.json", "--resume"], "2", "1"],
        [["spec.json", "--resume"], "3", "7"],
    ]
    assert lines[0].startswith("driver attempt 1 exited with 1 after ")
    assert lines[0].endswith("on a whole Ray cluster (3 nodes); starting it again on the same Ray cluster")
    assert lines[-1].endswith(": the driver finished")


def test_the_supervisor_gives_up_with_the_drivers_code(tmp_path: Path) -> None:
    alive = iter([3, 2])  # at the start, then after the first failure: a node is gone
    code = supervise(["s"], 5, nodes=lambda: next(alive), log=lambda _: None, command=stand_in(tmp_path, [1]))
    assert code == 1 and len(runs(tmp_path)) == 1
    oom = tmp_path / "oom"
    oom.mkdir()
    code = supervise(["s"], 5, nodes=lambda: 3, log=lambda _: None, command=stand_in(oom, [3]))
    assert code == EXIT_OUT_OF_MEMORY and len(runs(oom)) == 1


@pytest.mark.slow  # a fresh interpreter that imports the driver: ~13 s (tests/conftest.py: tiers)
def test_the_real_driver_supervises_itself_and_passes_its_arguments_on(tmp_path: Path) -> None:
    """``python -m workers.job.driver ... --in-place-retries 2``: the flag is the supervisor's; the
    driver it starts gets the rest. A missing spec is the job's own fault: not retried, exit 2.
    (No Ray cluster here: the node count is -1, which alone would also refuse a retry.)"""
    missing = tmp_path / "nope.yaml"
    done = subprocess.run(
        [sys.executable, "-m", "workers.job.driver", str(missing), "--in-place-retries", "2", "--job", "j"],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[3],
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"error: {missing}" in done.stdout or "nope.yaml" in done.stdout
    assert "driver attempt 1 exited with 2 after " in done.stdout
    assert "the driver refused its spec or input" in done.stdout
    assert done.stdout.count("driver attempt") == 1
    bad = subprocess.run(
        [sys.executable, "-m", "workers.job.driver", str(missing), "--in-place-retries", "11"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert bad.returncode == 2 and "--in-place-retries 11: give 0 to 10" in bad.stdout
